"""Fixes at the op, not the module: one op inside a module - an attention's q·kᵀ that overflows
fp16 - computed in fp32 together with the ops that consume its result, up to the next op that
brings values back into range (the softmax), whose result goes back to the model's dtype.

That keeps far less in fp32 than the whole module (its projections stay in fp16). `Fp32Ops`
does it at run time, a dispatch mode on only while the fixed module runs (plan verifies with it,
`apply_plan` installs it); `edit` writes the same change as an edit of the user's own lines, the
code to apply it without fpdoctor and without a dispatch mode.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import map_tensors
from fpdoctor.provenance import Provenance
from fpdoctor.pytrees import tensors_in
from fpdoctor.torchprivate import TorchDispatchMode
from fpdoctor.userframes import function_at, user_location

# Ops after which values are back in a small range: the region ends, their result is cast back.
_ENDS = ("aten._softmax.", "aten.softmax.", "aten._safe_softmax.", "aten._log_softmax.", "aten.log_softmax.")
_CASTS = ("aten._to_copy.", "aten.to.", "aten._to_dtype")


@dataclass(frozen=True)
class OpFix:
    """`op` (an aten overload), the `index`-th op dispatched in a call of `module` (the ones
    inside its submodules counted too), computed in fp32 with what consumes it."""

    module: str
    op: str
    index: int
    location: str | None = None  # file:line of the op in the user's code
    end: str | None = None  # file:line of the op that ended its fp32 region (the softmax)

    def as_dict(self) -> dict[str, Any]:
        return {"module": self.module, "op": self.op, "index": self.index, "location": self.location, "end": self.end}


class Fp32Ops(TorchDispatchMode):
    """Runs the fixes' ops, and every op that reads a result of theirs, in fp32; an op in _ENDS
    (or a cast) ends that: its result goes back to `back_to`. Which module is running comes from
    hooks (`install`); `ends` collects where each region ended (file:line), for the edit."""

    def __init__(self, fixes: list[OpFix], back_to: torch.dtype) -> None:
        super().__init__()
        self.fixes = {(f.module, f.index): f for f in fixes}
        self.back_to = back_to
        self.stack: list[tuple[str, int]] = []  # (module, ops dispatched in its call so far)
        self.marked = Provenance()
        self.ends: dict[str, str | None] = {}  # fix module -> file:line where its region ended
        # fix module -> the dtype its op read: the region's result goes back to it, as the edit's
        # `.to(q.dtype)` does (a module of the same class kept in fp32 reads fp32 there, not back_to)
        self.read: dict[str, torch.dtype] = {}

    def back(self, t: torch.Tensor) -> torch.dtype:
        """The dtype `t` leaves a fixed module in: its region's read dtype where the region made it."""
        owner = self.marked.get(t)
        return t.dtype if owner is None else self.read.get(owner, self.back_to)

    def enter(self, name: str) -> None:
        self.stack.append((name, 0))

    def leave(self, name: str) -> None:
        while self.stack:
            if self.stack.pop()[0] == name:
                return

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        started = None
        for depth, (name, count) in enumerate(self.stack):
            self.stack[depth] = (name, count + 1)
            started = started or self.fixes.get((name, count))
        region = [self.marked.get(t) for t in tensors_in((args, kwargs))]
        owner = started.module if started is not None else next((r for r in region if r is not None), None)
        if owner is None:
            return func(*args, **kwargs)
        if started is not None:
            first = next((t for t in tensors_in((args, kwargs)) if t.is_floating_point()), None)
            self.read[owner] = first.dtype if first is not None else self.back_to
        name = str(func)
        if name.startswith(_CASTS):  # the user's own cast ends the region where they put it
            self.ends.setdefault(owner, _where())
            return func(*args, **kwargs)
        out = func(*_fp32(args), **_fp32(kwargs))
        if name.startswith(_ENDS):
            self.ends.setdefault(owner, _where())
            back = self.read.get(owner, self.back_to)
            return map_tensors(out, lambda t: t.to(back) if t.is_floating_point() else t)
        for t in tensors_in(out):
            if t.is_floating_point():
                self.marked.set(t, owner)
        return out


def _fp32(value: Any) -> Any:
    return map_tensors(value, lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)


def _where() -> str | None:
    location = user_location(sys._getframe(2))
    return f"{location[0]}:{location[1]}" if location else None


def install(model: nn.Module, fixes: list[OpFix], back_to: torch.dtype) -> Fp32Ops:
    """Hooks on `model` that run `fixes` in fp32 (and cast what their modules return back to
    `back_to`). The dispatch mode is on only while a fixed module runs, so the rest of the model
    pays nothing; a second call replaces the first."""
    uninstall(model)
    fixes = _every_instance(model, fixes)
    mode = Fp32Ops(fixes, back_to)
    handles = []
    fixed = {f.module for f in fixes}
    for root in sorted(fixed):
        for name, module in model.get_submodule(root).named_modules(prefix=root):
            if name != root and name in fixed:
                continue  # a fixed module inside another: its own pass below

            def pre(mod: nn.Module, args: Any, name: str = name, outer: bool = name == root) -> None:
                if outer and not mode.stack:
                    mode.__enter__()
                mode.enter(name)

            def post(mod: nn.Module, args: Any, output: Any, name: str = name, outer: bool = name == root) -> Any:
                mode.leave(name)
                if not outer:
                    return None
                if not mode.stack:
                    mode.__exit__(None, None, None)
                # nothing the fp32 region made leaves a fixed module: a value of it that no end cast back
                # goes back to the dtype the region's op read (back_to, or fp32 in a module kept whole)
                return map_tensors(output, lambda t: t.to(mode.back(t)) if t.is_floating_point() else t)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]
    model._fpdoctor_fp32_ops = (mode, handles)  # type: ignore[assignment]
    return mode


