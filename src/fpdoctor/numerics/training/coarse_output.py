"""A training output in a format too coarse for what it predicts, read where the reference step
cannot see it.

watch's reference step replays the model's backward from the gradient that reached its output, so
what rounding the output itself costs (a regression near 288 K in bf16, whose spacing there is 2)
is the same in both runs. Here the output as the training forward made it is read once, on the
first reference step: per column of an output in bf16/fp16 with at most COLUMNS columns (a
regression or a few scores, not logits), its mean magnitude, its spread over the batch, and the
mean cost of rounding to the format at those magnitudes (a quarter of the spacing, where rounding
to nearest is uniform over half a spacing either way). Where that cost is formats.COARSE of the
spread or more, the output cannot hold what the model is asked to predict: compare's NUM019 says
the same of a model's forward, and checks the fix there.

Cost: one host read of a few reductions per output tensor, on one step.

A front end that runs the user's whole step (the Lightning callback, the Sentinel) sees the loss, not
the outputs: `ModelOutputs` keeps what the model's own call returns on the steps the check is due, from
global forward hooks put on for that call alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fpdoctor import catalog
from fpdoctor.formats import COARSE
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import pytree

# Columns judged at most (a 48-step forecast is one output of 48 columns); logits pass the test anyway
# (their spread over the rows is far above their spacing), and a vocabulary is not worth the host read
COLUMNS = 256
ROWS = 8  # fewer rows give no spread to judge
# Output tensors ModelOutputs keeps at most: a step whose end a front end never saw holds no more
KEPT = 64


def coarse(outputs: list[torch.Tensor], *, inputs: bool = False) -> dict[str, Any] | None:
    """The first output column that rounding to its format costs COARSE of its spread, with its
    figures; None where none does. The same test reads the forward's inputs (`inputs`), where a
    column of one value written as few bits (1, 0.5, -2: a boundary coordinate, a flag, a column of
    ones) is one by construction, not by rounding: a reading that rounds to one value lands on a
    value of that few bits one time in 32 at most (bf16's 128 significands a power of two)."""
    for index, out in enumerate(outputs):
        if out.dtype not in (torch.float16, torch.bfloat16) or out.numel() == 0:
            continue
        flat = out.detach().reshape(-1, out.shape[-1] if out.dim() >= 2 else 1)
        if flat.shape[1] > COLUMNS or flat.shape[0] < ROWS:
            continue
        x = flat.double()
        eps = torch.finfo(out.dtype).eps
        # the spacing at each value: eps times the power of two at or below it (the normal range)
        spacing = eps * torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(out.dtype).tiny))))
        figures = torch.stack([x.abs().mean(0), x.std(0), spacing.mean(0) / 4]).tolist()
        for column, (magnitude, spread, cost) in enumerate(zip(*figures, strict=True)):
            # a spread of 0 with values away from 0: every row rounds to one value of the format (the
            # coarsest case: a model starting at a climatological mean), not an output that never varies,
            # as the same at two checks steps apart says
            if inputs and spread == 0 and _few_bits(magnitude):
                continue
            if math.isfinite(spread) and magnitude > 0 and cost >= COARSE * spread:
                return {
                    "output": index, "column": column, "dtype": str(out.dtype).removeprefix("torch."),
                    "columns": flat.shape[1],
                    "magnitude": magnitude, "spread": spread, "rounding": cost, "rows": flat.shape[0],
                }  # fmt: skip
    return None


# A value whose significand takes at most this many bits (1, 1.5, 0.75, 3): written, not measured
FEW_BITS = 3


def _few_bits(value: float) -> bool:
    significand = math.frexp(value)[0] * 2**FEW_BITS  # in [2^(FEW_BITS-1), 2^FEW_BITS)
    return significand == int(significand)


def finding(
    found: dict[str, Any], step: int, here: dict[str, Any], *, replayed: bool = True, departed: Finding | None = None
) -> Finding:
    """`output-too-coarse-in-training` for what `coarse` found at `step`. `replayed`: the reference step
    replays the backward from the gradients at the output (it cannot see the rounding); else it ran the
    forward in fp32, and `departed` is its first departure, which this rounding explains."""
    dtype = found["dtype"]
    share = found["rounding"] / found["spread"] if found["spread"] > 0 else math.inf
    which = f"output {found['output']}, column {found['column']}" if found["output"] or found["column"] else "output"
    varies = (
        f"varies by {found['spread']:.3g} over the batch ({found['rows']} rows), and rounding to {dtype} alone moves "
        f"it by {found['rounding']:.3g} on average there ({share:.0%} of that spread)"
        if found["spread"] > 0
        else f"is one value of {dtype} on all {found['rows']} rows of the batch: rounding to {dtype} there moves a "
        f"value by {found['rounding']:.3g} on average, more than what the model's outputs differ by"
    )
    if replayed:
        reference = (
            "the reference step cannot see it, as it replays the backward from the gradient that reached this output."
        )
    elif departed is not None:
        reference = (
            f"the reference step's gradients depart from this run's from step {departed.where.get('step')} on (the "
            "finding after this one): its forward runs in fp32, its output not rounded, so this is where they part."
        )
    else:
        reference = "the reference step runs the forward in fp32, whose output is not rounded."
    message = (
        f"At step {step} the model's {which} is in {dtype}: it sits at {found['magnitude']:.4g} on average and {varies}"
        ". The loss is computed on values the format cannot place finely, so the fit stalls near that error, with "
        f"no NaN; {reference}"
    )
    fix = (
        "Return the output in fp32: its last layer outside autocast on its input .float() (or kept in fp32 in a "
        "model cast to bf16), or have it predict the offset from a constant (y - c, the constant added back in "
        "fp32); `fpdoctor compare` on the model checks either (NUM019)"
    )
    return catalog.make(
        "output-too-coarse-in-training",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "forward", "step": step, **here},
        evidence={
            **found,
            "share_of_spread": share if math.isfinite(share) else None,
            "step": step,
            "departed_at": departed.where.get("step") if departed is not None else None,
        },
        trial=Trial.untried(
            "no training step is run with only the output's layer in fp32 (the reference step runs the whole step in "
            "fp32); `fpdoctor compare` runs the model's forward with the output's layer kept in fp32 and checks it"
        ),
    )


