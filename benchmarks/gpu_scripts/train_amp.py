"""A small CUDA training loop under autocast, for `fpdoctor trace` and `fpdoctor watch` on a GPU.

fp16 runs with torch.amp.GradScaler, as fp16 training does (its first steps overflow on purpose
while the scale calibrates: a trace must not call that a fault); bf16 runs without one.

Run: python benchmarks/gpu_scripts/train_amp.py [--dtype fp16|bf16] [--steps N] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script where no GPU is")
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.LayerNorm(1024), nn.Linear(1024, 256)).to(args.device)
    # fused where the device has it: the optimizer step a GPU job most often runs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.device.startswith("cuda"))
    scaler = torch.amp.GradScaler(args.device, enabled=args.dtype == "fp16")
    x = torch.randn(64, 256, device=args.device)
    y = torch.randn(64, 256, device=args.device)
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device.split(":")[0], dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(f"{args.dtype} on {args.device}: {args.steps} steps, last loss {loss.item():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
