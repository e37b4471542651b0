"""A GradScaler made anew for every step: its scale never calibrates.

`scaler = torch.amp.GradScaler()` inside the step (or the epoch) function starts each step at its
init scale (65536): a step whose gradients overflow there is skipped, and the scaler that would have
halved its scale for the next one is thrown away. Most steps are skipped, the scale reads 65536 at
every step, and the run looks like an fp16 overflow that no scale cures.

Read at each GradScaler.step: which scaler stepped the optimizer (one comparison; the last one held)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# a new scaler on this share of the optimizer's scaled steps, and at least REBUILT_MIN of them
REBUILT_SHARE = 0.5
REBUILT_MIN = 3


@dataclass
class Scalers:
    """The scalers one optimizer was stepped by."""

    last: Any = None  # the scaler of the last step (held: a scaler of the user's class may refuse a weak reference)
    steps: int = 0  # its steps through a GradScaler
    new: int = 0  # steps whose scaler was not the one before
    init_scale: float | None = None

    def stepped(self, scaler: Any) -> None:
        if self.last is not scaler:
            self.new += 1
            self.last = scaler
            scale = getattr(scaler, "_init_scale", None)
            self.init_scale = float(scale) if isinstance(scale, (int, float)) else None
        self.steps += 1

    @property
    def rebuilt(self) -> bool:
        """A new scaler on most steps (the first one counted: one scaler for the run is one `new`)."""
        return self.new - 1 >= REBUILT_MIN and self.new >= REBUILT_SHARE * self.steps
