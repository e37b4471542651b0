"""Values the forward makes in the model's dtype that the candidate's format rounds: whole numbers
past what it holds exactly (positions from an arange in an ALiBi attention, bf16: every second
whole number past 256; event times cast from integer seconds whose gaps a model reads, fp16: past
2048), and a random draw (a Gumbel-softmax router's uniform draw in bf16 or fp16). No module or op
stands out (each op's floor is as wrong); compare names the line, checks it and the lines that
read it in fp32, and the fix as printed cures. Whole numbers the format holds exactly cost nothing
and are not named."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import fpdoctor


def _line(fn: object, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


class ALiBi(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, fp32_positions: bool = False) -> None:
        super().__init__()
        self.heads, self.fp32_positions = heads, fp32_positions
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        dtype = torch.float32 if self.fp32_positions else x.dtype
        pos = torch.arange(n, dtype=dtype)
        dist = (pos[None, :] - pos[:, None]).abs().to(x.dtype)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) - self.slopes[:, None, None] * dist
        attn = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class Events(nn.Module):
    """Reads the gaps between events from their integer timestamps (seconds), cast in its forward."""

    def __init__(self, fp32_times: bool = False) -> None:
        super().__init__()
        self.fp32_times = fp32_times
        self.mix = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, seconds: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        t = seconds.float() if self.fp32_times else seconds.to(like.dtype)
        gaps = torch.log1p(t[:, 1:] - t[:, :-1]).to(like.dtype)
        return self.mix(gaps[..., None]).squeeze(-1)


def _alibi(fp32_positions: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ALiBi(fp32_positions=fp32_positions).eval(), torch.randn(1, 1024, 32)


def _events(fp32_times: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    seconds = 3000 + torch.randint(1, 20, (64, 48)).cumsum(-1)
    return Events(fp32_times).eval(), (seconds, torch.zeros(()))


def test_positions_from_an_arange_in_bf16_are_named_with_their_lines_checked_and_the_fix_as_printed_cures():
    model, x = _alibi()
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "whole-numbers-rounded", str(result.report)
    assert first.evidence["location"].endswith(f":{_line(ALiBi.forward, 'torch.arange')}")
    assert first.evidence["largest"] == 1023 and first.evidence["exact_up_to"] == 256
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before
    # as printed: the positions made in fp32, the distances computed from them, cast to the model's dtype
    fixed, x = _alibi(fp32_positions=True)
    after = fpdoctor.compare(fixed, x, candidate="bf16")
    assert not after.report.by_name("whole-numbers-rounded"), str(after.report)
    assert after.rows[-1].propagated * 4 <= result.rows[-1].propagated


def test_integer_timestamps_cast_to_fp16_in_the_forward_are_named_and_fixed_as_printed():
    model, inputs = _events()
    result = fpdoctor.compare(model, inputs, candidate="fp16")
    first = result.report.findings[0]
    # the subtraction reading them is as wrong run exactly (a forced op): its divergence finding's check
    # raises the cast's line, and says what that line makes
    assert first.name == "precision-divergence", str(result.report)
    cast = f":{_line(Events.forward, 'seconds.to(like.dtype)')}"
    assert any(at.endswith(cast) for at in first.evidence["feeding_lines"])
    whole = first.evidence["whole_numbers"]
    assert whole["location"].endswith(cast) and whole["exact_up_to"] == 2048 and whole["largest"] > 3000
    assert "whole numbers exactly only up to 2048" in first.message
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before
    fixed, inputs = _events(fp32_times=True)
    after = fpdoctor.compare(fixed, inputs, candidate="fp16")
    assert not after.report.by_name("whole-numbers-rounded") and not after.report.by_name("precision-divergence")


def test_whole_numbers_the_format_holds_exactly_are_not_named():
    torch.manual_seed(0)
    model, x = ALiBi().eval(), torch.randn(2, 128, 32)  # positions up to 127: exact in bf16
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert not result.report.by_name("whole-numbers-rounded"), str(result.report)


class NoisyRouter(nn.Module):
    """A mixture of experts routed by a Gumbel-softmax over the router's scores."""

    def __init__(self, fp32_draw: bool = False, experts: int = 64) -> None:
        super().__init__()
        self.fp32_draw, self.experts = fp32_draw, experts
        self.router, self.expert = nn.Linear(32, experts), nn.Linear(32, 32 * experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x)
        dtype = torch.float32 if self.fp32_draw else scores.dtype
        u = torch.rand_like(scores, dtype=dtype)
        g = (-torch.log(-torch.log(u))).to(scores.dtype)
        w = torch.softmax((scores + g) / 0.3, -1)
        return (w[..., None] * self.expert(x).view(x.shape[0], self.experts, 32)).sum(1)


