"""A process killed by SIGFPE inside a module's forward, right after a CUDA matmul: what
`fpdoctor run --breadcrumbs` must name (the signal, the module, the op in flight on the GPU).

Run: python benchmarks/gpu_scripts/sigfpe.py [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn


class Crashes(nn.Module):
    """A Linear whose forward raises the signal a faulting kernel or library would, mid-forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(512, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        if x.is_cuda:
            torch.cuda.synchronize()  # the matmul has run on the device before the process dies
        os.kill(os.getpid(), signal.SIGFPE)
        return y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cpu only to try the script where no GPU is")
    args = parser.parse_args()
    model = nn.Sequential(nn.Linear(512, 512), Crashes()).to(args.device)
    with torch.no_grad():
        model(torch.randn(64, 512, device=args.device))
    return 0  # not reached: SIGFPE's default action ends the process


if __name__ == "__main__":
    raise SystemExit(main())
