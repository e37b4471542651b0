"""Replaying a bad training step under `trace` and classifying it.

The step is run again from the state it started from: the same batch (each micro-batch of an
accumulation window, in order), the RNG state each micro-batch began with, the same weights
(nothing was updated) and buffers (put back by the caller before, and by `preserved` after).
Non-finite again, or the trace saw an op produce NaN/Inf: a numerical bug at that op.
Finite and clean: the step does not reproduce; `transient.py` then tells its four causes apart
(the machine, a race, an uninitialised read, a nondeterministic kernel) by re-running it again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe.batches import MicroBatch, OutputsOnly
from fpdoctor.numerics.observe.gradcheck import dense_values, grads_of, loss_flag, nonfinite_flag, tensor_kind
from fpdoctor.numerics.observe.loader import standing_out
from fpdoctor.preserve import preserved
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding
from fpdoctor.torchprivate import post_accumulate_grad_hooks


@dataclass
class ReplayResult:
    verdict: str  # "deterministic-nonfinite", "transient-fault-suspected" or "replay-failed"
    micro_batch: int | None = None  # the first micro-batch that was non-finite again
    loss: float = float("nan")
    culprit: Finding | None = None  # the trace's nonfinite-produced / nonfinite-input, when it found one
    others: list[Finding] = field(default_factory=list)
    error: str | None = None
    # what the replay saw when no op was named: the bad loss's or gradients' kind, count, numel, dtype
    evidence: dict[str, Any] = field(default_factory=dict)
    # a step that did not reproduce: what the experiments of `transient.decide` made of it
    cause: Any = None  # transient.TransientCause


def replay(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
    *,
    whole: bool = False,
    traced: bool = True,
    observe: Callable[[int, Any, list[torch.Tensor]], None] | None = None,
) -> ReplayResult:
    """Run `window` again under trace, one micro-batch at a time, gradients zeroed before each
    (so that a micro-batch is judged on its own gradients, not on an earlier one's NaN).

    `whole`: run every micro-batch even after a bad one (the verdict is still the first bad one's):
    under torch.distributed every rank replays, and each must issue the collectives of the whole
    window (a step_fn's own, DDP's, SyncBatchNorm's) in the same order as the others.

    `traced=False`: run without the tracer (no op is named; the experiments that re-run a step that
    did not reproduce, where the tracer's own allocations would change what memory is reused);
    `observe(index, loss, params)`: called after each micro-batch, its gradients still in place."""
    from fpdoctor.numerics.api import trace

    if not window:  # nothing was run again: no verdict on the machine can come from it
        return ReplayResult(
            "replay-failed",
            error="not replayed: no micro-batch of this step went through the model's forward (its submodules "
            "called directly, as a compute_loss of the script's own does, or a forward the front end does not see), "
            "so there was nothing to run again",
        )
    if any(post_accumulate_grad_hooks(p) for p in params):
        # an optimizer run in backward (register_post_accumulate_grad_hook) would step the real
        # weights again during the replay
        return ReplayResult(
            "replay-failed",
            error="not replayed: parameters carry post-accumulate-grad hooks (an optimizer stepped in backward), "
            "so a replay would update the weights a second time",
        )
    loss_value = float("nan")
    first_bad: ReplayResult | None = None
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            stack.enter_context(preserved(model))  # the replay's RNG draws and buffer writes stay here
            for index, micro in enumerate(window):
                for p in params:
                    p.grad = None
                micro.rng.restore()
                tracing = trace(model, headroom=False) if traced else contextlib.nullcontext(None)
                with tracing as t:
                    loss = step_fn(*micro.args, **micro.kwargs)
                if observe is not None:
                    observe(index, loss, params)
                device = params[0].device if params else torch.device("cpu")
                # a step_fn that returns None replays a forward and backward whose loss it cannot see
                # (`fpdoctor watch`: the gradient arriving at the model's outputs stands in for it)
                unseen = loss is None or isinstance(loss, OutputsOnly)
                after = isinstance(loss, OutputsOnly) and loss.after_outputs
                bad_outputs = isinstance(loss, OutputsOnly) and (not loss.finite or after)
                seen = torch.as_tensor(math.nan if bad_outputs else 0.0) if unseen else torch.as_tensor(loss)
                flags = torch.stack([loss_flag(seen, device), nonfinite_flag(grads_of(params), device)])
                loss_bad, grad_bad = flags.tolist()
                loss_value = math.nan if unseen else float(seen.detach().float().mean())
                report = t.report if t is not None else None
                culprits = (
                    [f for f in report.findings if f.name in ("nonfinite-produced", "nonfinite-input")]
                    if report
                    else []
                )
                if (loss_bad or grad_bad or culprits) and first_bad is None:
                    first = culprits[0] if culprits else None
                    others = [
                        f
                        for f in (report.findings if report else [])
                        if f is not first and f.name != "nonfinite-masked"
                    ]
                    # an unseen loss's stand-in (NaN for outputs judged bad) is no value of the run's: the value
                    # it stands for says what the step made, else the gradients
                    stands = loss.value if isinstance(loss, OutputsOnly) else None
                    value = stands if stands is not None else seen if loss_bad and not unseen else None
                    found = {} if first else _nonfinite_evidence(value, params)
                    if after and first is None:
                        found["made_after_outputs"] = True
                        inputs = [t for t in tensors_in((micro.args, micro.kwargs)) if t.is_floating_point()]
                        # the data's only where an input of the step has rows far out of line as well
                        data = any(standing_out(t) is not None for t in inputs)
                        if isinstance(loss, OutputsOnly) and loss.standing_out is not None and data:
                            rows, of, largest, elsewhere = loss.standing_out
                            found["output_rows_standing_out"] = {
                                "indices": rows, "of": of, "largest": largest, "others_largest": elsewhere
                            }  # fmt: skip
                    first_bad = ReplayResult(
                        "deterministic-nonfinite", index, loss_value, first, others, evidence=found
                    )
                    if not whole:
                        break
    except Exception as exc:
        return ReplayResult("replay-failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        for p in params:  # nothing of the replay may reach the weights
            p.grad = None
    if first_bad is not None:
        return first_bad
    return ReplayResult("transient-fault-suspected", None, loss_value if math.isfinite(loss_value) else float("nan"))


def _nonfinite_evidence(loss: torch.Tensor | None, params: list[torch.Tensor]) -> dict[str, Any]:
    """kind, count, numel, dtype of the non-finite loss (else of the non-finite gradients); host
    reads, on a bad replayed micro-batch only."""
    tensors = [loss.detach()] if loss is not None else dense_values(grads_of(params))
    bad = [t for t in tensors if tensor_kind(t)]
    if not bad:
        return {}
    kinds = [tensor_kind(t) for t in bad]
    return {
        "kind": "nan" if "nan" in kinds else kinds[0],
        "count": sum(int((~torch.isfinite(t)).sum()) for t in bad),
        "numel": sum(t.numel() for t in tensors),
        "dtype": str(bad[0].dtype).removeprefix("torch."),
    }
