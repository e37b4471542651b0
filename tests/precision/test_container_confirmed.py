"""A container's own op judged alone in the candidate's dtype is a divergence only where the
candidate's run of the container, as its code is written, shows it: code that upcasts its scores
in fp16 is not asked to keep them in fp32."""

from __future__ import annotations

import fpdoctor
from tests.fixtures.record import machines


def test_an_own_op_the_code_upcasts_is_not_a_divergence():
    model, x = machines.machine_a()  # q·kᵀ about 1e5: overflows fp16 alone; the code computes it in fp32
    result = fpdoctor.compare(model, x, candidate="fp16")
    assert result.report.by_name("precision-divergence") == [] and result.first_divergent is None
    (attn,) = [r for r in result.rows if r.module == "attn"]
    assert attn.exceeds and not attn.diverged  # its own op alone does overflow
    assert attn.unconfirmed is not None and "does not reach the module's output" in attn.unconfirmed
    assert any(label == "not in its run" for label, _ in attn.notes)


def test_the_same_op_computed_in_fp16_by_the_code_diverges():
    model, x = machines.fp16_accumulate()  # the same scores, accumulated in fp16: they overflow
    result = fpdoctor.compare(model, x, candidate="fp16")
    (attn,) = [r for r in result.rows if r.module == "attn"]
    assert attn.diverged and attn.unconfirmed is None
    assert [f.where["module"] for f in result.report.by_name("precision-divergence")] == ["attn"]
