"""A plan that keeps a module whose weight is tied to one left in the candidate's dtype (the output
layer of a language model, tied to its embedding): the printed code and `apply_plan` run what the
plan checked, an fp32 copy of the kept module beside an embedding left in bf16, and neither crashes
(`.float()` on the kept module used to turn the embedding fp32 as well, and its bf16 LayerNorm then
refused the fp32 input)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fpdoctor.precision.plan.codegen import plan_code
from fpdoctor.precision.plan.plan import Plan, _candidate_with, apply_plan


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 500, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 20 * torch.tanh(self.head(self.body(self.embed(ids))) / 20)


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM().eval()


def test_the_printed_code_and_apply_plan_run_the_checked_model_when_the_kept_weight_is_tied() -> None:
    ids = torch.randint(0, 500, (4, 16))
    with torch.no_grad():
        checked = _candidate_with(_model(), "bf16", ["head"], {"head"})(ids)
        printed = _model()
        exec(plan_code("bf16", ["head"], ["head"]), {"model": printed})
        assert printed.embed.weight.dtype == torch.bfloat16 and printed.head.weight.dtype == torch.float32
        plan = Plan(
            candidate="bf16", keep_fp32=["head"], fp32_outputs=["head"], verified=True,
            final_error=0.0, tolerance=1.0, baseline_error=1.0,
        )  # fmt: skip
        applied = apply_plan(_model(), plan)
        assert torch.equal(printed(ids), checked) and torch.equal(applied(ids), checked)
        plain = copy.deepcopy(_model()).to(torch.bfloat16)(ids)
        assert not torch.equal(plain, checked)  # the kept head is what differs
