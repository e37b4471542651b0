"""A buffer the model's cast rounded is an origin: compare's walk upstream of an op whose inputs'
rounding forces its error ends at the buffer, holds it in fp32 as the user made it, and prints the
fix with its check; applied as printed (the buffer assigned again in fp32 after model.to(bf16)),
the error is gone. Two models the shared cases do not contain: rotary embeddings whose frequency
table is a buffer, and a diffusion timestep embedding whose angle line also casts the timesteps
to the table's dtype (the fix then needs the line too)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fpdoctor
from tests.precision.factories import Rotary


class TimestepEmbedding(nn.Module):
    """sin/cos of timestep x frequency, then an MLP; `fp32_line` is the line computed in fp32."""

    def __init__(self, dim: int = 128, fp32_line: bool = False) -> None:
        super().__init__()
        self.fp32_line = fp32_line
        self.register_buffer("freqs", torch.exp(-torch.arange(dim // 2).float() * (9.2 / (dim // 2))))
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.fp32_line else self.mlp[0].weight.dtype  # the model's dtype
        angles = t.to(dtype)[:, None] * self.freqs.to(dtype)[None, :]
        emb = torch.cat([angles.sin(), angles.cos()], -1).to(self.mlp[0].weight.dtype)
        return self.mlp(emb)


def _error(model: nn.Module, inputs: tuple[torch.Tensor, ...], exact: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(*inputs).double()
    return float((out - exact).norm() / exact.norm())


def _exact(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(*(x.double() if x.is_floating_point() else x for x in inputs))


def test_a_rounded_frequency_table_is_named_and_held_in_fp32_as_printed() -> None:
    torch.manual_seed(0)
    model, x = Rotary().eval(), torch.randn(2, 4096, 64)
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.evidence["rounded_buffers"] == ["inv_freq"]
    assert "keep `inv_freq` in fp32" in first.fix and "assign it again in fp32 after the cast" in first.fix
    assert "compute lines" not in first.fix  # the buffer alone is the whole fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 0.02 < first.trial.before

    exact = _exact(model, (x,))
    plain = copy.deepcopy(model).to(torch.bfloat16)
    fixed = copy.deepcopy(model).to(torch.bfloat16)
    fixed.inv_freq = model.inv_freq.float().clone()  # as printed: assigned again in fp32 after the cast
    bf16 = (x.to(torch.bfloat16),)
    assert _error(plain, bf16, exact) > 0.1
    assert _error(fixed, bf16, exact) < 0.02


def test_a_rounded_table_read_by_a_line_that_casts_needs_both_and_says_so() -> None:
    torch.manual_seed(0)
    model, t = TimestepEmbedding().eval(), torch.arange(1000)  # integer timesteps
    result = fpdoctor.compare(model, t, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.evidence.get("rounded_buffers") == ["freqs"]
    assert "compute line" in first.fix and "keep `freqs` in fp32" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before

    exact = _exact(model, (t,))
    fixed = TimestepEmbedding(fp32_line=True).eval()
    fixed.load_state_dict(model.state_dict())
    fixed.to(torch.bfloat16)
    fixed.freqs = model.freqs.float().clone()  # the buffer in fp32 after the cast, the line in fp32
    plain = copy.deepcopy(model).to(torch.bfloat16)
    assert _error(fixed, (t,), exact) * 4 <= _error(plain, (t,), exact)


class _Alibi(nn.Module):
    """BLOOM-form ALiBi (slope * key position, cast to the scores' dtype): its slopes 2^-k are held
    exactly in fp16; the bias they make at 4k positions is not."""

    def __init__(self, d: int = 64, heads: int = 4, last: int = 16) -> None:
        super().__init__()
        self.h, self.dh, self.last = heads, d // heads, last
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.register_buffer("slopes", torch.tensor([2.0 ** -(2 * (i + 1)) for i in range(heads)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x[:, -self.last :]).view(b, self.last, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, dtype=torch.float32)
        alibi = (self.slopes.float()[:, None] * pos[None, :]).to(x.dtype)
        p = ((q @ k.transpose(-1, -2)) / self.dh**0.5 + alibi[None, :, None, :]).softmax(-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, self.last, d))


def test_a_buffer_the_format_holds_exactly_is_not_named_as_rounded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), _Alibi()).eval()
    tokens = torch.randint(0, 256, (1, 4096), generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model, tokens, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence", str(result.report)
    assert "slopes" not in " ".join(first.evidence.get("rounded_buffers") or []) and "slopes" not in first.message
    assert first.trial is not None and first.trial.tried, first.trial


class _CentredCosine(nn.Module):
    """A cosine classifier on embeddings centred by a bank's mean far from the origin: the model also
    centres the class means, on a line of its own; both buffers the cast rounds. `fixed`: the
    fix as printed, both plain fp32 attributes, the means read as .to(z.dtype) where the matmul
    meets them (a fixed .to(torch.bfloat16) there would break compare's own fp64 run)."""

    def __init__(self, dim: int = 96, classes: int = 200, fixed: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.fixed = fixed
        self.embed = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, dim))
        centre = 3.0 * torch.randn(1, dim, generator=g)
        means = centre + 0.05 * torch.randn(classes, dim, generator=g)
        if fixed:
            self.means, self.centre = means, centre
        else:
            self.register_buffer("means", means)
            self.register_buffer("centre", centre)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.centre + 0.05 * self.embed(x)
        means = self.means.to(z.dtype) if self.fixed else self.means
        q = nn.functional.normalize(z - self.centre, dim=-1)
        k = nn.functional.normalize(means - self.centre, dim=-1)
        return 10.0 * q @ k.t()


def test_every_rounded_buffer_the_lines_read_is_held_and_the_fix_runs_in_any_dtype() -> None:
    torch.manual_seed(0)
    model, x = _CentredCosine().eval(), torch.randn(512, 32)
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    # the worst op's own dataflow reads `centre` only; another line centres `means`
    assert first.name == "precision-divergence" and first.evidence.get("rounded_buffers") == ["centre", "means"]
    assert first.trial is not None and first.trial.tried and first.trial.after * 10 <= first.trial.before
    assert "as .to(x.dtype)" in first.fix and "read them as .to(torch.bfloat16)" not in first.fix

    torch.manual_seed(0)
    fixed = _CentredCosine(fixed=True).eval()
    fixed.load_state_dict(model.state_dict(), strict=False)  # the same weights; the bank is made alike
    applied = fpdoctor.compare(fixed, x, candidate="bf16")  # its fp64 run must run: the read follows z's dtype
    assert applied.report.verdict == "ok", str(applied.report)


class Barometer(nn.Module):
    """Standardises raw readings (a pressure near 1013 hPa) by buffers, then an MLP; `plain`: the mean
    held as a plain fp32 tensor attribute and the standardisation's result cast to the model's dtype
    (the fix as printed); `cast`: the cast alone, the mean still a buffer."""

    def __init__(self, plain: bool = False, cast: bool = False) -> None:
        super().__init__()
        mean, std = torch.tensor([1013.25, 288.15, 55.3]), torch.tensor([0.85, 0.31, 1.2])
        self.cast = plain or cast
        if plain:
            self.mean = mean.float()
        else:
            self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean.to(x.device)) / self.std
        return self.net(z.to(self.net[0].weight.dtype) if self.cast else z)


