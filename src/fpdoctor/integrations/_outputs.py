"""Replaying a forward and backward without its loss: the gradients that arrived at its outputs.

A front end that cannot call the loss (`fpdoctor watch`, which knows no loss function; the Hugging
Face callback when the Trainer computes the loss outside the model) keeps, for each training
forward, the gradient the backward brought to each of its output tensors (a tensor hook that
returns None: the gradient is not changed), then replays the step as the model's forward on the
same arguments and `torch.autograd.backward(outputs, kept gradients)`: the model's forward and
backward as they ran. Where the kept gradients are not finite (the loss itself was NaN/Inf) no
backward can say more, and the forward is judged alone (`OutputsOnly`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.numerics.observe.batches import OutputsOnly
from fpdoctor.numerics.observe.loader import standing_out
from fpdoctor.torchprivate import pytree


@dataclass
class KeptGradients:
    """The gradients that arrived at one forward's outputs (references), by output leaf index."""

    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: int = 0  # output leaves that require grad
    finite: bool = True  # the kept gradients are finite: read on a bad step, before its replay
    # a clock (the front end's count of optimizer steps) read when the first gradient arrives:
    # which step's backward this forward belongs to
    clock: Callable[[], int] | None = None
    filled_at: int | None = None
    # the original forward's outputs (references, detached; freed with the step) and, read on a bad
    # step, whether they were finite; `loss_bad`: the front end saw the step's loss non-finite
    originals: list[torch.Tensor] = field(default_factory=list)
    outputs_finite: bool = True
    loss: torch.Tensor | None = None  # the loss whose backward reached these outputs (0-d), where seen
    fills: int = 0  # gradients kept so far (a later backward through the outputs keeps its own)
    loss_bad: bool = False
    bad_grad: torch.Tensor | None = None  # read_finite's: the first kept gradient not finite

    def watch(self, output: Any) -> None:
        """Hook every output tensor that requires grad (a lone tensor without pytree's walk: its
        index is 0 either way)."""
        leaves = [output] if type(output) is torch.Tensor else pytree.tree_leaves(output)
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                self.outputs += 1
                self.originals.append(leaf.detach())
                leaf.register_hook(self._keep(index))

    def _keep(self, index: int) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            if self.filled_at is None and self.clock is not None:
                self.filled_at = self.clock()
            self.grads[index] = grad
            self.fills += 1

        return keep

    @property
    def complete(self) -> bool:
        """A gradient reached the outputs (a backward through autograd.grad alone gives none). An output the
        loss does not read (a model's auxiliary logits beside its reconstruction) gets none: its gradient is
        0, and the replay's backward starts from the others alone (`backward_from`)."""
        return bool(self.grads) or not self.outputs

    def read_finite(self) -> None:
        """Host reads, on a bad step only, outside any trace (a trace would take the NaN it reads
        for an input of the replay)."""
        with torch.no_grad():
            # the first gradient that is not finite, kept for the replay's evidence (read here: under the replay's
            # trace a read of it would be an op on a non-finite input)
            self.bad_grad = next((g for g in self.grads.values() if not bool(torch.isfinite(g).all())), None)
            self.finite = self.bad_grad is None
            self.outputs_finite = all(bool(torch.isfinite(t).all()) for t in self.originals)


def backward_from(output: Any, kept: KeptGradients) -> OutputsOnly | None:
    """The replayed forward's backward from the kept gradients (None: the replay judges the
    gradients it made); where they are not finite, the forward's outputs alone (`OutputsOnly`)."""
    if kept.loss_bad and kept.outputs_finite:
        # the step's outputs were finite and its loss was not: made after the model, in the loss
        with torch.no_grad():
            leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            now_finite = all(bool(torch.isfinite(t).all()) for t in leaves)
            rows = next(
                ((found, t.shape[0]) for t in leaves if t.is_floating_point() and (found := standing_out(t))), None
            )
        # an overflow (the loss Inf, not NaN: a NaN of the loss code's own, 0/0, is no row's) from an output row
        # far out of line: the step's inputs are checked for such rows too, by the replay
        overflowed = kept.loss is not None and bool(torch.isinf(kept.loss).any())
        out = (rows[0][0], rows[1], rows[0][1], rows[0][2]) if rows is not None and now_finite and overflowed else None
        return OutputsOnly(now_finite, after_outputs=now_finite, standing_out=out, value=kept.loss)
    tensors, grads = [], []
    for index, leaf in enumerate(pytree.tree_leaves(output)):
        grad = kept.grads.get(index)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and grad is not None:
            tensors.append(leaf)
            grads.append(grad)
    if tensors and kept.finite:
        torch.autograd.backward(tensors, grads)
        return None
    with torch.no_grad():
        bad = [
            t for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]  # fmt: skip
    # outputs finite in the step and now, and a non-finite gradient arriving at them: made after
    # the model, in the loss (outputs that were not finite in the step and are now: a transient fault)
    after = not bad and not kept.finite and kept.outputs_finite
    # made after the model: the non-finite gradient that reached its outputs (a sqrt's backward at 0 under a
    # finite loss) is the value the step made
    return OutputsOnly(not bad, after_outputs=after, value=bad[0] if bad else kept.bad_grad if after else None)
