"""What measured optimizer steps mean, decided once for every front end that measures them.

A front end's `UpdateProbe` measures an optimizer step on a sample (`UpdateStats`), or says why
none can be measured; `UpdateJudge.add` turns it into findings, one per cause: TRN010
update-rounded-away, TRN011 accumulation-stalled for a low-precision optimizer state and for
gradients summed over micro-batches in a low-precision `.grad`. It keeps the summary behind the
report's "training updates" line (an OK says what it judged). The fix is tried by the front end's
`what_if` (an `update_whatif.WhatIf`) once, when the rounded-away finding is first made; where no
what-if can run, `untried` says why. The sentinel, `fpdoctor watch` and the callbacks reach it
through the step judge; `trace` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fpdoctor.numerics.updates import findings
from fpdoctor.numerics.updates.causes import Causes
from fpdoctor.numerics.updates.measure import (
    EVERY,
    UpdateStats,
    UpdateSummary,
    rounded_away,
    stalled_grads,
    stalled_states,
)
from fpdoctor.numerics.updates.whatif import WhatIf


class UpdateJudge:
    """The update findings of one run, added to `causes` (the run's findings, one per cause)."""

    def __init__(self, causes: Causes, here: dict[str, Any]) -> None:
        self.causes = causes
        self.here = here  # where every finding of this rank happened (rank, host, device)
        self.summary: UpdateSummary | None = None  # set by the first measured step, or the first why-not
        # the framework that steps the optimizer ("lightning", "transformers"): its own switch for the fix
        self.framework: str | None = None

    def add(
        self,
        stats: UpdateStats,
        optimizer: Any,
        *,
        every: int = EVERY,
        what_if: Callable[[], WhatIf] | None = None,
        untried: str = "what_if_steps=0",
    ) -> None:
        """One measured step (or why none can be: `stats.why_not`); `optimizer` is the user's, for the
        fix's code. `what_if()` runs at most once per run, when the rounded-away finding is first made."""
        if self.summary is None:
            self.summary = UpdateSummary(every=every)
        self.summary.add(stats)
        rank = self.here.get("rank")
        affected = rounded_away(stats)
        if affected:
            key = ("update-rounded-away", affected[0].dtype, rank)
            tried = what_if() if what_if is not None and not self.causes.count(key) else None
            made = findings.rounded_away_finding(
                stats, affected, tried, optimizer, here=self.here, why_untried=untried, framework=self.framework
            )
            self.causes.add(made, key)
        for state in stalled_states(stats):
            made = findings.state_stalled_finding(stats, state, here=self.here)
            self.causes.add(made, ("accumulation-stalled", "state", state.key, rank))
        grads = stalled_grads(stats)
        if grads:
            made = findings.grads_stalled_finding(stats, grads, here=self.here)
            self.causes.add(made, ("accumulation-stalled", "grad", rank))

    def line(self) -> tuple[str, str] | None:
        """The report's summary line; None where no low-precision trainable weight was stepped."""
        return None if self.summary is None else ("training updates", self.summary.text())

    def data(self) -> dict[str, Any] | None:
        if self.summary is None:
            return None
        return {"judged_steps": self.summary.steps, "why_not": self.summary.why_not}
