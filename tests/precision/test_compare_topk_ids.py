"""A retrieval model that returns its top-k (scores, document ids), served in fp16: the ids are the
decision, judged by their agreement with fp64's, never the scores' small relative error alone. The
scores against its index buffer, which the model's cast rounds, and the pick are the model's own code:
computed in fp32 with the index kept in fp32 and only the encoder in fp16 they give most of the picks
back, checked, and applied as printed the same figure comes out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor
from fpdoctor.precision.decide import ids_agree


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp(x), dim=-1)


class TopK(nn.Module):
    def __init__(self, docs: torch.Tensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        with torch.no_grad():
            self.register_buffer("index", self.encoder(docs))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.topk(self.encoder(q) @ self.index.T, 5, dim=-1)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    common = torch.randn(32, generator=g)  # every text shares most of its direction: close scores at the top
    docs = 3 * common + torch.randn(8000, 32, generator=g)
    return docs, 3 * common + torch.randn(256, 32, generator=g)


def test_a_top_k_returned_with_its_ids_is_judged_by_the_ids_and_its_own_code_in_fp32_works_as_printed() -> None:
    docs, q = _data()
    result = fpdoctor.compare(TopK(docs).eval(), q, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "decisions-changed" and first.evidence["decisions"]["kind"] == "ids", str(result.report)
    assert first.trial is not None and first.trial.tried, first.trial
    assert first.fix.startswith("Compute the scores, and any pick from them, in fp32"), first.fix
    assert "`self.index = value.float()`" in first.fix and "only `encoder` in fp16" in first.fix, first.fix
    # as printed: the index held in fp32, the scores and the pick in fp32, the encoder in fp16
    model = TopK(docs).eval()
    with torch.no_grad():
        exact = model.double()(q.double()).indices
        model.float()
        encoder = model.encoder.half()
        got = torch.topk(encoder(q.half()).float() @ model.index.T, 5, dim=-1).indices
    after = ids_agree(exact, got)
    assert after is not None and f"{100 * after:.1f}%" == first.trial.after, (after, first.trial)
    assert float(first.trial.before.rstrip("%")) < float(first.trial.after.rstrip("%"))


class Scores(TopK):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.encoder(q) @ self.index.T


def test_scores_the_models_own_code_makes_past_the_formats_spacing_get_their_own_code_in_fp32_checked() -> None:
    """The scores returned whole: fp16 alone rounds their top-1 away (output-too-coarse); no layer makes them,
    so the check is the model's own ops in fp32 around its fp16 encoder, the index kept in fp32."""
    docs, q = _data()
    first = fpdoctor.compare(Scores(docs).eval(), q, candidate="fp16").report.findings[0]
    assert first.name == "output-too-coarse" and first.trial is not None and first.trial.tried, first
    assert "`self.index = value.float()`" in first.fix and "only `encoder` in fp16" in first.fix, first.fix
    assert float(first.trial.after.rstrip("%")) > float(first.trial.before.rstrip("%")), first.trial
