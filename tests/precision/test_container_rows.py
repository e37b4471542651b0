"""compare's per-module rows a user can follow: a container's own ops judged in isolation, every
figure on stated elements, and a reason where a figure is missing or moves."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import container_ops
from fpdoctor.precision.metrics import ROWS, SAMPLE
from fpdoctor.precision.profile import DIVERGENCE_RATIO, MOVES
from fpdoctor.report.render import render
from tests.precision.factories import loads_strict

HERE = Path(__file__)


def line_of(text: str) -> int:
    return next(k for k, line in enumerate(HERE.read_text().splitlines(), 1) if text in line)


class SelfAttention(nn.Module):
    """Its projections are submodules; q·kᵀ, the softmax and the weighted sum are its own ops."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2)  # (batch, tokens, tokens): the scores
        return torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_model(gain: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), attn=SelfAttention(), head=nn.Linear(64, 16)))
    with torch.no_grad():
        model.attn.q.weight.mul_(gain)
        model.attn.k.weight.mul_(gain)
    return model


def modules(result: fpdoctor.CompareResult) -> dict[str, dict]:
    return {m["module"]: m for m in loads_strict(result.report.to_json())["data"]["modules"]}


def test_an_attention_whose_scores_overflow_is_judged_by_its_own_ops():
    torch.manual_seed(1)
    result = fpdoctor.compare(attention_model(gain=150), torch.randn(4, 32, 64), candidate="fp16")
    rows = modules(result)
    attn = rows["attn"]
    # before: no own-op record; the container was only re-run whole, its op unnamed in its row
    assert attn["diverged"] and attn["isolated_rel"] == "inf"
    assert attn["own_ops"]["op"] == "aten.bmm.default" and attn["own_ops"]["overflow"]
    assert attn["own_ops"]["location"].endswith(f"test_container_rows.py:{line_of('scores = q @ k.transpose')}")
    assert attn["own_ops"]["absmax"] > 65504 and "aten.bmm.default" in attn["why"][0]
    for child in ("attn.q", "attn.k", "attn.v"):
        assert not rows[child]["diverged"] and rows[child]["ratio"] < DIVERGENCE_RATIO / 2
    finding = result.report.by_name("precision-divergence")[0]
    assert finding.where == {"module": "attn", "op": "aten.bmm.default", "phase": "forward", "iteration": 0}
    assert "`attn`'s own op aten.bmm.default" in finding.message and "test_container_rows.py" in finding.message
    # the overflow's position as the candidate runs it, for plan's op-level fix
    assert result.overflows["attn"]["op"] == "aten.bmm.default" and "index" in result.overflows["attn"]


def test_an_attention_at_a_safe_scale_sits_at_its_floor():
    torch.manual_seed(1)
    result = fpdoctor.compare(attention_model(), torch.randn(4, 32, 64), candidate="fp16")
    attn = next(r for r in result.rows if r.module == "attn")
    # before: isolated None ("-") for every container
    assert attn.isolated is not None and attn.ratio is not None and attn.ratio < DIVERGENCE_RATIO / 2
    assert not attn.diverged and result.first_divergent is None
    assert attn.own["judged"] >= 4 and {"aten.bmm.default", "aten._softmax.default"} <= set(attn.own["ops"])
    assert attn.isolated_floor == attn.own["floor_rel"] and attn.judged_floor == attn.isolated_floor


