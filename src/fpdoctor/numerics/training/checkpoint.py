"""The sentinel's last-good checkpoint, written atomically (a reader never sees half a file)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def atomic_save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> None:
    state: dict[str, Any] = {"step": step, "model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):  # named here: the temporary file's name would say nothing
        raise FileNotFoundError(f"the directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fpdoctor-ckpt-", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader never sees half a checkpoint
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
