"""A distillation whose loss is NaN while its gradients are finite, for the tests that run it in
process: KL(p_t || p_s) written out, a confident teacher's softmax holding exact zeros, so the
teacher's entropy term is 0 * log(0) = NaN; every gradient goes through the student's log-softmax
alone. The watch and the sentinel must train it as python does."""

from __future__ import annotations

import torch
from torch import nn


def teacher_and_student() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    teacher = nn.Linear(8, 10)
    with torch.no_grad():
        teacher.weight.mul_(300.0)
    teacher.requires_grad_(False)
    return teacher, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))


def loss(teacher: nn.Module, student: nn.Module, x: torch.Tensor) -> torch.Tensor:
    p_t = torch.softmax(teacher(x), dim=-1)
    return (p_t * (p_t.log() - torch.log_softmax(student(x), dim=-1))).sum(-1).mean()
