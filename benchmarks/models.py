"""The small transformer the numerics budgets are measured on (CPU, a few ms per step)."""

from __future__ import annotations

import torch
from torch import nn


def small_transformer(
    layers: int = 4, dim: int = 128, heads: int = 4, vocab: int = 1000, dropout: float = 0.1
) -> nn.Module:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=dropout, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens)))

    return LM()


def batch(
    vocab: int = 1000, size: int = 8, length: int = 64, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (size, length), generator=g).to(device)
    return tokens, torch.roll(tokens, -1, dims=1)


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, autocast: torch.dtype | None = None):
    """Forward and backward (not the optimizer step), optionally under autocast to `autocast`."""
    import contextlib

    loss_fn = nn.CrossEntropyLoss()

    def step_fn(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        context = torch.autocast(tokens.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            logits = model(tokens)
            loss = loss_fn(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        return loss

    return step_fn


def mlp(tensors: int, width: int) -> nn.Module:
    """An MLP of `tensors` parameter tensors (tensors / 2 Linear(width, width) layers, weight and
    bias, each followed by a ReLU): what moves a per-parameter cost is the count of tensors, what
    moves a per-element cost is the width."""
    layers: list[nn.Module] = []
    for _ in range(max(tensors // 2, 1)):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)
