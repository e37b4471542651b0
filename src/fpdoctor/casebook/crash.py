"""Incidents 1 and 2 through `fpdoctor run`: the SIGFPE inside nn.Linear, caught as it happens.

A small video-transformer stand-in runs in a child process under `fpdoctor run --breadcrumbs`.
No H20 is needed and none is claimed: in the child only, the CPU kernel of aten::addmm is
replaced by one that raises SIGFPE for the published reproducer's shape (nn.Linear(1024, 18432)
in bf16 on a batch of 2, pytorch/pytorch#133548) - fault injection standing in for cuBLASLt on an
H20, which dies at that point of an integer division by zero. Every other shape gets the real
kernel. The process really dies of the signal; the report is what `fpdoctor run` reads back from
it (faulthandler's stack, the breadcrumb ring), joined with the environment verdicts of the H20
host's recorded facts.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from fpdoctor.casebook import Case
from fpdoctor.report.model import Report

SCRIPT = '''\
"""A stand-in for a video diffusion transformer: its first block, run once at start-up."""

import signal
import warnings

import torch
from torch import nn

# Fault injection, standing in for cuBLASLt on an NVIDIA H20: the CPU addmm kernel dies of SIGFPE
# for the published reproducer's shape, as cuBLASLt's heuristics do there.
CRASHING = ((2, 1024), (1024, 18432))


def addmm_like_cublaslt_on_h20(bias, mat1, mat2, *, beta=1, alpha=1):
    if (tuple(mat1.shape), tuple(mat2.shape)) == CRASHING:
        signal.raise_signal(signal.SIGFPE)
    out = mat1.new_empty((mat1.shape[0], mat2.shape[1]))
    return torch.ops.aten.addmm.out(bias, mat1, mat2, beta=beta, alpha=alpha, out=out)


_LIB = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
    _LIB.impl("addmm", addmm_like_cublaslt_on_h20, "CPU")


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1024, 18432)

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(1024)
        self.ff = FeedForward()

    def forward(self, x):
        return self.ff(self.norm(x))


class VideoDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(64, 1024)
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x):
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return x


model = VideoDiT().to(torch.bfloat16)
with torch.no_grad():
    model(torch.randn(2, 64, dtype=torch.bfloat16))
'''


def _run() -> Report:
    from fpdoctor.casebook.h20 import _facts
    from fpdoctor.crash import run_command

    with tempfile.TemporaryDirectory(prefix="fpdoctor-demo-") as tmp:
        script = Path(tmp) / "video_dit.py"
        script.write_text(SCRIPT, encoding="utf-8")
        result = run_command(
            [sys.executable, str(script)],
            breadcrumbs=True,
            env_from=_facts("h20_sigfpe.facts.json"),
            stdout=None,
            stderr=None,
            cwd=tmp,
        )
    return result.report


SIGFPE_RUN = Case(
    name="h20-sigfpe-run",
    incident=1,
    title="The same SIGFPE, caught by `fpdoctor run --breadcrumbs` as the process dies",
    story=(
        "A text-to-video model dies at start-up with 'Fatal Python error: Floating point exception' inside "
        "nn.Linear.forward on NVIDIA H20 (in training the same death reads 'Signal 8 (SIGFPE)', exit code -8: "
        "incident 2). Here a small stand-in model runs under fpdoctor run --breadcrumbs on this CPU; its addmm "
        "kernel is replaced, by fault injection standing in for cuBLASLt on an H20, with one that raises SIGFPE "
        "for the published reproducer's shape (nn.Linear(1024, 18432), bf16, batch 2). The process really dies "
        "of the signal; the report names the op in flight and joins the H20 host's recorded facts."
    ),
    expect=frozenset({"fatal-signal", "cublas-h20-sigfpe"}),
    run=_run,
)
