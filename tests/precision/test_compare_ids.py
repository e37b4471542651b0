"""An output of ids (integers): a decoding loop inside the model's forward that feeds its argmax
back. Their relative error means nothing; compare judges them by the share equal to fp64's beside the
reference model's, names where the rows part, says that no module kept in fp32 gives them back, and
points at the teacher-forced judgement; plan says in one line why it cannot target ids."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class _Decoder(nn.Module):
    """A next-token MLP over the last two tokens, decoding `steps` ids greedily from a prompt."""

    def __init__(self, vocab: int = 512, width: int = 64, steps: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(2 * width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)
        self.steps = steps
        with torch.no_grad():  # a flat distribution, as a trained model's is on open text: near-ties
            self.head.weight.mul_(0.05)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        ids = prompt
        for _ in range(self.steps):
            h = self.emb(ids[:, -2:]).flatten(1)
            nxt = self.head(self.body(h)).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        return ids[:, prompt.shape[1] :]


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Decoder().eval(), torch.randint(0, 512, (32, 4))


def test_ids_a_decoding_loop_returns_are_judged_by_agreement_not_by_their_relative_error() -> None:
    result = fpdoctor.compare(*_model(), candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "decisions-changed", str(result.report)
    decided = result.report.data["decisions"]
    assert decided["kind"] == "ids" and decided["top1"] < 0.97 and decided["floor_top1"] == 1.0, decided
    assert "ids" in first.message and "near-tie" in first.message
    assert first.trial is not None and not first.trial.tried and "teacher-forced" in first.fix
    assert "ids equal to fp64's" in str(result.report)


def test_plan_says_in_one_line_why_it_cannot_target_ids() -> None:
    with pytest.raises(ValueError, match="teacher-forced"):
        fpdoctor.plan(*_model(), candidate="bf16")


class _Sampler(nn.Module):
    """A small transformer LM that samples 12 tokens from its softmax with a fixed generator; its
    blocks called on one line (h = self.blocks(h)), whose ops torch's module runs at that line."""

    def __init__(self, vocab: int = 4000, d: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.head.weight.mul_(3.0)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(7)
        ids = prompt
        for _ in range(12):
            h = self.tok(ids)
            h = self.blocks(h)
            probs = torch.softmax(self.head(h[:, -1]).float() / 0.8, -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
        return ids[:, prompt.shape[1] :]


def test_sampled_ids_are_no_accumulation() -> None:
    """Ids a loop fed back differ from the first flipped draw on: no rounding adds up, so no "made by
    accumulation" finding (which named the line calling the blocks, whose ops chain, as a state)."""
    torch.manual_seed(0)
    result = fpdoctor.compare(_Sampler().eval(), torch.randint(0, 4000, (16, 4)), candidate="bf16")
    assert result.report.data["decisions"]["kind"] == "ids" and result.report.data["decisions"]["top1"] < 1.0
    assert not any(f.evidence.get("kind") == "accumulation" for f in result.report.findings), str(result.report)
