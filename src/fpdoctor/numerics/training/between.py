"""What the code does to the gradients between a step's backward and its optimizer step, read from
its source.

A reference step that finds the gradients the optimizer took departing from those the backward
made has a suspect: the code that ran between. At that moment the optimizer's step is in progress,
so the first frame of the user's code on the stack is the line that called it (`scaler.step(opt)`).
In the function holding that line, the statements after the last `.backward(` before it that call a
function (a clip) or write a `.grad` are the processing, named with their lines; the step call names
the scaler and the optimizer as the code does. Read once, where such a finding is made.
"""

from __future__ import annotations

import ast
import linecache
import sys
from dataclasses import dataclass

from fpdoctor.userframes import function_at, user_location


@dataclass(frozen=True)
class Between:
    """The lines between the backward and the optimizer's step in one function of the user's file."""

    path: str
    backward: int  # the line of the last `.backward(` before the step
    step: int  # the line that called the optimizer's step
    lines: tuple[tuple[int, str], ...]  # (line, its source) of each statement between that processes gradients
    scaler: str | None  # as the step call names them: `scaler.step(opt)` -> "scaler", "opt"
    optimizer: str | None
    # where a call inserted runs once before the first of `lines`: its statement in the step's own block
    # (the `for` or `if` that holds it), line and source
    before: tuple[int, str] | None = None

    def listed(self) -> str:
        """'line 41 (`clip_grad_norm_(...)`)' for each line between, joined."""
        return "; ".join(f"line {n} (`{text}`)" for n, text in self.lines)


def read() -> Between | None:
    """The statements between, for the optimizer step in progress (None: no user frame, its source
    unreadable, no backward before it in the same function)."""
    found = user_location(sys._getframe(1))
    if found is None:
        return None
    path, line, _ = found
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    scope = _scope(tree, line)
    statements = [s for s in _statements(scope) if (s.end_lineno or s.lineno) <= line]
    backwards = [s.lineno for s in statements if _calls(s, "backward")]
    if not backwards:
        return None
    first = max(backwards)
    # each processing statement named by the statement of the step's own block that holds it (a `for p
    # in params: p.grad.clamp_()` by its `for`): a call inserted before it runs once, as unscale_ must
    block = _block_of(scope, line)
    processing = [s for s in statements if first < s.lineno < line and _processes(s)]
    lines = tuple((s.lineno, ast.unparse(s).splitlines()[0]) for s in processing)
    holders = [h for h in (_holder(block, s) for s in processing) if first < h.lineno]
    before = (holders[0].lineno, ast.unparse(holders[0]).splitlines()[0]) if holders else None
    scaler, optimizer = _step_names(statements, line)
    return Between(path, first, line, lines, scaler, optimizer, before)


def _block_of(scope: ast.AST, line: int) -> list[ast.stmt]:
    """The list of statements (a body) that directly holds the statement at `line`."""
    todo = [getattr(scope, "body", [])]
    while todo:
        body = todo.pop()
        for node in body:
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                inner = [getattr(node, k, []) for k in ("body", "orelse", "finalbody", "handlers")]
                inner = [b for b in inner if b and any(n.lineno <= line <= (n.end_lineno or n.lineno) for n in b)]
                if not inner or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    return body
                todo.append(inner[0])
                break
    return []


def _holder(block: list[ast.stmt], statement: ast.stmt) -> ast.stmt:
    """The statement of `block` whose lines hold `statement` (itself where it is in the block)."""
    end = statement.end_lineno or statement.lineno
    return next((s for s in block if s.lineno <= statement.lineno and end <= (s.end_lineno or s.lineno)), statement)


def _scope(tree: ast.Module, line: int) -> ast.AST:
    """The innermost function whose lines hold `line`, else the module."""
    return function_at(tree, line) or tree


def _statements(scope: ast.AST) -> list[ast.stmt]:
    """The simple statements of `scope`, in loops and branches too, not in functions defined inside it."""
    out: list[ast.stmt] = []
    todo = list(getattr(scope, "body", []))
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        blocks = [getattr(node, k, []) for k in ("body", "orelse", "finalbody", "handlers")]
        if any(blocks):
            todo[:0] = [n for block in blocks for n in block]
        else:
            out.append(node)
    return sorted(out, key=lambda s: s.lineno)