def test_a_rounded_buffer_is_kept_in_the_form_compares_recheck_sees() -> None:
    """The fix leads with the plain fp32 attribute: set back after the user's cast, a buffer is rounded
    again by compare's own cast, and the re-check the fix suggests (--inputs-as-given) would fail."""
    torch.manual_seed(0)
    model = Barometer().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.tensor([1013.25, 288.15, 55.3]) + torch.randn(512, 3, generator=g) * torch.tensor([0.85, 0.31, 1.2])
    first = fpdoctor.compare(model, x, candidate="bf16").report.findings[0]
    assert first.evidence.get("rounded_buffers") == ["mean"], first.message
    fix = first.fix
    assert "a plain fp32 tensor attribute (`self.mean = value.float()`" in fix
    assert fix.index("plain fp32 tensor attribute") < fix.index("assign it again in fp32 after the cast")
    assert "--inputs-as-given" in fix

    fixed = Barometer(plain=True).eval()
    fixed.load_state_dict(model.state_dict(), strict=False)  # `mean` is no longer in the state dict
    again = fpdoctor.compare(fixed, x, candidate="bf16", inputs_as_given=True).report
    assert not [f.name for f in again.findings if f.severity == "error"], again.findings[0].message
    assert again.data["output_error"]["mean"] < 0.002 and first.evidence["propagated_rel"] > 0.5  # 0.156 before

    set_back = Barometer(cast=True).eval()  # the other form, as the re-check sees it: compare casts the buffer again
    set_back.load_state_dict(model.state_dict())
    recheck = fpdoctor.compare(set_back, x, candidate="bf16", inputs_as_given=True).report
    assert any(f.severity == "error" for f in recheck.findings)
