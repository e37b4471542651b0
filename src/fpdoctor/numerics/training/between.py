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
import re
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
    # the statement of the step's own block that holds each of `lines` (a `for` loop by its `for`), the same order
    holders: tuple[tuple[int, str], ...] = ()

    def listed(self) -> str:
        """'line 41 (`clip_grad_norm_(...)`)' for each line between, joined."""
        return "; ".join(f"line {n} (`{text}`)" for n, text in self.lines)


# a statement that clears gradients: zero_grad(), `p.grad = None`, `p.grad.zero_()`, a fill or product by 0
_CLEARS = re.compile(r"zero_grad\(|\.grad\s*=\s*None|\.grad\.(?:zero_\(|fill_\(0|mul_\(0)")


def clearing(seen: Between) -> tuple[int, str] | None:
    """(line, source) of the first statement between the backward and the step that clears gradients, named
    by the statement of the step's block that holds it (a `for p in ...: p.grad = None` loop by its `for`:
    moving its body alone breaks the loop)."""
    holders = seen.holders or seen.lines
    return next((held for (_, text), held in zip(seen.lines, holders, strict=False) if _CLEARS.search(text)), None)


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
    held = [_holder(block, s) for s in processing]
    holders = [h for h in held if first < h.lineno]
    before = (holders[0].lineno, ast.unparse(holders[0]).splitlines()[0]) if holders else None
    scaler, optimizer = _step_names(statements, line)
    whole = tuple((h.lineno, ast.unparse(h).splitlines()[0]) for h in held)
    return Between(path, first, line, lines, scaler, optimizer, before, whole)


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
    """Where a step's unscale_ (and the clip after it) go so that it runs once, after the last backward:
    just before the step's own statement; and its update(), just after it. Read from the source."""

    path: str
    step: tuple[int, str]  # the statement that steps the optimizer: line, source
    # statements to put just before the step, in order (an `if` they fill, whole): first line, last, source
    moved: tuple[tuple[int, int, str], ...]
    after: tuple[tuple[int, int, str], ...]  # an update() to put just after the step
    removed: tuple[tuple[int, int, str], ...]  # update() calls to delete (one already follows the step)

    @staticmethod
    def listed(spans: tuple[tuple[int, int, str], ...]) -> str:
        return ", ".join(
            f"line {a} (`{text}`)" if a == b else f"lines {a}-{b} (`{text}` and what it holds)" for a, b, text in spans
        )


def unscale_names(path: str, line: int) -> tuple[str | None, str | None]:
    """`scaler.unscale_(opt)` at `line` -> ("scaler", "opt"); (None, None) where it cannot be read."""
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None, None
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "unscale_" and n.args
            and n.lineno <= line <= (n.end_lineno or n.lineno)
        ):  # fmt: skip
            return ast.unparse(n.func.value), ast.unparse(n.args[0])
    return None, None


def accumulation(path: str, unscale_line: int, step_line: int) -> Accumulation | None:
    """For an unscale_ at `unscale_line` that a backward followed before the step at `step_line`, both in
    one function of `path`: the statements to move (None: another function, or unreadable source)."""
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    scope = _scope(tree, unscale_line)
    if _scope(tree, step_line) is not scope:
        return None
    block = _block_of(scope, unscale_line)
    unscale = next((s for s in block if s.lineno <= unscale_line <= (s.end_lineno or s.lineno)), None)
    step_block = _block_of(scope, step_line)
    step = next((s for s in step_block if s.lineno <= step_line <= (s.end_lineno or s.lineno)), None)
    if unscale is None or step is None or unscale is step:
        return None
    scaler = unscale_names(path, unscale_line)[0]

    def update(s: ast.stmt) -> bool:  # `scaler.update()`, not a progress bar's or a dict's
        return any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
            and (scaler is None or ast.unparse(n.func.value) == scaler)
            for n in ast.walk(s)
        )  # fmt: skip

    tail = [s for s in block if s.lineno >= unscale.lineno and s is not step and not _holds(s, step)]
    moved = [s for s in tail if not update(s) and not _calls(s, "zero_grad") and _moves(s)]
    if moved and len(moved) == len(block) and (holder := _parent_if(scope, block)) is not None:
        moved = [holder]  # the `if` they fill, whole: left empty it would not parse
    # the update() calls after the unscale_ in the loop that holds it, but not after the step in its block:
    # they run more than once a step; one after the step (there already, or moved there) is the step's own
    following = step_block[step_block.index(step) + 1 :]
    kept = [s for s in following if update(s)]
    loop = min(
        (n for n in ast.walk(scope) if isinstance(n, (ast.For, ast.While)) and _holds(n, unscale)),
        key=lambda n: (n.end_lineno or n.lineno) - n.lineno,
        default=None,
    )
    inside = _statements(loop) if loop is not None else tail
    updates = [
        s for s in inside
        if update(s) and s.lineno > unscale.lineno and not any(s is k or _holds(k, s) for k in kept)
        and not any(_holds(m, s) for m in moved)
    ]  # fmt: skip
    after: list[ast.stmt] = []
    if updates and not kept:
        after, updates = updates[:1], updates[1:]  # one update() goes after the step, the others are deleted
    head = (step.lineno, ast.unparse(step).splitlines()[0])
    return Accumulation(path, head, _spans(moved), _spans(after), _spans(updates))


def _moves(statement: ast.stmt) -> bool:
    """An unscale_ or what processes the gradients (a clip): what must run once, just before the step."""
    return _calls(statement, "unscale_") or _processes(statement)


def _holds(outer: ast.stmt, inner: ast.stmt) -> bool:
    return outer.lineno <= inner.lineno and (inner.end_lineno or inner.lineno) <= (outer.end_lineno or outer.lineno)


def _parent_if(scope: ast.AST, block: list[ast.stmt]) -> ast.If | None:
    """The `if` whose body is `block` (no else), else None."""
    for node in ast.walk(scope):
        if isinstance(node, ast.If) and node.body is block and not node.orelse:
            return node
    return None


def _spans(statements: list[ast.stmt]) -> tuple[tuple[int, int, str], ...]:
    return tuple((s.lineno, s.end_lineno or s.lineno, ast.unparse(s).splitlines()[0]) for s in statements)