@pytest.mark.parametrize("candidate", ["bf16", "fp16"])
def test_a_random_draw_in_the_models_dtype_is_named_with_its_lines_checked_and_the_fix_as_printed_cures(candidate):
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    result = fpdoctor.compare(NoisyRouter().eval(), x, candidate=candidate)
    first = result.report.findings[0]
    assert first.name == "random-draw-rounded", str(result.report)
    assert first.evidence["location"].endswith(f":{_line(NoisyRouter.forward, 'torch.rand_like')}")
    assert first.evidence["lines_raised"][1] == _line(NoisyRouter.forward, "-torch.log(-torch.log(u))")
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before
    assert not result.report.by_name("precision-divergence")  # not "made by accumulation" beside it
    torch.manual_seed(0)
    fixed = fpdoctor.compare(NoisyRouter(fp32_draw=True).eval(), x, candidate=candidate)
    assert not fixed.report.findings, str(fixed.report)


class PaddedEncoder(nn.Module):
    """Left-padded sequences, positions counted from the mask in the model's dtype, read by a
    sinusoidal position code that high frequencies make sensitive to every unit."""

    def __init__(self, fp32_positions: bool = False) -> None:
        super().__init__()
        self.fp32_positions = fp32_positions
        self.embed, self.head = nn.Embedding(100, 32), nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        m = mask.float() if self.fp32_positions else mask.to(x.dtype)
        pos = m.cumsum(-1) - 1
        freqs = torch.exp(torch.arange(16, dtype=pos.dtype) * -0.3)
        code = torch.cat([(pos[..., None] * freqs).sin(), (pos[..., None] * freqs).cos()], -1)
        return self.head((x + code.to(x.dtype)).mean(1))


def test_positions_counted_from_a_mask_in_bf16_are_named_with_their_lines_checked():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 100, (8, 600)), torch.ones(8, 600, dtype=torch.long)
    mask[:, :40] = 0
    result = fpdoctor.compare(PaddedEncoder().eval(), (ids, mask), candidate="bf16")
    first = result.report.findings[0]
    # the sin that reads them is as wrong run exactly: its divergence's check raises the count's line
    # and says what it makes (or, where no op is forced, NUM020 names the line itself)
    at = f":{_line(PaddedEncoder.forward, 'm.cumsum(-1)')}"
    named = first.evidence["location"] if first.name == "whole-numbers-rounded" else None
    named = named or first.evidence.get("whole_numbers", {}).get("location", "")
    assert named.endswith(at), str(result.report)
    assert first.trial is not None and first.trial.after * 4 <= first.trial.before
    fixed = fpdoctor.compare(PaddedEncoder(fp32_positions=True).eval(), (ids, mask), candidate="bf16")
    assert not fixed.report.by_name("whole-numbers-rounded"), str(fixed.report)


