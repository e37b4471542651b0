"""The input floor (the reference fed the inputs rounded to the candidate's dtype) where rounding the
inputs changes nothing: token ids, or float inputs whose values the candidate's dtype already holds.
It is 0 by definition there, no forward measures it, and the report says why; inputs that rounding
does change still get their forward, and the same figures as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import compare as steps
from tests.precision.factories import RunningSum


class TokenSum(nn.Module):
    """Token ids in, a running sum of their embeddings over the sequence: bf16 loses it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.sum = nn.Embedding(64, 16), RunningSum()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.sum(self.embed(tokens) + 0.5)


@pytest.fixture
def floor_runs(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The figures of the input floor's forwards, one per forward run."""
    runs: list[float | None] = []
    measured = steps.input_rounding_error

    def counted(*args, **kwargs):
        runs.append(measured(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(steps, "input_rounding_error", counted)
    return runs


def _accumulation(result: fpdoctor.CompareResult) -> fpdoctor.Finding:
    (finding,) = [f for f in result.report.findings if f.evidence.get("kind") == "accumulation"]
    return finding


def test_token_ids_cost_nothing_to_round_and_no_forward_measures_it(floor_runs):
    torch.manual_seed(0)
    model = TokenSum().eval()
    tokens = torch.randint(0, 64, (2, 3000), generator=torch.Generator().manual_seed(0))
    result = fpdoctor.compare(model, tokens, candidate="bf16")
    finding = _accumulation(result)
    assert floor_runs == []
    assert result.input_floor == 0.0 and finding.evidence["input_floor_rel"] == 0.0
    note = result.report.data["input_floor_note"]
    assert note.startswith("0: no floating-point tensor among the inputs") and "no forward" in note
    assert finding.evidence["input_floor_note"] == note
    assert finding.trial is not None and finding.trial.tried  # the running state is still found and checked


def test_float_inputs_bf16_holds_are_not_rounded_either(floor_runs):
    torch.manual_seed(0)
    x = (torch.randn(2, 3000, 16) + 0.5).bfloat16().float()  # float32 tensors of bf16 values
    result = fpdoctor.compare(RunningSum().eval(), x, candidate="bf16")
    assert floor_runs == [] and result.input_floor == 0.0
    note = result.report.data["input_floor_note"]
    assert "every floating-point value among the inputs is already a bfloat16 value" in note
    _accumulation(result)


def test_float_inputs_that_rounding_changes_keep_their_forward(floor_runs):
    torch.manual_seed(0)
    x = torch.randn(2, 3000, 16) + 0.5
    result = fpdoctor.compare(RunningSum().eval(), x, candidate="bf16")
    finding = _accumulation(result)
    assert len(floor_runs) == 1 and floor_runs[0] is not None and floor_runs[0] > 0
    assert result.input_floor == floor_runs[0] == finding.evidence["input_floor_rel"]
    assert "input_floor_note" not in result.report.data and "input_floor_note" not in finding.evidence


def test_a_candidate_as_fine_as_the_reference_keeps_the_forward():
    # fp32 against fp32: the forward on unchanged inputs measures the reference's own end-to-end error,
    # which is what explains the candidate's there; it is not taken for 0
    assert steps._inputs_kept(torch.ones(3), torch.float32, torch.float32) is None
    assert steps._inputs_kept(torch.ones(3, dtype=torch.long), torch.float32, torch.float32) is None
    assert steps._inputs_kept(torch.ones(3, dtype=torch.long), torch.bfloat16, torch.float32) is not None
    assert steps._inputs_kept(torch.tensor([1.0, float("nan")]), torch.bfloat16, torch.float32) is None
    assert steps._inputs_kept(torch.tensor([1.0, 1.0 + 2**-12]), torch.bfloat16, torch.float32) is None
