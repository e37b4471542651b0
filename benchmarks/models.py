"""The small transformer the numerics budgets are measured on (CPU, a few ms per step)."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


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


# -- the curve the always-on paths are measured over ------------------------------------------------
# What the sentinel, `watch` and the update checks add per step grows with the count of parameter
# tensors (Python or a kernel launch per tensor), with the gradient bytes (one pass over them) and
# shrinks as a share with the step's own work; the optimizer's kind moves the step they are a share
# of. So their budgets are read at the worst point of a curve over all four, not at one shape.

OPTIMIZERS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
SMALL, LARGE = 64, 512  # the width of the MLPs' Linear layers: small (per-tensor costs show) and large
ROWS = 64  # a batch


@dataclass(frozen=True)
class Shape:
    """One point of the curve: an MLP of `tensors` parameter tensors of `width`, AdamW of `optimizer`
    kind (a key of OPTIMIZERS), on `threads` intra-op threads."""

    tensors: int
    width: int
    optimizer: str
    threads: int

    @property
    def label(self) -> str:
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        return f"MLP {self.tensors:4d} tensors, width {self.width:3d}, {self.optimizer:<8} AdamW, {threads}"


def shapes(quick: bool = False) -> list[Shape]:
    """The curve: 10, 100 and 1000 tensors at the small width and 10 and 100 at the large one (1000 of
    them would be 2 GB with AdamW's state), each with foreach, fused and for-loop AdamW, on one thread;
    the three sizes that move most on two threads. `quick`: its corners (6 rows)."""
    kinds = ("foreach", "fused") if quick else tuple(OPTIMIZERS)
    rows = [Shape(n, SMALL, kind, 1) for n in ((10, 1000) if quick else (10, 100, 1000)) for kind in kinds]
    rows += [Shape(n, LARGE, kind, 1) for n in ((100,) if quick else (10, 100)) for kind in kinds]
    two = [Shape(10, SMALL, "foreach", 2), Shape(1000, SMALL, "foreach", 2), Shape(100, LARGE, "foreach", 2)]
    return rows + (two[1:2] if quick else two)


# where the sampled work is timed: its cost is a few steps of the same loop each time it runs, so
# three shapes that differ in every way the curve does say it (timing it on every row would take minutes)
SAMPLED_SHAPES = (Shape(10, SMALL, "foreach", 1), Shape(100, SMALL, "fused", 1), Shape(10, LARGE, "for-loop", 1))


def mlp_loop(
    shape: Shape, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """A fresh MLP of `shape` in `dtype`, its AdamW, and its step's forward and backward (zero_grad
    first, the optimizer's step left to the caller); the same batch every step."""
    torch.manual_seed(0)
    model = mlp(shape.tensors, shape.width).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[shape.optimizer])
    x, y = torch.randn(ROWS, shape.width, dtype=dtype), torch.randn(ROWS, shape.width, dtype=dtype)

    def step_fn() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).float().square().mean()
        loss.backward()
        return loss

    return model, opt, step_fn


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# -- the work done on sampled steps ----------------------------------------------------------------
RUN_STEPS = 10_000  # the run the sampled work is spread over


@dataclass
class Sampled:
    """CPU seconds of the judge's sampled work, each time it ran: the reference step (steps 1, 10,
    100, 501, ...: `reference.EVERY`, `reference.EARLY`, and at each flat window) and the progress
    experiment (per flat window of `progress.WINDOW` finite steps, the window doubling after each: at
    most one per doubling of the run)."""

    reference: list[float]
    experiment: list[float]

    def per_step(self, steps: int = RUN_STEPS) -> float:
        """Seconds per step over a run of `steps`, every window flat (the worst case: the
        experiments at 200, 600, 1400, ... finite steps)."""
        from fpdoctor.numerics.training import progress, reference

        experiments, at = 0, progress.WINDOW
        while at <= steps:
            experiments += 1
            at += progress.WINDOW * 2**experiments
        ref = statistics.median(self.reference) if self.reference else 0.0
        exp = statistics.median(self.experiment) if self.experiment else 0.0
        # the reference step: every EVERY-th, at the EARLY steps, and once more at each flat window
        return ref * (1 / reference.EVERY + (len(reference.EARLY) + experiments) / steps) + exp * experiments / steps

    def line(self, step_s: float) -> str:
        ref = statistics.median(self.reference) if self.reference else math.nan
        exp = statistics.median(self.experiment) if self.experiment else math.nan
        return (
            f"reference step {ref * 1e3:.1f} ms ({ref / step_s:.1f} steps), progress experiment "
            f"{exp * 1e3:.1f} ms ({exp / step_s:.1f} steps): {self.per_step() / step_s:+.2%} a step over "
            f"{RUN_STEPS} steps"
        )


class SampledWork:
    """Inside the block, the judge's sampled work made due often and timed where it runs: the
    reference step every 3rd step and a progress experiment every 3rd finite step (every window
    taken for flat), on the judges `judges()` gives (read at each `tick()`, after a step). The
    work is what a real run does, more often; the step's own work is not timed."""

    def __init__(self, judges: Callable[[], list[Any]]) -> None:
        self.judges = judges
        self.sampled = Sampled([], [])
        self._saved: tuple[Any, ...] = ()

    def __enter__(self) -> Sampled:
        from fpdoctor.numerics.training import judge as judge_mod
        from fpdoctor.numerics.training import progress

        reference, run_arms, flat = judge_mod.StepJudge.reference, progress.run_arms, progress.flat
        self._saved = (reference, run_arms, flat)

        def timed(original: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                start = time.process_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    into.append(time.process_time() - start)

            return call

        def always_flat(steps: list[int], losses: list[float]) -> progress.Flat:
            return flat(steps, losses) or progress.Flat(steps[0], steps[-1], losses[0], losses[-1], 0.0)

        judge_mod.StepJudge.reference = timed(reference, self.sampled.reference)  # type: ignore[method-assign]
        progress.run_arms = timed(run_arms, self.sampled.experiment)
        progress.flat = always_flat
        return self.sampled

    def tick(self) -> None:
        for judge in self.judges():
            judge.reference_every, judge.progress_window = 3, 3
            judge.progress_judged.clear()  # no doubling: an experiment every 3 finite steps

    def __exit__(self, *exc: object) -> None:
        from fpdoctor.numerics.training import judge as judge_mod
        from fpdoctor.numerics.training import progress

        reference, run_arms, flat = self._saved
        judge_mod.StepJudge.reference = reference  # type: ignore[method-assign]
        progress.run_arms, progress.flat = run_arms, flat


class EmptyDispatch(TorchDispatchMode):
    """The floor any dispatch-mode observer pays (the tracer, the breadcrumbs): dispatch into Python
    and back, nothing else."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # as the tracer does: no dynamo disable() wrapper per op
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))
