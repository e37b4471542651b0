"""Two calls whose composition loses what one function of torch computes directly
(stable_forms.COMPOSED): a Gaussian process's log marginal likelihood with the log of a 240x240
kernel matrix's determinant, which underflows fp32 (`K.det().log()`: compare fp32 against fp64),
and a near-duplicate filter that keeps the stored documents within a degree of the query's
embedding, the angle taken as acos of the unit vectors' dot product, in bf16 (near 0 degrees the
cosine rounds to 1). compare leads with the pair, its stable form checked; the model written so, as
printed, has no error of its own."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


def _line(fn: object, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


class Marginal(nn.Module):
    """-log p(y) of a GP with an RBF kernel on fixed inputs, per target column."""

    def __init__(self, stable: bool = False, n: int = 240) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("x", torch.sort(torch.rand(n, generator=g) * 12).values)
        self.log_length, self.stable = nn.Parameter(torch.tensor(0.0)), stable

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        d = self.x[:, None] - self.x[None, :]
        k = torch.exp(-0.5 * d * d / self.log_length.exp() ** 2) + 0.3 * torch.eye(len(self.x), dtype=y.dtype)
        fit = (y * torch.linalg.solve(k, y)).sum(0)
        logdet = torch.logdet(k) if self.stable else k.det().log()
        return 0.5 * (fit + logdet)


class Encoder(nn.Module):
    """A query's unit embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(
                torch.eye(64) + 0.01 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
            )

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(q), dim=-1)


class Angles(nn.Module):
    """The angle (degrees) between each query and each of its candidate documents' embeddings."""

    def __init__(self, stable: bool = False) -> None:
        super().__init__()
        self.encoder, self.stable = Encoder(), stable

    def forward(self, q: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        u, v = self.encoder(q)[:, None], docs  # the documents' unit embeddings, stored
        if self.stable:  # the printed fix
            return torch.rad2deg(2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)))
        return torch.rad2deg(torch.acos((u * v).sum(-1).clamp(-1, 1)))


def test_the_log_of_a_determinant_that_underflows_fp32_is_named_with_logdet_checked():
    y = torch.randn(240, 4, generator=torch.Generator().manual_seed(2))
    result = fpdoctor.compare(Marginal(), y, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    at = _line(Marginal.forward, "k.det().log()")
    assert first.evidence.get("kind") == "stable-form", [(f.code, f.title) for f in result.report.findings]
    assert first.evidence["pairs"] == {f"{__file__}:{at}": "logdet"}, first.evidence
    assert "torch.logdet(A)" in first.fix and first.trial is not None and first.trial.tried, first
    assert first.trial.after < 1e-3, first.trial
    fixed = fpdoctor.compare(Marginal(stable=True), y, candidate="fp32", reference="fp64")
    assert not [f for f in fixed.report.findings if f.severity == "error"], fixed.report.findings


def test_acos_of_a_dot_product_near_one_in_bf16_is_named_with_its_atan2_form_checked():
    g = torch.Generator().manual_seed(3)
    q = F.normalize(torch.randn(128, 64, generator=g), dim=-1)
    docs = F.normalize(q[:, None] + 0.008 * torch.randn(128, 6, 64, generator=g), dim=-1)  # 0.2 to 1.2 degrees off
    result = fpdoctor.compare(Angles(), (q, docs), candidate="bf16")
    first = result.report.findings[0]
    at = _line(Angles.forward, "torch.acos((u * v)")
    assert first.evidence.get("kind") == "stable-form", [(f.code, f.title) for f in result.report.findings]
    assert first.evidence["pairs"] == {f"{__file__}:{at}": "angle"}, first.evidence
    assert "torch.atan2" in first.fix and first.trial is not None and first.trial.tried, first
    assert first.trial.after * 4 <= first.trial.before, first.trial
    fixed = fpdoctor.compare(Angles(stable=True), (q, docs), candidate="bf16")
    errors = [f for f in fixed.report.findings if f.severity == "error" and f.evidence.get("kind") != "input-rounding"]
    assert not errors, errors
    assert fixed.report.data["modules"][-1]["propagated_rel"] * 4 <= first.trial.before


def test_a_pair_is_rewritten_only_where_its_stable_form_computes_the_same_thing():
    from fpdoctor.precision.compare.stable_forms import Composed

    u = F.normalize(torch.randn(5, 3), dim=-1)
    v = F.normalize(u + 0.1 * torch.randn(5, 3), dim=-1)
    x = torch.randn(4, 6)

    def run(fn):
        with Composed() as mode:
            out = fn()
        return out, mode.lines

    cases = {  # each written so that its stable form would compute something else
        "clamped inside [-1, 1]": lambda: torch.acos((u * v).sum(-1).clamp(-0.99, 0.99)),
        "sub with alpha": lambda: torch.sub(torch.exp(x), 1, alpha=2),
        "softmax written in place": lambda: torch.log(torch.softmax(x, -1).add_(1.0)),
        "sum in float64": lambda: torch.acos((u * v).sum(-1, dtype=torch.float64)),
        "not unit vectors": lambda: torch.acos(((2 * u) * v).sum(-1).clamp(-1, 1)),
    }
    for name, fn in cases.items():
        out, lines = run(fn)
        assert not lines, name
        torch.testing.assert_close(out, fn(), msg=name)
    # a shape the stable form does not take runs as written, without raising into the forward
    out, lines = run(lambda: torch.acos((u[0] * v[0]).sum(0)))
    assert out.shape == () and torch.isfinite(out)
    # and the forms themselves: the same values where no precision is lost
    out, lines = run(lambda: 1 - torch.exp(-x.abs()))
    assert lines and torch.allclose(out, 1 - torch.exp(-x.abs()), atol=1e-6)


class MarginalPlus(Marginal):
    """The same, plus a term whose log of 1 + x loses nothing here: only the determinant's pair is the cause."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return super().forward(y) + torch.log(1 + y.abs().mean(0))


def test_only_the_pair_that_makes_the_error_is_named():
    y = torch.randn(240, 4, generator=torch.Generator().manual_seed(2))
    first = fpdoctor.compare(MarginalPlus(), y, candidate="fp32", reference="fp64").report.findings[0]
    assert first.evidence.get("kind") == "stable-form", first
    assert list(first.evidence["pairs"].values()) == ["logdet"], first.evidence
    assert "the log of 1 + x" not in first.title, first.title