class LayerScale(nn.Module):
    """A residual branch's learned per-channel scale, initialised small (CaiT, ConvNeXt)."""

    def __init__(self, dim: int, init: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Residual(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.scale = LayerScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale(self.mlp(x))


def test_a_residual_add_that_dilutes_a_branch_says_so_with_the_measured_ratio():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=Residual(), head=nn.Linear(64, 8)))
    result = fpdoctor.compare(model, torch.randn(8, 16, 64), candidate="fp16")
    rows = {r.module: r for r in result.rows}
    block, scale = rows["block"], rows["block.scale"]
    # the branch's values sit among fp16's subnormals: a large error, yet at its floor
    assert not scale.diverged and not block.diverged
    drop = scale.propagated / block.propagated
    assert drop > MOVES
    record = modules(result)["block"]
    assert record["note"].startswith("diluted /")
    why = record["why"][0]
    assert f"is {drop:.3g}x below that of `block.scale` inside it" in why
    assert f"`block.scale`'s output has {scale.rms / block.rms:.3g}x the RMS" in why
    assert "its own ops include aten.add.Tensor" in why
    summary = dict(result.report.data["summary"])
    assert summary["why errors move"].startswith("`block`: its output error")


def test_an_error_amplified_from_the_inputs_says_so_with_the_measured_gain():
    torch.manual_seed(0)
    center = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        center.weight.sub_(center.weight.mean(dim=1, keepdim=True))  # rows that cancel a common offset
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), center=center, head=nn.Linear(64, 8)))
    with torch.no_grad():
        model.embed.bias.fill_(6.0)  # the offset center cancels: its inputs' error is amplified
    result = fpdoctor.compare(model, torch.randn(16, 64), candidate="fp16")
    row = next(r for r in result.rows if r.module == "center")
    gain = row.propagated / row.input_error
    assert gain > MOVES and not row.diverged
    record = modules(result)["center"]
    assert record["note"] == f"amplified x{gain:.2g}"
    assert record["why"] == [
        f"amplified from its inputs: input error {row.input_error:.3g}, output error {row.propagated:.3g} "
        f"(gain {gain:.3g}); alone on the fp64 inputs it stays within {row.ratio:.2g}x its floor"
    ]
    assert record["input_error_rel"] == pytest.approx(modules(result)["embed"]["propagated_rel"], rel=0.2)


def test_a_container_without_ops_of_its_own_says_so():
    torch.manual_seed(1)
    result = fpdoctor.compare(attention_model(), torch.randn(4, 32, 64), candidate="fp16")
    root = modules(result)["<root>"]
    assert root["isolated_rel"] is None and root["own_ops"]["judged"] == 0
    assert root["note"] == "no own ops" and root["why"][0].startswith("no ops of its own")
    assert root["elements"]["isolated"].startswith("no ops of its own")
    table = {row[0]: row for row in result.report.data["table"]["rows"]}
    assert table["<root>"][6] == "no own ops" and table["<root>"][2] == "-"


def test_rows_state_the_elements_each_figure_was_computed_on():
    torch.manual_seed(1)
    result = fpdoctor.compare(attention_model(), torch.randn(8, 64, 64), candidate="fp16")
    rows = modules(result)
    # 8 x 64 x 64 = 32768 output values, every 11th sampled (a prime: every column of 64 is among
    # them, where every 4th would read 16 of the 64); 512 rows, 64 of them re-run
    assert rows["embed"]["elements"] == {
        "propagated": "2979 of 32768 values, every 11th",
        "isolated": "64 of 512 rows, evenly spread, all their values",
    }
    attn = rows["attn"]["elements"]
    assert attn["propagated"] == "2979 of 32768 values, every 11th"
    assert attn["isolated"].startswith(f"op {rows['attn']['own_ops']['op']}'s output")
    assert "the op run in float16" in attn["isolated"]
    text = render(loads_strict(result.report.to_json()), "text", width=100)
    assert f"on every k-th value of each output (at most {SAMPLE})" in text.replace("\n", " ")
    attn_line = next(line for line in text.splitlines() if line.startswith("attn "))
    assert f"op {rows['attn']['note'].removeprefix('op ')}" in attn_line
    assert max(len(line) for line in text.splitlines()) <= 100
    fp8 = modules(fpdoctor.compare(attention_model(), torch.randn(8, 64, 64), candidate="fp8-e4m3"))
    assert "run in float32 (fp8 applies to Linear GEMMs only)" in fp8["attn"]["elements"]["isolated"]


