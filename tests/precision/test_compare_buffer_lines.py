"""A buffer that the model's cast rounds (a sinusoidal embedding's frequencies), read by lines whose
ops then amplify that rounding (sin and cos of t * freqs, t up to 999): the fix is those lines in
fp32 with the buffer kept in fp32, and what they make cast back. Its check ran the buffer in fp32
into the lines and read their fp32 results in the next Linear (fp16): a dtype error, so the fix was
printed untried with "the lines that make its inputs were not found". Now the check casts back what
the lines make of the buffer, as the fix says, and its figure is what the fix applied gives."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


class Timesteps(nn.Module):
    def __init__(self, dim: int = 64, fixed: bool = False) -> None:
        super().__init__()
        half, self.fixed = dim // 2, fixed
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half) / half))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the fix as printed: the buffer and these lines in fp32, the result cast back
            freqs = torch.exp(-math.log(10000.0) * torch.arange(self.freqs.numel()) / self.freqs.numel())
            args = t.float()[:, None] * freqs[None, :]
            return torch.cat([torch.sin(args), torch.cos(args)], dim=-1).to(t.dtype)
        args = t[:, None] * self.freqs[None, :]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class Conditioned(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.when = Timesteps(fixed=fixed)
        self.proj = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 32))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.proj(self.when(t))


ARGS_LINE = Timesteps.forward.__code__.co_firstlineno + 5


def test_a_rounded_buffer_and_the_lines_that_read_it_are_checked_in_fp32_as_the_fix_applied_gives() -> None:
    torch.manual_seed(0)
    model = Conditioned().eval()
    t = torch.randint(900, 1000, (256,)).float()
    result = fpdoctor.compare(model, t, candidate="fp16")
    first = result.report.findings[0]
    assert first.evidence.get("rounded_buffers") == ["when.freqs"], first.evidence
    assert first.trial is not None and first.trial.tried, first.trial
    assert isinstance(first.trial.after, float) and first.trial.after * 10 < first.trial.before, first.trial
    assert f"lines {ARGS_LINE}-{ARGS_LINE + 1}" in first.fix, first.fix
    # the fix applied, in fp16, against fp64: within 2x of the checked figure
    fixed = Conditioned(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        truth = fixed.double()(t.double())
        got = fixed.half()(t.half()).double()
    assert float((got - truth).norm() / truth.norm()) <= 2 * first.trial.after


class CastToBuffer(nn.Module):
    """Integer timesteps (or event times in seconds) cast to the buffer's dtype on a line of their
    own, as diffusion and event models write it: with the buffer held in fp32 for the check, that
    cast reads fp32 from it, which the line does not write, and what the lines make must still be
    cast back (the check failed on a dtype error: "the lines that make its inputs were not found")."""

    def __init__(self, dim: int, period: float, by: str, fixed: bool = False) -> None:
        super().__init__()
        half, self.by, self.fixed, self.period = dim // 2, by, fixed, period
        self.register_buffer("freqs", torch.exp(-math.log(period) * torch.arange(half) / half))
        self.mlp = nn.Sequential(nn.Linear(dim, 128), nn.SiLU(), nn.Linear(128, 128))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the fix as printed: these lines in fp32 with the buffer in fp32, cast back
            half = self.freqs.numel()
            freqs = torch.exp(-math.log(self.period) * torch.arange(half, device=t.device) / half)
            args = t.float()[:, None] * freqs[None]
            emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
            return self.mlp(emb.to(self.mlp[0].weight.dtype))
        t = t.to(self.freqs.dtype) if self.by == "to" else t.type_as(self.freqs)
        args = t[:, None] * self.freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb)


def test_a_cast_to_the_rounded_buffers_dtype_is_not_the_code_widening() -> None:
    cases = [
        # diffusion timesteps 0..999 (trial78), bf16
        (dict(dim=128, period=10000.0, by="to"), torch.randint(900, 1000, (256,)), "bf16"),
        # event times in seconds within the hour, type_as, fp16 (spacing 2 past 2048)
        (dict(dim=64, period=3600.0, by="type_as"), torch.randint(2048, 3600, (256,)), "fp16"),
    ]
    for kwargs, t, candidate in cases:
        torch.manual_seed(0)
        model = CastToBuffer(**kwargs).eval()
        result = fpdoctor.compare(model, t, candidate=candidate)
        first = result.report.findings[0]
        assert first.evidence.get("rounded_buffers") == ["freqs"], (kwargs, first.evidence)
        assert first.trial is not None and first.trial.tried, (kwargs, first.trial)
        assert isinstance(first.trial.after, float) and first.trial.after * 4 < first.trial.before, first.trial
        fixed = CastToBuffer(**kwargs, fixed=True).eval()
        fixed.load_state_dict(model.state_dict())
        dtype = torch.bfloat16 if candidate == "bf16" else torch.float16
        with torch.no_grad():
            truth = fixed.double()(t)
            got = fixed.to(dtype)(t).double()
        assert float((got - truth).norm() / truth.norm()) <= 2 * first.trial.after, kwargs


def test_only_a_cast_to_a_held_buffers_dtype_is_taken_for_the_buffers(tmp_path) -> None:
    """With `freqs` held in fp32 for the check, `t.to(self.freqs.dtype)` reads fp32 from it (not the code
    widening); `h.to(residual.dtype)` on an fp32 residual is the code's own cast and stays wide (review54)."""
    from fpdoctor.numerics.engine.raising import RaisedLines

    code = tmp_path / "model.py"
    code.write_text("t = t.to(self.freqs.dtype)\nh = h.to(residual.dtype)\nx = x.float()\n")
    raised = RaisedLines(set(), torch.bfloat16)
    raised.held = {"freqs"}
    t = torch.zeros(2, dtype=torch.bfloat16)
    assert not raised._wider((t, torch.float32), {}, (str(code), 1, "forward"))
    assert raised._wider((t, torch.float32), {}, (str(code), 2, "forward"))
    assert raised._wider((t, torch.float32), {}, (str(code), 3, "forward"))
