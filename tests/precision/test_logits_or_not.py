"""What `compare` judges by its decisions: logits are what the last Linear made, returned as they are
(a cast at most); an embedding normalised after its projection decides no class and is judged in
its own units instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Head(nn.Module):
    def __init__(self, normalised: bool) -> None:
        super().__init__()
        self.normalised = normalised
        self.mlp, self.proj = nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(self.mlp(x))
        return F.normalize(z, dim=-1) if self.normalised else z.float()


def test_an_embedding_normalised_after_its_projection_is_not_judged_as_logits():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    embedding = fpdoctor.compare(Head(normalised=True).eval(), x, candidate="bf16").report.data
    assert "decisions" not in embedding and "output_error" in embedding
    classifier = fpdoctor.compare(Head(normalised=False).eval(), x, candidate="bf16").report.data
    assert "decisions" in classifier and "logits of `proj`" in classifier["decisions"]["source"]


class Denoiser(nn.Module):
    """Predicts the noise in its input x (same shape), from x and a timestep embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.out = nn.Sequential(nn.Linear(32, 128), nn.SiLU()), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def test_an_output_of_its_inputs_shape_is_not_judged_as_logits():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    report = fpdoctor.compare(Denoiser().eval(), x, candidate="bf16").report.data
    assert "decisions" not in report and "output_error" in report


class ByteLM(nn.Module):
    """A byte-level language model whose width is its vocabulary (256): its head is a square Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.mix(self.embed(ids))))


def test_a_square_head_over_token_ids_is_judged_as_logits_and_a_square_projection_of_floats_is_not():
    torch.manual_seed(0)
    lm = fpdoctor.compare(ByteLM().eval(), torch.randint(0, 256, (4, 32)), candidate="bf16").report.data
    assert "decisions" in lm, dict(lm["summary"])  # before: a square head was never logits
    projection = nn.Sequential(nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 32)).eval()
    fed_floats = fpdoctor.compare(projection, torch.randn(16, 48), candidate="bf16").report.data
    assert "decisions" not in fed_floats
