"""An adaptive optimizer's eps far above its gradients' size: the step becomes lr * m / eps.

Adam divides each update by sqrt(v) + eps, v the running mean of the squared gradients. eps is there
to keep the division finite (1e-8 by default); typed 1.0 or 1e-1 for 1e-8 it dominates the
denominator wherever the gradients are smaller than it, and every update shrinks by sqrt(v) / eps:
nothing is NaN, the loss falls slowly, and a reference step with the same optimizer agrees.

Read once, at the report, from the optimizer's own state: per parameter, the root of its bias-corrected
second moment, the median over the parameters that have one."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

# the update shrunk to SHRINK of Adam's or less by an eps of at least EPS_LARGE: a typo, not a choice
# (1e-8 by default, 1e-6 to 1e-5 in large-model recipes)
SHRINK = 0.1
EPS_LARGE = 1e-4


@dataclass(frozen=True)
class LargeEps:
    optimizer: str
    eps: float
    root_v: float  # the median over parameters of sqrt(v / (1 - beta2 ** step))
    shrink: float  # root_v / (root_v + eps): the share of Adam's step that is taken

    @property
    def times(self) -> float:
        return self.eps / self.root_v


def read(optimizer: Any) -> LargeEps | None:
    """The group 0 eps against the median root second moment, where it shrinks every update; None
    otherwise (no second moment in the state, an eps in the usual range). Never raises."""
    try:
        return _read(optimizer)
    except Exception:
        return None


def _read(optimizer: Any) -> LargeEps | None:
    group = optimizer.param_groups[0]
    eps, betas = group.get("eps"), group.get("betas")
    if not isinstance(eps, (int, float)) or eps < EPS_LARGE or not betas:
        return None
    roots = []
    for p in group["params"]:
        state = optimizer.state.get(p, {})
        v, step = state.get("exp_avg_sq"), state.get("step")
        if v is None or step is None or v.numel() == 0:
            continue
        done = float(step)
        if done < 1:
            continue
        corrected = float(v.float().mean()) / (1 - float(betas[1]) ** done)
        roots.append(math.sqrt(max(corrected, 0.0)))
    if not roots:
        return None
    root_v = statistics.median(roots)
    shrink = root_v / (root_v + eps)
    if shrink > SHRINK:
        return None
    return LargeEps(type(optimizer).__name__, float(eps), root_v, shrink)