def input_finding(found: dict[str, Any], step: int, here: dict[str, Any]) -> Finding:
    """`input-too-coarse-in-training`: the training forward's input `found["output"]` (an argument, by
    position), column `found["column"]`, reached the model in a format too coarse for what it varies by
    (raw readings cast to bf16 before the model standardises them)."""
    dtype = found["dtype"]
    share = found["rounding"] / found["spread"] if found["spread"] > 0 else math.inf
    which = (
        f"input {found['output']}, feature {found['column']}" if found["columns"] > 1 else f"input {found['output']}"
    )
    varies = (
        f"varies by {found['spread']:.3g} over the batch ({found['rows']} rows), and rounding to {dtype} moved it "
        f"by {found['rounding']:.3g} on average there ({share:.0%} of that spread)"
        if found["spread"] > 0
        else f"is one value of {dtype} on all {found['rows']} rows: what it varied by is below {dtype}'s spacing there"
    )
    message = (
        f"At step {step} the model's {which} reached its forward in {dtype}: it sits at {found['magnitude']:.4g} on "
        f"average and {varies}. What the model learns from it was lost before the forward, in the cast; no "
        "precision of the model's own gives it back (a standardisation inside the model subtracts the offset from "
        "values already rounded)."
    )
    fix = (
        f"Cast the inputs to {dtype} after they are standardised (subtract the offset and divide by the spread in "
        f"fp32, then cast), or feed them in fp32 and keep the model's first layer (and its standardisation) in fp32"
    )
    return catalog.make(
        "input-too-coarse-in-training",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "forward", "step": step, **here},
        evidence={**found, "share_of_spread": share if math.isfinite(share) else None, "step": step},
        trial=Trial.untried(
            f"the inputs arrive in {dtype}: their values before the cast are the script's, which watch does not see; "
            "`fpdoctor compare --inputs-as-given` on the model fed the fp32 inputs checks the fix"
        ),
    )


class ModelOutputs:
    """The outputs of a model's outermost calls during one micro-batch, for `coarse`: global forward hooks
    (torch's tables, nothing on the modules: a step that deep-copies or saves the model copies none of
    ours) that keep what the model, or one of its direct children where the step calls that instead
    (`self.model(x)` in a LightningModule), returns; put on by `start` just before the user's forward and
    taken off by `take` after it. A call inside another kept call is not kept, nor a call whose floating
    input is the same on every row (an anchor `model(torch.full_like(x, 0.5))`, a branch fed zeros: rows that
    are one value by construction, not by rounding). Outputs wider than COLUMNS (logits) are not kept;
    references, detached, nothing copied."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._watched = {id(model), *(id(m) for m in model.children())}
        self._handles: list[RemovableHandle] = []
        self._outputs: list[torch.Tensor] = []
        self._depth = 0

    def start(self) -> None:
        if self._handles:
            return
        self._depth = 0
        try:
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._pre))
            self._handles.append(nn.modules.module.register_module_forward_hook(self._post, always_call=True))
        except Exception:
            self.take()
            raise

    def take(self) -> list[torch.Tensor]:
        """The outputs kept since `start` (and not taken yet); the hooks come off."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        outputs, self._outputs = self._outputs, []
        return outputs

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._watched:
            self._depth += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self._watched:
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth or output is None or len(self._outputs) >= KEPT or _same_rows(args):
            return
        leaves = [output] if type(output) is torch.Tensor else pytree.tree_leaves(output)
        # a regression squeezed to (batch,) is one column, whatever the batch
        self._outputs += [
            t.detach() for t in leaves
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
            and (t.dim() == 1 or t.shape[-1] <= COLUMNS)
        ]  # fmt: skip


def _same_rows(args: Any) -> bool:
    """The call's first floating tensor argument holds one row repeated (or has one row)."""
    for a in pytree.tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 1:
            with torch.no_grad():
                flat = a.detach().reshape(a.shape[0], -1)
                return flat.shape[0] < 2 or bool((flat == flat[:1]).all())
    return False