def _every_instance(model: nn.Module, fixes: list[OpFix]) -> list[OpFix]:
    """The fixes, and the same fix in every other module of each fixed module's class: the edit of
    the source line that `edit` prints changes them all, so the run that checks it changes them all."""
    named = dict(model.named_modules())
    out, seen = list(fixes), {f.module for f in fixes}
    for fix in fixes:
        kind = type(named.get(fix.module))
        for name, module in named.items():
            if type(module) is kind and name not in seen:
                seen.add(name)
                out.append(dataclasses.replace(fix, module=name))
    return out


def uninstall(model: nn.Module) -> None:
    held = getattr(model, "_fpdoctor_fp32_ops", None)
    if held is not None:
        for handle in held[1]:
            handle.remove()
        del model._fpdoctor_fp32_ops


def edit(fix: OpFix, end: str | None, dtype: str) -> str:
    """The change to the user's source that does what `Fp32Ops` does for `fix`: the op's operands
    `.float()` on its line, the region's last result `.to(dtype)` on its line; as comments to
    paste from, or a plain instruction where the lines do not read as expected."""
    instruction = (
        f"# in `{fix.module}`: compute {fix.op}{_at(fix.location)} in fp32 (its operands .float()), and cast the "
        f"result of what consumes it{_at(end)} back with .to({dtype})"
    )
    # back to the dtype the op's operand had (`q.dtype`): the same line runs in every module of the class,
    # and one kept in fp32 reads fp32 there
    dtype = (_operand_dtype(fix.location) if _same_function(fix.location, end) else None) or dtype
    start = _rewrite(fix.location, _float_operands)
    stop = _rewrite(end, lambda node: _cast_result(node, dtype)) if end else None
    if start is None:
        return instruction + "\n"
    lines = [f"# {fix.module}: {fix.op} and what consumes it, up to the softmax, in fp32; edit your source:"]
    changes = [(fix.location, start)] + ([(end, stop)] if end != fix.location or stop is None else [])
    if end == fix.location and stop is not None:  # one statement: both changes at once
        both = _rewrite(end, lambda node: _float_operands(node) and _cast_result(node, dtype))
        changes = [(end, both or start)]
    for where, change in changes:
        if change is not None:
            lines += [f"#   {where}", f"#     was: {change[0]}", f"#     now: {change[1]}"]
        elif where is not None:
            lines.append(f"#   {where}: cast the result back with .to({dtype})")
    return "\n".join(lines) + "\n"


def _operand_dtype(location: str | None) -> str | None:
    """`q.dtype` for a line whose first matrix product's left operand is a name (`q @ k.T`), else None."""
    found = _rewrite(location, lambda tree: True)
    if found is None:
        return None
    for node in ast.walk(ast.parse(found[0])):
        left = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            left = node.left
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in _MATMULS:
            left = node.args[0] if node.args else None
        if left is not None:
            return f"{left.id}.dtype" if isinstance(left, ast.Name) else None
    return None


_MATMULS = ("matmul", "bmm", "mm", "baddbmm")


def _same_function(start: str | None, end: str | None) -> bool:
    """Both lines in one function of one file: a name read on the first is defined on the second."""
    if start is None or end is None:
        return False
    (path, _, a), (other, _, b) = start.rpartition(":"), end.rpartition(":")
    if path != other or not (a.isdigit() and b.isdigit()):
        return False
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return False
    first = function_at(tree, int(a))
    return first is not None and first is function_at(tree, int(b))


def _at(location: str | None) -> str:
    return f" ({location})" if location else ""


def _rewrite(location: str | None, change: Any) -> tuple[str, str] | None:
    """(the statement at `location` as written, as `change` rewrites it), None where it cannot."""
    if location is None:
        return None
    path, _, line_text = location.rpartition(":")
    if not line_text.isdigit():
        return None
    line = int(line_text)
    source = linecache.getline(path, line)
    if not source.strip():
        return None
    text = source.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    changed = change(tree)
    if not changed:
        return None
    return text, ast.unparse(tree)


class _FloatOperands(ast.NodeTransformer):
    def __init__(self) -> None:
        self.changed = False

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.MatMult):
            node.left, node.right = _float(node.left), _float(node.right)
            self.changed = True
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in ("matmul", "bmm", "mm", "einsum", "baddbmm"):
            node.args = [a if isinstance(a, ast.Constant) else _float(a) for a in node.args]
            self.changed = True
        return node


def _float(node: ast.expr) -> ast.expr:
    return ast.Call(func=ast.Attribute(value=node, attr="float", ctx=ast.Load()), args=[], keywords=[])


def _float_operands(tree: ast.AST) -> bool:
    transformer = _FloatOperands()
    transformer.visit(tree)
    return transformer.changed


def _cast_result(tree: ast.AST, dtype: str) -> bool:
    """Wrap the first softmax call in the statement as `(...).to(dtype)`."""
    for node in ast.walk(tree):
        for field, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            for k, item in enumerate(items):
                if isinstance(item, ast.Call) and _is_softmax(item):
                    cast = ast.Call(
                        func=ast.Attribute(value=item, attr="to", ctx=ast.Load()),
                        args=[ast.parse(dtype, mode="eval").body],
                        keywords=[],
                    )
                    if isinstance(value, list):
                        value[k] = cast
                    else:
                        setattr(node, field, cast)
                    return True
    return False


def _is_softmax(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in ("softmax", "log_softmax")
