"""Incident 4: "mat1 and mat2 must have the same dtype, but got Float and Half" in `time_embed`.

A video UNet was cast to fp16, then its timestep embedding was rebuilt in fp32 (as loading code
that re-creates a submodule does). On CUDA, autocast silently cast the operands; on the CPU the
forward fails. `audit` names the fp32 module statically and explains the runtime error with the
operand's origin; `harmonize` casts the model to one dtype for the device, and it runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fpdoctor.casebook import Case
from fpdoctor.report.model import Report


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int = 32, out: int = 64) -> None:
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, out), nn.SiLU(), nn.Linear(out, out))

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # t: (batch,) integer timesteps
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # float32, whatever the model's dtype
        first: nn.Linear = self.mlp[0]  # type: ignore[assignment]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(first.weight.dtype))


class TinyUNet(nn.Module):
    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.time_embed = TimestepEmbedding(out=channels)
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        self.mid = nn.Sequential(nn.GroupNorm(8, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1))
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # x: (batch, 3, H, W)
        h = self.conv_in(x)
        h = h + self.time_embed(t)[:, :, None, None]  # fp16 + fp32 promotes to fp32 ...
        return self.conv_out(self.mid(h))  # ... and the fp16 convolution then refuses it


def build() -> tuple[TinyUNet, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyUNet().half()
    model.time_embed = TimestepEmbedding(out=64)  # rebuilt after .half(): fp32
    return model, (torch.randn(2, 3, 16, 16).half(), torch.tensor([10, 500]))


def diagnose() -> Report:
    import fpdoctor

    model, inputs = build()
    result = fpdoctor.audit(model, inputs)
    fixed = fpdoctor.harmonize(model, "cpu")
    out = model(*(t.float() if t.is_floating_point() else t for t in inputs))
    report = result.report
    report.data["summary"] = [
        *report.data["summary"],
        (
            "after harmonize(model, 'cpu')",
            f"{fixed.dtype} ({fixed.reason}); {len(fixed.changed)} tensors cast; "
            f"forward runs: output {tuple(out.shape)} {out.dtype}",
        ),
    ]
    return report


TIME_EMBED = Case(
    name="unet-time-embed-dtype",
    incident=4,
    title="Float and Half in a UNet's time_embed, hidden by CUDA autocast",
    story=(
        "A video model fails on CPU and Apple MPS with 'mat1 and mat2 must have the same dtype' (here: the fp16 "
        "convolution refuses an fp32 input) while CUDA autocast hid it: time_embed stayed fp32 in an fp16 model. "
        "fpdoctor audits the model, explains the failing op with its operands' origins, and harmonizes it."
    ),
    expect=frozenset({"mixed-dtype-parameters", "dtype-mismatch"}),
    run=diagnose,
)