class Inverse(nn.Module):
    """Inverts its input, upcast in half precision (no fp16 kernel), as models often do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 16, 16)
        if x.dtype == torch.float16:
            return self.proj(torch.linalg.inv(x.float()).to(x.dtype))
        return self.proj(torch.linalg.inv(x))


def test_an_own_op_without_a_kernel_in_the_candidate_dtype_is_missing_with_the_reason():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 16) * 0.1 + torch.eye(16)
    result = fpdoctor.compare(Inverse(), x, candidate="fp16")
    root = modules(result)["<root>"]
    assert root["isolated_rel"] is None and root["note"] == "own op failed"
    why = root["why"][0]
    assert why.startswith("isolated: not measured: aten.linalg_inv_ex.default raised RuntimeError in float16: ")
    assert "Half" in why  # torch's own words: "linalg.inv: Low precision dtypes not supported. Got Half"
    assert "aten.linalg_inv_ex.default raised" in result.report.data["not_checked"]["own ops not judged"]


class NoisyAttention(SelfAttention):
    """Draws noise in its own forward and adds in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x + 0.1 * torch.randn_like(x))
        h += 0.05 * torch.randn_like(h)
        return h


def test_judging_own_ops_leaves_the_fp64_pass_and_the_random_draws_as_they_were(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), attn=NoisyAttention(), head=nn.Linear(64, 16)))
    x = torch.randn(4, 32, 64)
    rng = torch.get_rng_state()
    judged = fpdoctor.compare(model, x, candidate="bf16")
    assert torch.equal(torch.get_rng_state(), rng) and len(judged.noise) == 2
    attn = next(r for r in judged.rows if r.module == "attn")
    assert attn.own["judged"] >= 5 and attn.ratio < DIVERGENCE_RATIO / 2 and judged.first_divergent is None

    def passthrough(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    monkeypatch.setattr(container_ops.OwnOps, "__torch_dispatch__", passthrough)
    plain = fpdoctor.compare(model, x, candidate="bf16")
    assert [(r.module, r.propagated) for r in plain.rows] == [(r.module, r.propagated) for r in judged.rows]


def test_own_ops_are_re_run_on_a_few_rows_or_a_sample_of_values(monkeypatch):
    """What keeps compare within its time budget: no own op is re-run whole when it is large."""
    rerun_sizes = []
    judge = container_ops.OwnOps._judge

    def recording(self, own, func, rerun, out, *, torch_made):
        full = next(container_ops.floating(out))
        rerun_sizes.append((str(func), rerun.pick(full).numel(), full.numel()))
        judge(self, own, func, rerun, out, torch_made=torch_made)

    monkeypatch.setattr(container_ops.OwnOps, "_judge", recording)
    torch.manual_seed(1)
    fpdoctor.compare(attention_model(), torch.randn(2, 512, 64), candidate="fp16")
    ops = {op for op, _, _ in rerun_sizes}
    assert {"aten.bmm.default", "aten._softmax.default", "aten.div.Tensor"} <= ops
    for op, part, full in rerun_sizes:  # the scores: 2 x 512 x 512 values; ROWS of 1024 rows, or SAMPLE values
        assert part <= max(2 * SAMPLE, ROWS * 512), (op, part, full)
        assert part * 8 <= full, (op, part, full)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_own_ops_on_a_cuda_candidate():
    torch.manual_seed(1)
    result = fpdoctor.compare(attention_model(gain=150), torch.randn(4, 32, 64), candidate="fp16", device="cuda")
    attn = next(r for r in result.rows if r.module == "attn")
    assert attn.diverged and attn.own["op"] == "aten.bmm.default"
    safe = fpdoctor.compare(attention_model(), torch.randn(4, 32, 64), candidate="fp16", device="cuda")
    assert next(r for r in safe.rows if r.module == "attn").ratio < DIVERGENCE_RATIO
