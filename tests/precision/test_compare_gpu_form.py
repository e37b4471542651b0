"""compare's figures in the form a GPU runs them (metrics.launched: figures queued as device values,
norms and dot products joined at the pass's end, finiteness from one inf-norm), run on the CPU: the
same verdicts and figures as the CPU's own form (aminmax, one figure at a time), so the GPU's path
is tested where CI runs."""

from __future__ import annotations

import math

import pytest

import fpdoctor
from fpdoctor.precision import metrics
from fpdoctor.precision.profile import CompareResult
from tests.precision import factories

MODELS = ["overflow_attention", "ill_conditioned", "ill_conditioned_root", "quiet_divergence", "huge_inputs",
          "tempered_attention", "mixed_params"]  # fmt: skip


def _summary(result: CompareResult) -> tuple[list[str], list[tuple[str, float, float]]]:
    rows = [(r.module, r.propagated, r.floor) for r in result.rows]
    return [f.name for f in result.report.findings], rows


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("candidate", ["fp16", "bf16"])
def test_the_gpu_form_of_the_figures_gives_the_cpus_verdicts(name: str, candidate: str, monkeypatch) -> None:
    model, x = getattr(factories, name)()
    cpu = _summary(fpdoctor.compare(model, x, candidate=candidate))
    monkeypatch.setattr(metrics, "launched", lambda device: True)
    model, x = getattr(factories, name)()
    gpu = _summary(fpdoctor.compare(model, x, candidate=candidate))
    assert gpu[0] == cpu[0]
    assert len(gpu[1]) == len(cpu[1])
    for (module, propagated, floor), (module_, propagated_, floor_) in zip(cpu[1], gpu[1], strict=True):
        assert module == module_
        for a, b in ((propagated, propagated_), (floor, floor_)):
            assert (math.isinf(a) and math.isinf(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), (module, a, b)
