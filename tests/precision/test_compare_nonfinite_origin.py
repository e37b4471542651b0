"""An output that turns NaN/Inf in the candidate while fp64's stays finite is never OK: `compare` names
the op that made the first non-finite value (NUM001, as `trace` names it) with a fix checked by a
run with it in place, and `trace` gives the same fix. Three models: an additive attention mask filled
with float32's lowest value and cast to the activations' dtype (left padding under a causal mask
leaves rows masked whole: -Inf there makes them NaN in the softmax); the same with a literal -1e9;
and a log-sum-exp written out in the model's own forward, whose exp overflows fp16."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class MaskedLM(nn.Module):
    """A causal LM scorer on left-padded batches; `fill` is the mask value written, cast to x's dtype."""

    def __init__(self, fill: str) -> None:
        super().__init__()
        self.fill = fill
        self.tok, self.attn = nn.Embedding(64, 32), Attention(32, 4)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & keep.bool()[:, None, None, :]
        if self.fill == "where":  # the constant on the allowed's other side, made a tensor of x's dtype
            bias = torch.where(allowed, torch.zeros((), dtype=x.dtype), -1e30)  # the where
        elif self.fill == "own_min":  # the fix: the limit of the dtype the scores are in
            bias = torch.zeros(ids.shape[0], 1, t, t, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
        else:
            value = torch.finfo(torch.float32).min if self.fill == "float32_min" else -1e9
            bias = torch.zeros(ids.shape[0], 1, t, t).masked_fill(~allowed, value)
            bias = bias.to(x.dtype)  # the cast
        return self.head(x + self.attn(x, bias))


def _masked(fill: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = MaskedLM(fill).eval()
    lengths = torch.tensor([12, 5, 9, 3])
    keep = (torch.arange(12)[None, :] >= (12 - lengths)[:, None]).long()  # left padding
    return model, (torch.randint(1, 64, (4, 12)) * keep, keep)


def _line(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(k + 1 for k, line in enumerate(lines) if text in line)


@pytest.mark.parametrize(("fill", "said"), [("float32_min", "torch.finfo(torch.float32)"), ("minus_1e9", "1e+09")])
def test_a_mask_fill_past_fp16s_range_is_named_at_its_cast_with_a_checked_fix(fill, said):
    model, inputs = _masked(fill)
    result = fpdoctor.compare(model, inputs, candidate="fp16")
    assert result.report.verdict == "error", str(result.report)
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced" and first.where["op"] == "aten._to_copy.default", str(result.report)
    assert first.evidence["location"] == f"{__file__}:{_line('# the cast')}"
    assert said in first.message and "bias = bias.to(x.dtype)" in first.message
    assert "torch.finfo(x.dtype).min (-65504 in fp16)" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.before == "non-finite"
    assert isinstance(first.trial.after, float) and first.trial.after < 0.05  # fp16's own error here

    fixed, inputs = _masked("own_min")  # the fix as printed: the limit of the dtype cast to
    after = fpdoctor.compare(fixed, inputs, candidate="fp16")
    assert not after.report.by_name("nonfinite-produced"), str(after.report)
    assert math.isfinite(after.report.data["modules"][-1]["propagated_rel"])
    if fill == "float32_min":  # the same model in fp64 (rows masked whole are uniform): the same error
        assert after.report.data["modules"][-1]["propagated_rel"] == pytest.approx(first.trial.after, rel=0.05)


def test_a_constant_past_fp16s_range_in_a_where_is_named_and_held_at_the_limit():
    """torch.where(allowed, 0, -1e30): the constant becomes a tensor of the scores' dtype first
    (aten.scalar_tensor), which no tensor argument in that dtype showed: compare blamed the op for
    "finite inputs (up to 0)" and advised fp32 lines; it is the constant, held at fp16's limit."""
    model, inputs = _masked("where")
    result = fpdoctor.compare(model, inputs, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced" and first.evidence.get("constant") == -1e30, str(result.report)
    assert first.evidence["location"] == f"{__file__}:{_line('# the where')}"
    assert "torch.finfo(x.dtype).min (-65504 in fp16)" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and isinstance(first.trial.after, float)


def test_trace_gives_the_same_fix_for_the_cast():
    model, (ids, keep) = _masked("float32_min")
    model = model.half()
    with torch.no_grad(), fpdoctor.trace(model) as t:
        model(ids, keep)
    (first, *_) = t.report.by_name("nonfinite-produced")
    assert first.where["op"] == "aten._to_copy.default"
    assert "torch.finfo(x.dtype).min (-65504 here)" in first.fix and "in fp64" not in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and "holding +-65504 instead of Inf" in first.trial.changed


class LogSumExp(nn.Module):
    """Pooling by a log-sum-exp written out in the model's own forward: exp overflows fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * 6.0
        pooled = torch.exp(h).sum(dim=1).log()  # the pooling
        return self.head(pooled)


def test_an_op_of_the_models_own_forward_that_overflows_is_named_and_checked_in_fp32():
    torch.manual_seed(0)
    model = LogSumExp().eval()
    with torch.no_grad():
        model.proj.weight.mul_(4.0)
    x = torch.randn(8, 32, 16)
    result = fpdoctor.compare(model, x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced" and first.where["op"] == "aten.exp.default", str(result.report)
    assert first.evidence["location"] == f"{__file__}:{_line('# the pooling')}"
    assert "in fp32" in first.fix and first.trial is not None and first.trial.tried
    assert isinstance(first.trial.after, float) and first.trial.after < 0.01


class Retriever(nn.Module):
    """Query/document scores softened by a 0.01 temperature in the compute dtype, then a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 256))

    def forward(self, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        q, k = self.tower(queries), self.tower(docs)
        logits = q @ k.t() / 0.01  # the temperature
        return logits.softmax(dim=-1)


def test_an_op_whose_result_only_fits_fp32_is_checked_with_the_line_that_reads_it():
    """The scaled scores pass fp16's max (~7.8e4): the division alone in fp32, cast back, overflows again;
    with the softmax's line after it in fp32 too the output is finite: those two lines are the fix."""
    torch.manual_seed(0)
    model = Retriever().eval()
    with torch.no_grad():
        model.tower[2].weight.mul_(7.0)
    queries = torch.randn(64, 64)
    docs = torch.cat([queries + 0.3 * torch.randn(64, 64), torch.randn(192, 64)])
    result = fpdoctor.compare(model, (queries, docs), candidate="fp16")
    first = result.report.findings[0]
    line = _line("# the temperature")
    assert first.name == "nonfinite-produced" and first.evidence["location"] == f"{__file__}:{line}", str(result.report)
    assert f"lines {line}-{line + 1} of {__file__}" in first.fix and "another source" not in str(first.trial)
    assert first.trial is not None and first.trial.tried and first.trial.after < 0.01
    # one cause, one finding: no divergence finding of the same op at the same line beside it
    assert not [
        f for f in result.report.findings if f.name == "precision-divergence" and f.where["op"] == "aten.div.Tensor"
    ]


class PaddedAttention(nn.Module):
    """A padding mask written into the scores with a literal fp16 cannot hold: the fp16 run raises."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(100, 32), nn.Linear(32, 96), nn.Linear(32, 10)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, :], -1e38)  # the fill
        return self.head((scores.softmax(-1) @ v).mean(1))


def test_a_model_that_does_not_run_in_the_candidate_is_never_ok():
    torch.manual_seed(0)
    keep = torch.ones(4, 8, dtype=torch.bool)
    keep[1:, :3] = False
    result = fpdoctor.compare(PaddedAttention().eval(), (torch.randint(0, 100, (4, 8)), keep), candidate="fp16")
    assert result.report.verdict == "error", str(result.report)
    first = result.report.findings[0]
    assert (
        first.evidence["kind"] == "candidate-failed"
        and first.evidence["location"] == f"{__file__}:{_line('# the fill')}"
    )
    assert "torch.finfo(x.dtype).min" in first.fix and first.trial is not None and not first.trial.tried


class PaddedPool(nn.Module):
    """Attention pooling over padded frames: the padding pushed down by a constant, `scores - 1e9 *
    pad`, in the activations' dtype. In fp16 1e9 is Inf: a clip padded whole pools to NaN."""

    def __init__(self, penalty: float) -> None:
        super().__init__()
        self.penalty = penalty
        self.score, self.head = nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, frames: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = self.score(frames).squeeze(-1) - self.penalty * pad.to(frames.dtype)
        weights = scores.softmax(-1)
        return self.head((weights[..., None] * frames).sum(1))


def test_a_constant_past_fp16s_range_applied_by_an_op_is_named_and_holding_it_at_the_limit_is_checked():
    torch.manual_seed(0)
    frames, pad = torch.randn(8, 12, 16), torch.zeros(8, 12)
    pad[:, 9:] = 1.0
    pad[3] = 1.0  # a clip padded whole
    result = fpdoctor.compare(PaddedPool(1e9).eval(), (frames, pad), candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced" and first.evidence["constant"] == 1e9, str(result.report)
    assert "torch.finfo(frames.dtype).min (-65504 in fp16)" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and math.isfinite(float(first.trial.after))
    # as printed: a constant the format holds; the output is finite again
    fixed = fpdoctor.compare(PaddedPool(65504.0).eval(), (frames, pad), candidate="fp16")
    assert not fixed.report.by_name("nonfinite-produced"), str(fixed.report)


class _NoEps(nn.Module):
    """An L2 normalisation with no eps: an all-zero row is 0 / 0 in every precision, fp64 too."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        return z / z.pow(2).sum(-1, keepdim=True).sqrt()


def test_a_nan_the_fp64_run_makes_too_is_not_judged_as_the_candidates(tmp_path: Path) -> None:
    """compare said "NaN where the fp64 run's are finite" of a 0 / 0 the fp64 run makes too: no precision
    is its fix. compare (and plan, which compares first) now say so and stop, pointing at trace; an
    output's -inf (a mask) is not a NaN and is still compared."""
    x = torch.randn(16, 8)
    x[::4] = 0.0
    from fpdoctor.precision.compare.compare import ReferenceFailed

    with pytest.raises(ReferenceFailed, match=r"holds 32 NaN values in its fp64 run too.*fpdoctor trace"):
        fpdoctor.compare(_NoEps().eval(), x, candidate="fp16")
    with pytest.raises(ReferenceFailed, match="NaN values in its fp64 run too"):
        fpdoctor.plan(_NoEps().eval(), x, candidate="fp16")


def test_trace_says_that_non_finite_values_which_are_all_minus_inf_are_a_masks_and_not_a_nan():
    """A causal mask's -inf, softmaxed to 0, is not a fault: an OK beside "non-finite ops 8" says why."""
    scores = torch.randn(2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    block = nn.Linear(4, 4)
    with torch.no_grad(), fpdoctor.trace(block) as t:
        block(scores.masked_fill(causal, float("-inf")).softmax(-1))
    summary = dict(t.report.data["summary"])
    assert t.report.verdict == "ok" and summary["non-finite ops"].endswith(
        "(-inf only, no NaN: a mask's fill, as a causal mask is)"
    )
    assert t.report.data["nonfinite_ops"] >= 1, summary


class _TwoInfs(nn.Module):
    """An exp past fp16's range (the first Inf), a product past it of its own, then their difference (NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a = torch.exp(h * 12.0)
        b = h * h * 60000.0
        return (a - b).sum()


def test_a_nan_made_of_the_first_inf_and_another_keeps_its_own_fix():
    """The NaN takes the first Inf's fix only where that Inf is all it read: here b overflows by itself."""
    model = _TwoInfs().half()
    with torch.no_grad():
        model.lin.weight.fill_(0.3)
        model.lin.bias.fill_(0.0)
    with torch.no_grad(), fpdoctor.trace(model) as t:
        model(torch.ones(2, 4, dtype=torch.float16))
    nan = next(f for f in t.report.findings if f.title.startswith("first NaN"))
    assert not nan.fix.startswith("the first Inf's fix"), nan.fix


def test_an_inf_a_finding_blames_is_not_called_a_masks_fill():
    class Underflow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.sigmoid(self.lin(x)))  # 0 in fp16, then -inf: no mask

    model = Underflow().half()
    with torch.no_grad():
        model.lin.weight.fill_(-5.0)
    with torch.no_grad(), fpdoctor.trace(model) as t:
        model(torch.ones(2, 4, dtype=torch.float16))
    assert t.report.by_name("nonfinite-produced")
    assert "mask" not in dict(t.report.data["summary"])["non-finite ops"], t.report.data["summary"]
