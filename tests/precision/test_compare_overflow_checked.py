"""An op that overflows inside a module that diverges gets its fix checked: compare runs the model
with the op's line and the lines after it that consume its result in fp32 (a softmax written out
by hand: exp, then the division by the sum), the result cast back after them, and prints the lines
and the end-to-end error before -> after; applied as printed, the output is finite with that error.
Two modules of the class: attention pooling with a CLIP-style logit scale over cosine scores, and a
mixture-of-experts gate, each with the softmax written by hand without subtracting the max (fp16)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class CosinePool(nn.Module):
    def __init__(self, d: int, fp32: bool = False) -> None:
        super().__init__()
        self.fp32 = fp32
        self.queries, self.key, self.value = nn.Parameter(torch.randn(4, d)), nn.Linear(d, d), nn.Linear(d, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, q = F.normalize(self.key(x), dim=-1), F.normalize(self.queries, dim=-1)
        scores = self.logit_scale.exp() * q @ k.transpose(1, 2)
        if self.fp32:  # the fix as printed: the two lines in fp32, the result cast back after them
            weights = scores.float().exp()
            weights = (weights / weights.sum(-1, keepdim=True)).to(scores.dtype)
        else:
            weights = scores.exp()  # the exp
            weights = weights / weights.sum(-1, keepdim=True)
        return (weights @ self.value(x)).flatten(1)


class Gate(nn.Module):
    """Mixture-of-experts routing with its softmax by hand over sharp router logits."""

    def __init__(self, d: int, fp32: bool = False) -> None:
        super().__init__()
        self.fp32 = fp32
        self.router, self.experts = nn.Linear(d, 8), nn.ModuleList(nn.Linear(d, d) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x) * 40.0
        if self.fp32:
            gates = logits.float().exp()
            gates = (gates / gates.sum(-1, keepdim=True)).to(logits.dtype)
        else:
            gates = logits.exp()  # the exp
            gates = gates / gates.sum(-1, keepdim=True)
        return sum(gates[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Model(nn.Module):
    def __init__(self, kind: str, fp32: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.mix = CosinePool(64, fp32) if kind == "pool" else Gate(64, fp32)
        self.head = nn.Linear(256 if kind == "pool" else 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(torch.relu(self.embed(x)))
        return self.head(h if h.dim() == 2 else h.mean(1))


def _make(kind: str, fp32: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Model(kind, fp32).eval()
    if kind == "pool":  # a trained pool: its queries point along the keys' common direction
        with torch.no_grad():
            keys = F.normalize(model.mix.key(torch.relu(model.embed(torch.randn(1024, 32)))), dim=-1).mean(0)
            model.mix.queries.copy_(keys + 0.01 * torch.randn_like(model.mix.queries))
    return model, torch.randn(16, 24, 32)


def test_an_overflow_inside_a_module_gets_its_lines_in_fp32_checked_and_the_fix_works_as_printed():
    exp_line, exp_line_gate = [
        k + 1
        for k, line in enumerate(Path(__file__).read_text().splitlines())
        if line.rstrip().endswith(".exp()  # the exp")
    ]
    for kind in ("pool", "gate"):
        model, x = _make(kind)
        result = fpdoctor.compare(model, x, candidate="fp16")
        (first, *_) = result.report.findings
        assert first.name == "precision-divergence" and first.where["op"] == "aten.exp.default", str(result.report)
        assert first.evidence["overflow_inside"], first.evidence
        assert first.trial is not None and first.trial.tried, first.fix
        assert "in fp32: aten.exp.default's operands .float(), and every op after it on them in fp32" in first.fix
        assert "cast back to fp16 only what lines" in first.fix and "not tried: bf16" in first.fix, first.fix
        after = first.trial.after
        assert isinstance(after, float) and math.isfinite(after), first.trial

        fixed, x = _make(kind, fp32=True)  # the lines it names, in fp32, the result cast back after them
        now = fpdoctor.compare(fixed, x, candidate="fp16")
        assert now.report.data["modules"][-1]["propagated_rel"] <= 1.2 * after, str(now.report)
        assert not [f for f in now.report.findings if f.where.get("op") == "aten.exp.default"], str(now.report)
        assert f"lines {exp_line if kind == 'pool' else exp_line_gate}-" in first.fix, first.fix


class Vibration(nn.Module):
    """An accelerometer front end on raw sensor counts (up to ~3000): a band energy computed by hand. Its
    square, the sum of squares over the window and the energy's own square each pass 65504 in fp16, on
    three lines: no one line in fp32 cures the output, the module kept whole does."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.band = nn.Parameter(torch.randn(64, 16) * 0.1)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the fix as printed: the module in fp32
            x = x.float()
        s = x**2
        e = s @ self.band.to(s.dtype).abs()
        p = e * e
        return torch.log1p(p)


def test_an_overflow_on_several_lines_of_a_module_is_fixed_by_the_module_kept_in_fp32_checked():
    torch.manual_seed(0)
    model = nn.Sequential(Vibration(), nn.Linear(16, 4)).eval()
    x = 1500.0 * torch.randn(64, 64)
    result = fpdoctor.compare(model, x, candidate="fp16")
    found = [f for f in result.report.findings if f.name == "precision-divergence" and f.where.get("module") == "0"]
    assert found, [(f.name, f.where) for f in result.report.findings]
    # before: "compute aten.pow inside `0` in fp32 ...", not tried, and applied it left the output non-finite
    assert found[0].fix.startswith("keep `0` in fp32: its ops overflow fp16 on more lines than"), found[0].fix
    assert found[0].trial is not None and found[0].trial.tried and found[0].trial.before == math.inf
    with torch.no_grad():  # as printed: the module in fp32, the rest in fp16
        exact = model.double()(x.double())
        model.float()
        half = nn.Sequential(Vibration(fixed=True), model[1]).half()
        half[0].band.data = model[0].band.data.float()
        out = half[1](half[0](x).half()).double()
    assert torch.isfinite(out).all() and float((out - exact).norm() / exact.norm()) < 0.05
