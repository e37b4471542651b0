"""Ops whose algorithm, not their format, loses the precision, and the stable form torch offers.

`torch.cdist` computes Euclidean distances as ||x||^2 + ||y||^2 - 2 x.y (a matrix product) once
either side has more than 25 rows: where the points sit far from the origin (raw sensor readings
near 1000, coordinates) the three terms are large and nearly cancel, so fp32 keeps a few digits of
a distance of a few units, and fp16 overflows the squared norms. The direct form (differences
first) has neither problem, and torch offers it by an argument. Each entry names the aten op the
own-op check reports, the Python function the user called, and the argument that selects the
stable form; compare re-runs the candidate with it (under a TorchFunctionMode that adds the
argument to every such call, for that forward only) and prints the edit where that run is checked
to take the error down.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fpdoctor.userframes import frame_location, user_frame


@dataclass(frozen=True)
class StableForm:
    op: str  # the aten overload the own-op check names
    function: Callable[..., Any]  # what the user's code calls
    call: str  # its name in the user's code
    # what selects the stable form (torch.cdist hands its arguments to the mode as keywords, positional or not)
    kwargs: dict[str, Any] = field(default_factory=dict)
    why: str = ""


FORMS = (
    StableForm(
        op="aten._euclidean_dist.default",
        function=torch.cdist,
        call="torch.cdist",
        kwargs={"compute_mode": "donot_use_mm_for_euclid_dist"},
        why=(
            "computes distances as ||x||^2 + ||y||^2 - 2 x.y (a matrix product) for more than 25 rows, which cancels "
            "where the points sit far from the origin"
        ),
    ),
)


def form_for(op: str | None) -> StableForm | None:
    return next((f for f in FORMS if f.op == op), None)


class Rewritten(TorchFunctionMode):
    """The calls of `form.function` made from `location` ("file:line", the line the fix names; every
    call where None) made with the stable form's arguments, while the mode is active."""

    def __init__(self, form: StableForm, location: str | None = None) -> None:
        super().__init__()
        self.form, self.location = form, location
        self.lines: list[str] = []  # the user's lines whose calls it rewrote, in the order first rewritten

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is self.form.function:
            found = frame_location(user_frame(sys._getframe(1)))
            line = f"{found[0]}:{found[1]}" if found is not None else "?"
            if self.location is None or line == self.location:
                kwargs = {**kwargs, **self.form.kwargs}
                if line not in self.lines:
                    self.lines.append(line)
        return func(*args, **kwargs)


def fix_text(form: StableForm, locations: list[str]) -> str:
    at = f" at {' and '.join(locations)}" if locations else ""
    args = ", ".join(f"{k}={v!r}" for k, v in form.kwargs.items())
    return (
        f"Pass {args} to {form.call}{at}: it {form.why}; the stable form computes the differences first (or subtract "
        "a common centre, such as the mean of the points, from both sides first: distances do not change)"
    )
