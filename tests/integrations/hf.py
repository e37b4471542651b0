"""A tiny GPT-2 built from a config (no download) and a Trainer set up for tests (CPU, fast, quiet)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face callback's tests need transformers")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate (`make test`)")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fpdoctor.integrations.hf import FpDoctorCallback  # noqa: E402  (only with transformers there)

__all__ = [
    "NAN",
    "FpDoctorCallback",
    "Tokens",
    "Weights",
    "arguments",
    "poison_activation",
    "poison_gradient",
    "tiny_gpt2",
    "transformers",
]


NAN = float("nan")


def tiny_gpt2(seed: int = 0, dropout: float = 0.0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (12,), generator=g)
        return {"input_ids": ids, "labels": ids}


def arguments(tmp_path: Any, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        "learning_rate": 1e-3,
    }
    settings.update(kwargs)
    return transformers.TrainingArguments(**settings)


class Weights(transformers.TrainerCallback):
    """The parameters after each optimizer step (0: before the first)."""

    def __init__(self) -> None:
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after[0] = [p.detach().clone() for p in model.parameters()]

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after[state.global_step] = [p.detach().clone() for p in model.parameters()]


def poison_activation(model: Any, when: Any) -> None:
    """A NaN written into the first MLP's activation whenever `when()` says so (training forwards)."""

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if module.training and torch.is_grad_enabled() and when():
            output = output.clone()
            output[0, 0, 0] = NAN
            return output
        return None

    model.transformer.h[0].mlp.c_fc.register_forward_hook(hook)


def poison_gradient(model: Any, when: Any, value: float = NAN) -> None:
    """`value` written into one gradient of the first MLP's weight whenever `when()` says so."""
    weight = model.transformer.h[0].mlp.c_fc.weight

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if when():
            grad = grad.clone()
            grad[0, 0] = value
            return grad
        return None

    weight.register_hook(hook)
