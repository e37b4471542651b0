"""An autocast region left open across optimizer steps: every forward runs stale weights.

Autocast casts each fp32 leaf parameter to the low-precision dtype once and reuses that copy (its cast
cache) until the outermost `torch.autocast` block exits. A block that holds the optimizer's step and the
next forward (one `with` around the epoch, the loop or the whole training function; an
`@torch.autocast` decorator on it; autocast entered once on an ExitStack; a per-forward block nested in
an outer `autocast(enabled=False)` that spans the loop) runs every forward after its first on the
weights as they were cast then: the fp32 weights move, the forward never sees them, and the loss stays
where it was while nothing is NaN.

Read by a probe of the cache itself, at the training forwards of a few steps (`PROBED`, in pairs a step
apart): a 1x1 fp32 leaf of fpdoctor's own that requires grad is given a new value and multiplied under
the forward's autocast, which casts it through the cache. A cast that returns a value it held at an
earlier step is a cache that outlived that step. Nothing of the user's is read or written (one cache
entry of fpdoctor's own, freed with the block); the weights, the RNG and the outputs play no part, so a
run whose first steps move no weight (skipped by a GradScaler, a warm-up from lr 0) is read as any other.
Where it is found, the step's forward is run once more with the weights cast afresh (`measure`) for the
size of what it costs: the outputs' relative distance from the weights as they are."""

from __future__ import annotations

import ast
import linecache
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.userframes import function_at

PROBED = frozenset((1, 2, 3, 10, 11, 100, 101, 1000, 1001))  # the optimizer steps whose forwards probe the cache
MOVED = 1e-6  # a relative difference at or below this: no weight had moved since the cast (a skipped step)
_AUTOCAST = ("autocast",)  # torch.autocast, torch.amp.autocast, torch.cuda.amp.autocast, `from ... import autocast`


@dataclass
class Stale:
    """A cache found across steps: the probe cast at step `since` came back at step `step`."""

    step: int
    since: int
    device_type: str
    dtype: str
    block: tuple[str, int, str, str] | None  # what opened the block: (file, line, its text, how: block_of)
    difference: float | None = None  # the step's outputs against the same forward with the weights cast afresh
    measured_at: int | None = None  # the step whose forward `difference` is of


@dataclass
class StaleCasts:
    """The probe of autocast's cast cache across optimizer steps (see the module's text)."""

    found: Stale | None = None
    done: bool = False
    _probes: dict[str, torch.Tensor] = field(default_factory=dict)  # per device type
    _values: dict[float, int] = field(default_factory=dict)  # a value the probe held -> the step it was cast at
    _next: float = 1.0

    def at_forward(self, step: int, autocast: list[tuple[str, torch.dtype]], frames: Any) -> None:
        """A training forward is about to run under `autocast` (device type, dtype); `step` optimizer steps
        were taken before it; `frames()`: the user's frames, for the line that opened the block."""
        if self.done or step + 1 not in PROBED or not torch.is_autocast_cache_enabled():
            return
        for device_type, dtype in autocast:
            got = self._cast(device_type, step)
            if got is None:
                continue
            since = self._values.get(got)
            if since is not None and since < step:
                name = str(dtype).removeprefix("torch.")
                self.found = Stale(step + 1, since + 1, device_type, name, block_of(frames()))
                self.done = True
                return
        if step + 1 >= max(PROBED):
            self.done = True

    def _cast(self, device_type: str, step: int) -> float | None:
        """The probe given a new value and cast under the current autocast at `step`; the value the cast
        returned (the square of the value it was cast from)."""
        probe = self._probes.get(device_type)
        if probe is None:
            if device_type == "cuda" and not torch.cuda.is_initialized():
                return None
            device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
            probe = self._probes[device_type] = torch.ones(1, 1, device=device, requires_grad=True)
        value, self._next = self._next, self._next + 1.0  # small integers: exact in fp16 and bf16, squared too
        with torch.no_grad():
            probe.fill_(value)
            cast = torch.mm(probe, probe)  # autocast casts a leaf that requires grad through its cache
        if cast.dtype == probe.dtype:
            return None  # autocast does not cast here (off for this device type, or another op list)
        self._values[value * value] = step
        return float(cast.float().item())


def difference(got: list[torch.Tensor], fresh: list[torch.Tensor]) -> float | None:
    """|got - fresh| / |fresh| over the floating outputs, in fp64; None where they cannot be paired."""
    pairs = [(a, b) for a, b in zip(got, fresh, strict=False) if a.shape == b.shape and a.is_floating_point()]
    if not pairs or len(got) != len(fresh):
        return None
    with torch.no_grad():
        diff = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in pairs))
        norm = math.sqrt(sum(float(b.double().square().sum()) for _, b in pairs))
    if not (math.isfinite(diff) and math.isfinite(norm)) or norm == 0:
        return None
    return diff / norm


def block_of(frames: list[tuple[str, int, str]]) -> tuple[str, int, str, str] | None:
    """What opened the autocast that holds the step, in the innermost of the user's frames (the step's call,
    then the calls that led to it) that shows one: (file, line, its text, how) where `how` is "with" (the
    innermost `with ...autocast(...)` around the line), "decorator" (`@torch.autocast(...)` on the function
    that runs the line) or "enter_context" (`stack.enter_context(torch.autocast(...))` before the line in it)."""
    for path, line, _ in frames:
        try:
            tree = ast.parse("".join(linecache.getlines(path)))
        except (SyntaxError, ValueError):
            continue
        holding = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.With)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and any(_is_autocast(item.context_expr) for item in node.items)
        ]
        if holding:
            return _at(path, max(holding, key=lambda n: n.lineno).lineno, "with")
        function = function_at(tree, line)
        decorator = next((d for d in function.decorator_list if _is_autocast(d)), None) if function else None
        if decorator is not None:
            return _at(path, decorator.lineno, "decorator")
        entered = [
            node
            for node in ast.walk(function or tree)  # at module level: the script's own lines before it
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "enter_context" and node.args and _is_autocast(node.args[0]) and node.lineno < line
        ]  # fmt: skip
        if entered:
            return _at(path, max(entered, key=lambda n: n.lineno).lineno, "enter_context")
    return None


def _at(path: str, line: int, how: str) -> tuple[str, int, str, str]:
    return path, line, linecache.getline(path, line).split("#")[0].strip(), how


def _is_autocast(expr: ast.expr) -> bool:
    func = expr.func if isinstance(expr, ast.Call) else expr
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in _AUTOCAST


def floats(outputs: list[Any]) -> list[torch.Tensor]:
    return [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
