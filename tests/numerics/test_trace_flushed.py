"""Squares that fp16 flushes to zero (numerics/trace/flushed.py): a per-tensor gradient
normalisation written by hand in fp16, g / sqrt(g.pow(2).mean()), on gradients of 1e-5: every
square is below fp16's smallest subnormal, the mean is 0, and the division makes Inf or huge steps
only where a guard fails; trace said nothing of the squares. Gradients of a normal size are not
named."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _norms(scale: float) -> fpdoctor.report.model.Report:
    torch.manual_seed(0)
    layer = nn.Linear(32, 32).half()
    with fpdoctor.trace(layer) as t:
        for _ in range(4):
            layer.zero_grad()
            (layer(torch.randn(8, 32).half()).float().sum() * scale).backward()
            for p in layer.parameters():
                rms = p.grad.pow(2).mean().sqrt()
                p.grad.mul_(1.0 / (rms.float() + 1e-3)).half()
    return t.report


def test_squares_of_tiny_fp16_gradients_are_named_with_the_fp32_sum_checked():
    report = _norms(1e-6)
    (found,) = [f for f in report.findings if f.evidence.get("kind") == "flushed-squares"]
    assert found.name == "underflow-risk" and found.severity.value == "error"
    assert found.evidence["lost_share"] == 1.0 and found.evidence["sum_fp32"] > 0
    assert found.evidence["location"].endswith(f":{_norms.__code__.co_firstlineno + 8}")
    assert found.trial is not None and found.trial.tried and "x.float()" in found.fix


def test_squares_of_gradients_of_a_normal_size_are_not_named():
    report = _norms(1.0)
    assert not [f for f in report.findings if f.evidence.get("kind") == "flushed-squares"]