class RareEvents(nn.Module):
    """Rare events sampled as rand_like(rate) < rate at rates near 0.002, then pooled: a bf16 draw is
    0 once in 512 draws, so the sampled events come about twice as often as their rate says."""

    def __init__(self, fp32_draw: bool = False) -> None:
        super().__init__()
        self.fp32_draw = fp32_draw
        self.rate, self.head = nn.Linear(8, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rate = torch.sigmoid(self.rate(x) - 6.0)
        u = torch.rand_like(rate, dtype=torch.float32 if self.fp32_draw else rate.dtype)
        events = (u < rate).to(rate.dtype)
        return self.head(events)


def test_rare_events_drawn_in_bf16_are_named_and_the_draw_in_fp32_cures():
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    result = fpdoctor.compare(RareEvents().eval(), x, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "random-draw-rounded", str(result.report)
    assert "once in 512" in first.message and first.trial is not None and first.trial.after * 4 <= first.trial.before
    torch.manual_seed(0)
    fixed = fpdoctor.compare(RareEvents(fp32_draw=True).eval(), x, candidate="bf16")
    assert not fixed.report.by_name("random-draw-rounded"), str(fixed.report)


def _tagger(fp32_positions: bool = False) -> nn.Module:
    """Per-token tags (64) over an ALiBi encoder whose output the tags read sharply."""
    torch.manual_seed(0)
    encoder = ALiBi(fp32_positions=fp32_positions)
    with torch.no_grad():
        encoder.out.weight.mul_(16.0)
    return nn.Sequential(encoder, nn.Linear(32, 64)).eval()


def test_a_tagger_whose_decisions_the_rounded_positions_change_gets_the_positions_fix_checked_by_top1():
    """Per-token tags over an ALiBi encoder in bf16: the rounded positions change the tags far beyond
    rounding's floor. The decisions' finding tried modules in fp32 (none gave the tags back) and said
    "no fix tried gives the decisions back" while the positions' fix, checked on the end-to-end error,
    did: its run is now judged by the tags too, and it is the decisions' fix."""
    x = torch.randn(1, 1024, 32, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(_tagger(), x, candidate="bf16")
    assert result.report.findings[0].name == "whole-numbers-rounded", str(result.report)
    (decisions,) = result.report.by_name("decisions-changed")
    assert decisions.fix.startswith("Make them in fp32 at line"), decisions.fix
    assert decisions.trial is not None and decisions.trial.tried, decisions.trial
    assert decisions.evidence["kept_in_fp32_tried"] == []
    assert decisions.evidence["made_in_fp32"]["top1"] >= 0.97
    after = fpdoctor.compare(_tagger(fp32_positions=True), x, candidate="bf16")
    assert not after.report.by_name("decisions-changed"), str(after.report)


class PositionTable(nn.Module):
    """Position ids counted from a float mask in the model's dtype and cast to integers for a learned
    position table: the last raised line makes integers, which no cast back to bf16 may touch."""

    def __init__(self, fp32_positions: bool = False) -> None:
        super().__init__()
        self.fp32_positions = fp32_positions
        self.tok, self.pos, self.head = nn.Embedding(64, 32), nn.Embedding(1024, 32), nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.float() if self.fp32_positions else mask  # the printed fix: the count in fp32
        position_ids = m.cumsum(-1) - 1
        position_ids = position_ids.clamp(min=0).long()
        return self.head(self.tok(ids) + self.pos(position_ids))


def test_position_ids_for_a_table_keep_their_integers_in_the_fix_and_the_fix_as_printed_cures():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 64, (2, 900)), torch.ones(2, 900)
    mask[1, :80] = 0  # left padding
    result = fpdoctor.compare(PositionTable().eval(), (ids, mask), candidate="bf16")
    told = result.report.by_name("whole-numbers-rounded")
    assert told, str(result.report)
    assert "keep what line" in told[0].fix and "(integers" in told[0].fix and ".to(x.dtype)" not in told[0].fix
    fixed = fpdoctor.compare(PositionTable(fp32_positions=True).eval(), (ids, mask), candidate="bf16")
    assert not [f for f in fixed.report.findings if f.severity == "error"], str(fixed.report)


@pytest.mark.parametrize(
    ("line", "integers"),
    [
        ("        position_ids = position_ids.clamp(min=0).long()\n", True),
        ("ids = q.to(torch.long)  # for the table\n", True),
        ("pe = table[pos.long()] * scale\n", False),  # an integer index inside, floats out
        ("x = torch.arange(n, dtype=torch.int64).float() / n\n", False),
    ],
)
def test_a_line_makes_integers_only_where_it_ends_in_a_cast_to_them(line, integers):
    from fpdoctor.precision.compare.made_in_dtype import _INTEGER_CAST

    assert bool(_INTEGER_CAST.search(line)) is integers


class Segments(nn.Module):
    """Segment ids counted from boundary marks in the model's dtype (a cumsum), each token reading its
    segment's learned embedding: past 256 segments bf16 rounds the count, and the lookup reads
    another segment's row."""

    def __init__(self, d: int = 16, fp32_count: bool = False) -> None:
        super().__init__()
        self.fp32_count = fp32_count
        self.tok, self.seg = nn.Embedding(50, d), nn.Embedding(1024, d)
        self.head = nn.Linear(d, 6)

    def forward(self, ids: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        marks = marks.float() if self.fp32_count else marks.to(self.tok.weight.dtype)
        segment = marks.cumsum(-1)
        h = self.tok(ids) + self.seg(segment.long())
        return self.head(h)


def test_ids_counted_in_bf16_and_looked_up_lead_with_the_count_and_never_cast_the_lookups_indices():
    torch.manual_seed(0)
    ids, marks = torch.randint(0, 50, (2, 1200)), (torch.rand(2, 1200) < 0.6).long()
    result = fpdoctor.compare(Segments().eval(), (ids, marks), candidate="bf16")
    names = [f.name for f in result.report.findings]
    assert names[0] == "whole-numbers-rounded", str(result.report)
    assert result.report.findings[0].evidence["location"].endswith(f":{_line(Segments.forward, 'cumsum')}")
    for f in result.report.findings:  # an embedding's indices cast to float would raise: never advised
        assert ".long().float()" not in (f.fix or "") and "ids.float()" not in (f.fix or ""), f.fix
    if "selection-changed" in names:
        assert names.index("selection-changed") > 0
    torch.manual_seed(0)
    fixed = fpdoctor.compare(Segments(fp32_count=True).eval(), (ids, marks), candidate="bf16")
    assert not fixed.report.by_name("whole-numbers-rounded"), str(fixed.report)
