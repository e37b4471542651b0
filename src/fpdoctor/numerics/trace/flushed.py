"""Squares that flush to zero in a narrow format: a norm or a variance written by hand, sqrt((g *
g).sum()) or x.pow(2).mean(), over fp16/bf16 values small enough that their squares fall below the
format's smallest subnormal (fp16: |x| < 2.4e-4 squares to 0). Nothing overflows and nothing goes
NaN: the sum is simply too small (a gradient norm of 0 for a whole layer), and what divides by it
(a trust ratio, a normalisation) takes steps far too large, or a guard like `+ 1e-9`, itself 0 in
fp16, does not hold.

The tracer hands each square it meets (`x * x` with both operands the same tensor, `x.pow(2)`,
`x.square()`) in fp16/bf16 here. Calls of each source line and shape (a line that squares each
gradient in turn has one series per parameter) spread over the run (1st, 2nd, 4th, ...) are
measured: the sum of the squares as the format made them against the same sum of the values
squared in fp32. A line whose latest RECENT checks of one series each lost LOST of the sum or
more is a finding, its fix measured on the values of its latest check: the squares in fp32.

Cost: a dictionary lookup and a frame walk per square, and on the checked calls (the powers of
two) one fp32 copy of its input and a host read.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.report.model import Finding, Severity, Trial
from fpdoctor.userframes import user_location

SQUARES = frozenset({"mul", "pow", "square"})
LOST = 0.25  # of the squares' sum: a norm off by 13% or more
SEVERE = 0.5  # half of it: a norm off by 30%, the steps that divide by it 1.4x too large at least
RECENT = 2
_NARROW = (torch.float16, torch.bfloat16)


@dataclass
class _Line:
    calls: int = 0
    checks: list[tuple[int, float, float, float]] = field(default_factory=list)  # (call, lost, as made, fp32)
    dtype: str = ""


class FlushedSquares:
    """The squares of each source line, checked on calls spread over the run (see the docstring)."""

    def __init__(self) -> None:
        # by line and shape: one line squares each parameter's gradient in turn, each its own series
        self.lines: dict[tuple[str, int, tuple[int, ...]], _Line] = {}

    def seen(self, name: str, args: Any, out: Any) -> None:
        """A square (`name` in SQUARES) and its result; cheap unless this call is checked."""
        if type(out) is not torch.Tensor or out.dtype not in _NARROW or not args:
            return
        x = args[0]
        if name == "mul" and (len(args) < 2 or args[1] is not x):
            return
        if name == "pow" and (len(args) < 2 or args[1] != 2):
            return
        if not isinstance(x, torch.Tensor) or x.shape != out.shape or not out.numel():
            return
        user = user_location(sys._getframe())
        if user is None:
            return
        key = (user[0], user[1], tuple(out.shape))
        line = self.lines.setdefault(key, _Line(dtype=str(out.dtype).removeprefix("torch.")))
        line.calls += 1
        if line.calls & (line.calls - 1):
            return
        wide = x.detach().float()
        made, exact = torch.stack([out.detach().float().sum(), wide.mul(wide).sum()]).tolist()
        if math.isfinite(made) and math.isfinite(exact) and exact > 0:
            line.checks = [*line.checks[-(RECENT - 1) :], (line.calls, 1.0 - made / exact, made, exact)]

    def findings(self) -> list[Finding]:
        found = []
        named: set[tuple[str, int]] = set()
        worst = sorted(self.lines.items(), key=lambda item: -min((c[1] for c in item[1].checks), default=0.0))
        for (file, number, shape), line in worst:
            if (file, number) in named or len(line.checks) < RECENT or any(c[1] < LOST for c in line.checks):
                continue
            named.add((file, number))  # a line once, for its worst series
            call, lost, made, exact = line.checks[-1]
            dtype = line.dtype
            message = (
                f"The squares at {file}:{number} flush to zero in {dtype}: the values squared are so small that "
                f"their squares fall below {dtype}'s smallest subnormal, and the sum of the squares keeps "
                f"{1 - lost:.0%} of what it is in fp32 ({made:.4g} against {exact:.4g}, at the line's {call}th call; "
                f"{lost:.0%} lost on each of its latest {RECENT} checks). A norm or a variance made from it is too "
                "small (0 for a whole tensor, in the end), and what divides by it takes steps too large; nothing "
                "goes NaN. A small constant added as a guard (1e-9) is itself 0 in fp16."
            )
            fix = (
                f"Compute line {number} of {file} in fp32: square x.float() (torch.linalg.vector_norm(x.float()) for "
                f"a norm), and cast what it makes back where it is used; checked: the sum of the squares there "
                f"{made:.4g} -> {exact:.4g}"
            )
            found.append(
                catalog.make(
                    "underflow-risk",
                    title=f"Squares flush to zero in {dtype}: the sum of squares (a norm by hand) is too small",
                    message=message,
                    fix=fix,
                    severity=Severity.ERROR if lost >= SEVERE else None,
                    where={"module": None, "op": "square", "phase": "forward"},
                    evidence={
                        "kind": "flushed-squares",
                        "location": f"{file}:{number}",
                        "dtype": dtype,
                        "shape": list(shape),
                        "lost_share": lost,
                        "sum_as_made": made,
                        "sum_fp32": exact,
                        "call": call,
                        "calls": line.calls,
                    },
                    trial=Trial.checked(
                        f"the squares at line {number} computed in fp32",
                        metric="the sum of the squares",
                        before=f"{made:.4g}",
                        after=f"{exact:.4g}",
                        on=f"the values the line squared at its {call}th call",
                    ),
                )
            )
        return found
