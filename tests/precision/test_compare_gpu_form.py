"""compare's figures in the form a GPU runs them (metrics.launched: figures queued as device values,
norms and dot products joined at the pass's end, finiteness from one inf-norm), run on the CPU: the
same verdicts and figures as the CPU's own form (aminmax, one figure at a time), so the GPU's path
is tested where CI runs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import fpdoctor
from fpdoctor.precision import metrics
from fpdoctor.precision.compare import container_ops
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


@pytest.mark.parametrize("joined", [False, True], ids=["cpu-form", "gpu-form"])
def test_figures_are_computed_before_the_read_once_their_samples_pass_the_bound(joined: bool, monkeypatch) -> None:
    """A pass's norms and dot products wait for its read in one batch per device, but their samples
    are let go once they hold Reads.HELD bytes: a pass's memory does not grow with the model's depth."""
    monkeypatch.setattr(metrics, "launched", lambda device: joined)
    monkeypatch.setattr(metrics.Reads, "HELD", 3 * 8192 * 8)
    torch.manual_seed(0)
    samples = [torch.randn(8192, dtype=torch.float64) * (i + 1) for i in range(12)]
    reads, got = metrics.Reads(), []
    asked: list[metrics.Later] = []
    for a, b in itertools.pairwise(samples):
        figures = [metrics.norm_later(a), metrics.diff_later(a, b), metrics.dot_later(a, b)]
        asked += figures
        reads.later(figures, lambda *v: got.append(v))
        held = sum(later.nbytes for later in asked if later.x is not None)
        assert held <= metrics.Reads.HELD + 2 * 8192 * 8, held
    shared = asked[0]
    reads.later([shared], lambda v: got.append((v,)))  # a figure asked twice
    reads.read()
    again = metrics.Reads()  # computed by the first, read by a second
    again.later([shared, torch.tensor(2.5)], lambda *v: got.append(v))
    again.read()
    for (norm, diff, dot), (a, b) in zip(got, itertools.pairwise(samples), strict=False):
        assert math.isclose(norm, float(a.norm()), rel_tol=1e-12)
        assert math.isclose(diff, float((a - b).norm()), rel_tol=1e-12)
        assert math.isclose(dot, float(a @ b), rel_tol=1e-12)
    assert got[-2] == (got[0][0],) and got[-1] == (got[0][0], 2.5)


@pytest.mark.parametrize("name", ["overflow_attention", "quiet_divergence", "tempered_attention"])
def test_a_pass_that_reads_and_settles_its_own_ops_mid_way_gives_the_same_verdicts(name: str, monkeypatch) -> None:
    model, x = getattr(factories, name)()
    whole = _summary(fpdoctor.compare(model, x, candidate="fp16"))
    monkeypatch.setattr(metrics.Reads, "HELD", 1)
    monkeypatch.setattr(container_ops, "HELD_BYTES", 1)
    model, x = getattr(factories, name)()
    bounded = _summary(fpdoctor.compare(model, x, candidate="fp16"))
    assert bounded[0] == whole[0]
    assert [(m, round(p, 9), round(f, 9)) for m, p, f in bounded[1]] == [
        (m, round(p, 9), round(f, 9)) for m, p, f in whole[1]
    ]