def _calls(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr for n in ast.walk(node)
    )


def _processes(node: ast.stmt) -> bool:
    """A statement that may change the gradients: a call whose name says clip or unscale, or one that
    reads or writes a `.grad`."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr == "grad":
            return True
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if "clip" in name or "unscale" in name or "grad" in name:
                return True
    return False


def _step_names(statements: list[ast.stmt], line: int) -> tuple[str | None, str | None]:
    """`scaler.step(opt)` -> ("scaler", "opt"); `opt.step()` -> (None, "opt"); at the step's line."""
    for s in statements:
        if not s.lineno <= line <= (s.end_lineno or s.lineno):
            continue
        for n in ast.walk(s):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step":
                owner = ast.unparse(n.func.value)
                given = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "optimizer"), None)
                if given is not None:  # scaler.step(opt), scaler.step(optimizer=opt)
                    return owner, ast.unparse(given)
                return None, owner
    return None, None


@dataclass(frozen=True)
class Accumulation:
    """A micro-batch loop that unscales inside it: the loop, and what of it runs once per optimizer step."""

    path: str
    loop: tuple[int, str]  # the `for`/`while` that holds the backward and the unscale_: line, source
    # the statements of the unscale_'s own block, from it on, that unscale, process the gradients, step or
    # update (an `if` that holds a step, whole): first line, last line, first line's source
    moved: tuple[tuple[int, int, str], ...]
    scaler: str | None  # as the unscale_ call names them: `scaler.unscale_(opt)` -> "scaler", "opt"
    optimizer: str | None
    # update() calls among them to delete, not move: the step is after the loop and so is an update()
    removed: tuple[tuple[int, int, str], ...] = ()

    @staticmethod
    def listed(spans: tuple[tuple[int, int, str], ...]) -> str:
        return ", ".join(
            f"line {a} (`{text}`)" if a == b else f"lines {a}-{b} (`{text}` and what it holds)" for a, b, text in spans
        )


def accumulation(path: str, line: int) -> Accumulation | None:
    """The innermost loop holding the unscale_ at `line` of `path` and a `.backward(` before it (None:
    no such loop, or the source cannot be read)."""
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    scope = _scope(tree, line)
    loops = [
        node
        for node in ast.walk(scope)
        if isinstance(node, (ast.For, ast.While))
        and node.lineno < line <= (node.end_lineno or node.lineno)
        and any(_calls(s, "backward") and s.lineno < line for s in _statements(node))
    ]
    if not loops:
        return None
    loop = max(loops, key=lambda node: node.lineno)
    block = _block_of(scope, line)
    unscale = next((s for s in block if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    if unscale is None:
        return None
    wanted = ("unscale_", "step", "update")
    moved = [
        s for s in block if s.lineno >= unscale.lineno and (_processes(s) or any(_calls(s, name) for name in wanted))
    ]
    names: tuple[str | None, str | None] = (None, None)
    for n in ast.walk(unscale):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "unscale_" and n.args:
            names = ast.unparse(n.func.value), ast.unparse(n.args[0])
    removed: list[ast.stmt] = []
    after = [s for s in _statements(scope) if s.lineno > (loop.end_lineno or loop.lineno)]
    if not any(_calls(s, "step") for s in moved) and any(_calls(s, "update") for s in after):
        # moved before the step after the loop, an update() would reset the scaler between unscale_ and step
        removed = [s for s in moved if _calls(s, "update")]
        moved = [s for s in moved if not any(s is r for r in removed)]
    head = (loop.lineno, ast.unparse(loop).splitlines()[0])
    return Accumulation(path, head, _spans(moved), *names, removed=_spans(removed))


def _spans(statements: list[ast.stmt]) -> tuple[tuple[int, int, str], ...]:
    return tuple((s.lineno, s.end_lineno or s.lineno, ast.unparse(s).splitlines()[0]) for s in statements)
