"""The sentinel's findings, built from what it observed (no tensors, no state: data in, Finding out).

Every training finding carries `evidence.step`; under torch.distributed `where` carries the rank,
host and device (and GPU UUID) of the rank the finding is about, which every rank reports alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.observe.adaptive_eps import LargeEps
from fpdoctor.numerics.observe.amp import ScaleWatch
from fpdoctor.numerics.observe.autocast_cache import Stale
from fpdoctor.numerics.observe.grad_clears import Cleared, Where
from fpdoctor.numerics.observe.lr_schedule import Outrun, Schedule
from fpdoctor.numerics.observe.scaler_rebuilt import Scalers
from fpdoctor.numerics.observe.ungraded import written
from fpdoctor.numerics.observe.unheld import Unheld, owner
from fpdoctor.numerics.observe.zero_grads import ZeroGrads, underflow
from fpdoctor.numerics.training import distributed, transient
from fpdoctor.numerics.training.control import ControlResult
from fpdoctor.numerics.training.lr_whatif import LrTrial
from fpdoctor.numerics.training.replay import ReplayResult
from fpdoctor.report.model import Finding, Severity, Trial

_PLACE_KEYS = ("rank", "host", "device", "uuid")


def place(info: dict[str, Any]) -> dict[str, Any]:
    """The `where` keys naming a rank's place (rank, host, device, GPU UUID) from `describe`."""
    return {k: info[k] for k in _PLACE_KEYS if k in info}


def step_kind(r: dict[str, Any]) -> str | None:
    """nan / +inf / -inf of a rank's bad step (its loss first, then its gradients), None unknown."""
    if r.get("loss_bad"):
        return r.get("loss_kind") or "nan"
    kinds = [f["kind"] for f in r.get("faults") or []] or [k for _, k in r.get("parameters") or []]
    return "nan" if "nan" in kinds else kinds[0] if kinds else None


def rank_finding(
    step: int,
    r: dict[str, Any],
    *,
    micro_batches: bool,
    scaled: bool,
    numel: int,
    applied: bool = False,
    grads_finite: bool = False,
) -> Finding:
    """nonfinite-loss or nonfinite-gradient for one rank's agreed view of a bad step; `applied`:
    step_fn stepped the optimizer itself, so the step was not skipped; `grads_finite`: every
    gradient of the step was finite, so its update was too, and it was applied."""
    skipped = "step_fn applied the step itself." if applied else "the step was skipped."
    where_rank = place(r)
    text = distributed.where_text(r)
    micro = r.get("micro_batch")
    micro_text = f" (micro-batch {micro})" if micro is not None and micro_batches else ""
    micro_ev = {"micro_batch": micro} if micro is not None else {}
    if r.get("loss_bad"):
        if grads_finite and not applied:
            then = "its gradients were finite, so its update was applied, as your code applies it."
        else:
            then = "the scaler skipped it if its gradients overflowed." if scaled else skipped
        return catalog.make(
            "nonfinite-loss",
            message=f"Step {step}{micro_text}: the loss was {r.get('loss_kind') or 'not finite'} on {text}; {then}",
            where={"module": None, "op": None, "phase": "forward", "step": step, **where_rank},
            evidence={"kind": r.get("loss_kind") or "nan", "count": 1, "numel": 1, "step": step, **micro_ev},
        )
    faults = r.get("faults") or []
    names = [n for f in faults for n in f["parameters"]] or [n for n, _ in r.get("parameters") or []]
    kind = step_kind(r) or "nan"
    buckets = [f["bucket"] for f in faults]
    where_buckets = f" in DDP bucket(s) {buckets} before the all-reduce" if buckets else ""
    return catalog.make(
        "nonfinite-gradient",
        message=(
            f"Step {step}: "
            + (
                "the loss was finite but gradients were not"
                if r.get("loss_seen", True)
                else "the gradients were not finite (the loss is computed outside the model's forward, where it "
                "is not seen)"
            )
            + f" ({kind}) on {text}{where_buckets} "
            f"({len(names)} parameter(s): {', '.join(names[:4])}); {skipped}"
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **where_rank},
        evidence={
            "kind": kind,
            "count": len(names),
            "numel": numel,
            "parameters": names[:20],
            "step": step,
            **({"buckets": buckets} if buckets else {}),
        },
    )


_AFTER_OUTPUTS = (
    " The model's outputs were finite while the loss computed from them (or its gradient) was not: the NaN/Inf "
    "is made after the model, in the loss computation (every target ignored, a mean over an empty selection, a "
    "division by a count that is 0, a loss multiplied by NaN, an exp or a square past fp16's 65504 under autocast)."
)
# the same, where the replay named the loss code's op that made it and checked its fix
_AFTER_OUTPUTS_NAMED = (
    " The model's outputs were finite while the loss computed from them (or its gradient) was not: the NaN/Inf "
    "is made after the model, in the loss code, at the op named above."
)
# no op named: the replay ran the model, and the loss code (a compute_loss of the script's own) is not in it
_AFTER_OUTPUTS_FIX = (
    "Run `fpdoctor trace -- <your script>`: it follows the loss code op by op on the steps it runs, names the op "
    "that makes the NaN/Inf (a log of a probability that is 0, a division by a count that is 0) and checks its fix "
    "there"
)

_NO_OP = "the replay named no op that made the value, so there was nothing to re-run in another way"


def not_replayed(step: int, why: str, *, here: dict[str, Any]) -> Finding:
    """TRN034: a bad step with no micro-batch to run again: no verdict, and never the machine's."""
    return catalog.make(
        "step-not-replayed",
        message=(
            f"Step {step} was non-finite and skipped, but not run again: {why.removeprefix('not replayed: ')}. So "
            "nothing tells the code's NaN/Inf from a fault of the machine."
        ),
        where={"module": None, "op": None, "phase": None, "step": step, **place(here)},
        evidence={"step": step, "not_replayed": why},
        fix=catalog.get("step-not-replayed").fix,
        trial=Trial.untried(why),
    )


def _rows_after_outputs(rows: dict[str, Any]) -> tuple[str, str]:
    """Rows of the model's output far out of line with the others, where the loss made the NaN/Inf:
    the sentence that says so, and the fix (the data's)."""
    one = len(rows["indices"]) == 1
    listed = ", ".join(str(i) for i in rows["indices"][:8])
    what = f"row{'' if one else 's'} {listed} of the {rows['of']} along dim 0"
    text = (
        f" The model's outputs were finite while the loss computed from them was not, and {what} of the output "
        f"stand{'s' if one else ''} out: largest |x| {rows['largest']:.3g}, against {rows['others_largest']:.3g} in "
        "every other row. An item of the batch far out of line with the others (a corrupt reading, a unit error, an "
        "input left unnormalised) makes the loss overflow: the data, not the precision nor the loss code."
    )
    fix = (
        f"Find and repair or drop the batch item{'' if one else 's'} in {what} at this step: `fpdoctor trace -- "
        "<your script>` names its dataset index and checks the loss without it; a check where the Dataset reads "
        "an item (`assert torch.isfinite(x).all() and x.abs().max() < LIMIT, index`) names every such item. Not a "
        "precision change"
    )
    return text, fix


_BAD_DATA_TITLE = "A non-finite step reproduced on replay: the batch itself held NaN/Inf (bad data, not an op)"
# the catalogue's title speaks of "the named op": where the replay named none, it says so
_NO_OP_TITLE = "A non-finite step reproduced on replay: the same batch makes it again (no op named)"


def _batch_held_it(culprit: Finding | None) -> bool:
    """The replay's culprit is the step's own input data, not an op or a parameter."""
    return culprit is not None and culprit.name == "nonfinite-input" and culprit.evidence.get("origin") == "input"


def _bad_data_fix(culprit: Finding, *, distributed: bool) -> str:
    """The batch held NaN/Inf: the items to fix at their source where the loader named them; under
    torch.distributed a skip of one rank's own desynchronises the collectives, so it is agreed."""
    rows = culprit.evidence.get("rows") or {}
    items = rows.get("dataset_indices") or []
    named = ", ".join(str(i) for i in items[:8]) + (" ..." if len(items) > 8 else "")
    fix = (
        f"Fix dataset item{'s' if len(items) > 1 else ''} {named} where {'they are' if len(items) > 1 else 'it is'} "
        "made (the file or the preprocessing that gives a non-finite value), and check the rest of the dataset the "
        "same way (torch.isfinite(x).all() over every item)"
        if items
        else "Check the data pipeline (torch.isfinite(batch).all()) and fix the items that fail where they are made"
    )
    if distributed:
        fix += (
            "; to skip such a batch meanwhile, every rank must skip that step together: a rank that skips alone "
            "leaves the others waiting in DDP's all-reduce, or pairs its next batch's gradients with their "
            "current ones (all-reduce a bad-batch flag and skip on every rank where it is set, or keep the job "
            "under `fpdoctor watch`, which does that)"
        )
    return fix


def _experiment_decided(culprit: Finding | None) -> bool:
    """The replay's experiments named the origin of the culprit and checked a fix there: that fix is
    specific (this constant, this cast, these lines in fp32) where the fp32 control's is generic."""
    if culprit is None or not culprit.fix:
        return False
    experiment = culprit.evidence.get("experiment")
    return isinstance(experiment, dict) and experiment.get("verdict") == "origin"


def _control_text(
    control: ControlResult | None, climbed: Finding | None = None, lr_trial: LrTrial | None = None
) -> tuple[str, str | None, dict[str, Any], Trial | None]:
    """The fp32 control's sentence, the fix it implies and its trial (None: keep the op's own), and
    its evidence. After a climb of the loss (`climbed`) the updates drove the weights out of range,
    whatever the control gave (finite in fp32: only where it shows first): the fix is the learning
    rate, with `lr_trial`'s result where it ran."""
    if climbed is not None:
        ev = climbed.evidence
        evidence: dict[str, Any] = {"climbed_at_step": ev.get("step")}
        said = ""
        if control is not None:
            evidence["control_fp32"] = control.outcome
            said = {
                "finite": " Replayed again in fp32 with autocast off it was finite at this step, but",
                "nonfinite": " Replayed again in fp32 with autocast off it was non-finite too, and",
            }.get(control.outcome, "")
        text = (
            f"{said or ' But'} the loss climbed before it (loss-spike at step {ev.get('step')}, "
            f"{ev.get('loss', math.nan):.4g} against a mean of {ev.get('mean', math.nan):.4g}): the updates drove "
            "the weights out of range, so the op that overflowed is only where it shows first, and no precision "
            "change is the fix."
        )
        if lr_trial is not None:
            evidence["lr_tried"] = lr_trial.evidence()
            text += lr_trial.text()
        return text, _lr_fix(lr_trial), evidence, _lr_trial(lr_trial)
    if control is None:
        return "", None, {}, None
    evidence = {"control_fp32": control.outcome}
    if control.outcome == "finite":
        return (
            " Replayed again with every fp16/bf16 parameter, buffer and input in fp32 and autocast off, it was "
            + (f"finite (loss {control.loss:.4g})" if math.isfinite(control.loss) else "finite")
            + ": on this step the precision is what fails, not the data (an fp32 run may fail on the same code "
            "later, where the values grow: a stable form the finding names holds in every precision).",
            "Run this step in fp32 (parameters, buffers and inputs, autocast off): replayed that way it is finite. "
            "To keep only what needs it in fp32, `fpdoctor compare MODEL --candidate fp16` names the module and "
            "`fpdoctor plan` verifies a keep-in-fp32 plan.",
            evidence,
            Trial.checked(
                "every fp16/bf16 parameter, buffer and input in fp32, autocast off",
                metric="the step's loss and gradients",
                before="non-finite",
                after="finite",
                on="this step's batch, RNG state and weights",
            ),
        )
    if control.outcome == "nonfinite":
        return (
            " Replayed again in fp32 with autocast off, it was non-finite too: the data or the model's math at this "
            "op is the cause, not the precision.",
            None,
            evidence,
            None,
        )
    return f" The fp32 control replay could not run ({control.error}).", None, evidence, None


# A bad step's replay verdict names its cause; the step's own check (its NaN loss or gradient) is the
# symptom that verdict explains, and follows it in the report. A step that did not reproduce keeps its
# symptom first: its verdict says what is not known.
_VERDICTS = ("deterministic-nonfinite", "compiled-only-nonfinite")
_SYMPTOMS = ("nonfinite-loss", "nonfinite-gradient")


# what an update too large makes of the steps after it: the weights grow out of range, and what overflows there
# (the op a replay names, the loss, the stall) is a consequence whose own fix only moves the step it fails at
_CONSEQUENCES = (*_VERDICTS, *_SYMPTOMS, "training-stalled", "loss-spike", "update-blew-up", "lr-too-high")


def scale_upstream(found: list[Finding]) -> list[Finding]:
    """Where a loss scale left in the gradients (loss-scale-not-undone) made every update too large from
    its step on, the findings of later steps that follow from it (_CONSEQUENCES) come after it and say
    its fix, with its trial: the NaN at step 3 is the weights that step 1 and 2 blew up."""
    cause = next((f for f in found if f.name == "loss-scale-not-undone"), None)
    if cause is None:
        return found
    start = cause.evidence.get("step") or 0
    why = (
        f"As loss-scale-not-undone says (the optimizer took gradients {cause.evidence['scale']:g}x too large from "
        f"step {start} on: the weights grew out of range, and a change here only moves the step where they fail)"
    )

    def later(f: Finding) -> bool:
        step = f.evidence.get("step", f.evidence.get("optimizer_step"))
        return f.name in _CONSEQUENCES and isinstance(step, int) and step > start

    rest = [dataclasses.replace(f, fix=f"{why}: {cause.fix}", trial=cause.trial) if later(f) else f
            for f in found if f is not cause]  # fmt: skip
    at = min(found.index(cause), next((i for i, f in enumerate(found) if later(f)), len(found)))
    return [*rest[:at], cause, *rest[at:]]


def causes_first(found: list[Finding]) -> list[Finding]:
    """`found` with each step's replay verdict ahead of that step's symptoms, the rest in order; a
    stall after a climb of the loss (the learning rate) ahead of every verdict and symptom since."""
    verdict_at: dict[int, int] = {}
    for i, f in enumerate(found):
        step = f.evidence.get("step")
        if f.name in _VERDICTS and isinstance(step, int):
            verdict_at.setdefault(step, i)
    lead: dict[int, int] = {}  # a stall after a climb -> the first verdict or symptom since the climb
    for i, f in enumerate(found):
        climb = f.evidence.get("climbed_at_step") if f.name == "training-stalled" else None
        if isinstance(climb, int):
            since = [
                j for j, g in enumerate(found[:i])
                if g.name in (*_VERDICTS, *_SYMPTOMS) and isinstance(g.evidence.get("step"), int)
                and g.evidence["step"] > climb
            ]  # fmt: skip
            if since:
                lead[i] = min(since)
        if f.name == "output-too-coarse-in-training" and f.evidence.get("departed_at") is not None:
            # named where the reference step ran the forward in fp32: ahead of the gradients' departure it explains
            parted = [j for j, g in enumerate(found[:i]) if g.name == "gradients-depart-from-reference"
                      and g.evidence.get("stage") == "backward"]  # fmt: skip
            if parted:
                lead[i] = min(parted)

    def key(item: tuple[int, Finding]) -> tuple[int, int]:
        i, f = item
        step = f.evidence.get("step")
        if i in lead:
            return lead[i], -1  # ahead of what it explains
        if f.name in _SYMPTOMS and isinstance(step, int) and verdict_at.get(step, -1) > i:
            return verdict_at[step], 1  # right after its verdict
        return i, 0

    return [f for _, f in sorted(enumerate(found), key=key)]


def verdict_findings(
    step: int,
    result: ReplayResult,
    me: dict[str, Any],
    *,
    micro_batches: bool,
    kind: str | None,
    control: ControlResult | None = None,
    health: Any = None,
    climbed: Finding | None = None,
    lr_trial: LrTrial | None = None,
    loss_finite: bool = False,
) -> list[Finding]:
    """deterministic-nonfinite (with the trace's other findings) or transient-fault-suspected;
    `kind`: the bad step's own nan / +inf / -inf; `control`: the same replay in fp32, when run;
    `health`: what changed on this GPU since the job started (fpdoctor.health.watch.Changes);
    `climbed`: the loss spike the run climbed from before this step, if any, and `lr_trial` the
    lower learning rates tried from the climb; `loss_finite`: the step's own loss was finite (its
    gradients were not)."""
    where_rank = place(me)
    # micro-batches count from 1 within their window, as steps do
    micro = {"micro_batch": result.micro_batch + 1} if result.micro_batch is not None and micro_batches else {}
    if result.verdict == "deterministic-nonfinite":
        first = result.culprit
        after = bool(result.evidence.get("made_after_outputs"))
        rank_text = f" on rank {me['rank']}" if "rank" in me else ""
        control_text, control_fix, control_evidence, control_trial = _control_text(control, climbed, lr_trial)
        decided = first is not None and _experiment_decided(first)
        fix, trial = (
            (control_fix, control_trial)  # after a climb of the loss: the learning rate, wherever it shows
            if climbed is not None and control_fix is not None
            else (first.fix, first.trial)  # an op of the loss code named, with its own checked fix (a clamp)
            if after and first is not None and decided
            else (_AFTER_OUTPUTS_FIX, Trial.untried("the replay ran the model, not the loss code: trace runs both"))
            if after
            else (first.fix, first.trial)
            if first is not None and decided
            else (control_fix, control_trial)
            if control_fix is not None
            else (first.fix, first.trial)
            if first is not None
            else (catalog.get("deterministic-nonfinite").fix, Trial.untried(_NO_OP))
        )
        if _batch_held_it(first) and first is not None:
            fix = _bad_data_fix(first, distributed="rank" in me)
        after_text = (_AFTER_OUTPUTS_NAMED if first is not None and decided else _AFTER_OUTPUTS) if after else ""
        if after and loss_finite:  # the step's loss was finite: its backward made it (a sqrt or a norm at 0)
            after_text = after_text.replace(
                "while the loss computed from them (or its gradient) was not",
                "and so was the step's loss, while the loss's gradient was not (a sqrt, a norm or a division by a "
                "value at 0 in the loss code, or a log or sqrt of a value out of its domain in a torch.where "
                "branch the loss does not take, whose gradient is NaN all the same)",
            )
        standing = result.evidence.get("output_rows_standing_out")
        if after and first is None and standing:  # the data: one item far out of line, not the loss code
            after_text, fix = _rows_after_outputs(standing)
            trial = Trial.untried(
                "the fix is the data's: `trace` names the item's dataset index and re-runs the op without it"
            )
        finding = catalog.make(
            "deterministic-nonfinite",
            message=(
                f"Step {step}{rank_text} replayed with the same batch, RNG state and weights and was non-finite "
                "again" + (f": {first.message}" if first else ".") + after_text + control_text
            ),
            where={
                **(dict(first.where) if first else {"module": None, "op": None, "phase": None}),
                "step": step,
                **where_rank,
            },
            evidence={
                **(dict(first.evidence) if first else {"kind": kind, **result.evidence}),
                "step": step,
                "replay_loss": result.loss,
                **micro,
                **control_evidence,
            },
            fix=fix,
            trial=trial,
            title=_BAD_DATA_TITLE if _batch_held_it(first) else _NO_OP_TITLE if first is None else None,
        )
        others = result.others
        if climbed is not None and control_fix is not None and control_trial is not None:
            # the replay's op findings were checked on weights that were still growing: the same fix
            others = [dataclasses.replace(o, fix=control_fix, trial=control_trial) if o.fix else o for o in others]
        return [finding, *others]
    return [_transient_finding(step, result, me, kind=kind, health=health)]


def compressed_finding(
    step: int, hook: tuple[str, torch.dtype], peak: distributed.LocalPeak, me: dict[str, Any]
) -> Finding:
    """A DDP step non-finite after the reduction whose replay on this rank, run without it, is finite,
    while the rank's local gradients exceed the dtype the communication hook casts them to: the
    hook's cast made the Inf, deterministically; nothing of the machine's."""
    name, dtype = hook
    fmt = str(dtype).removeprefix("torch.")
    top = float(torch.finfo(dtype).max)
    rank = f"rank {me['rank']}" if "rank" in me else "this rank"
    return catalog.make(
        "deterministic-nonfinite",
        title=f"DDP's communication hook `{name}` casts {rank}'s gradients to {fmt}, past its range",
        message=(
            f"Step {step} was non-finite after the gradients' all-reduce. Replayed on {rank} with the same batch, "
            f"RNG state and weights, without the reduction, its gradients are finite, and the largest, "
            f"`{peak.name}`'s, is {peak.value:.4g}: past {fmt}'s largest value ({top:g}). The model's communication "
            f"hook `{name}` casts each gradient bucket to {fmt} before the all-reduce, so that value becomes Inf and "
            "the reduction hands it to every rank. The same batch does it again: it is not the machine's."
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **place(me)},
        evidence={
            "step": step,
            "comm_hook": name,
            "hook_dtype": fmt,
            "local_grad_absmax": peak.value,
            "parameter": peak.name,
            "dtype_max": top,
        },
        fix=(
            f"Keep the gradients inside {fmt}'s range before the hook, or reduce them in fp32: a mean over the batch "
            f"instead of a sum, targets in smaller units (standardised), or clip the local gradients before the "
            f"reduction; or drop `{name}` (ddp.register_comm_hook not called: DDP's fp32 all-reduce)"
            + (", or bf16_compress_hook, which has fp32's range (NCCL)" if dtype == torch.float16 else "")
            + "."
        ),
        trial=Trial.checked(
            f"the step on {rank} replayed without the reduction and its {fmt} cast",
            metric="the gradients",
            before="non-finite (after the reduction)",
            after=f"finite, max |g| {peak.value:.4g} (> {top:g})",
            on=f"step {step}'s batch",
        ),
    )


def _transient_finding(
    step: int, result: ReplayResult, me: dict[str, Any], *, kind: str | None, health: Any
) -> Finding:
    """transient-fault-suspected with its cause (the machine, a race, an uninitialised read, a
    nondeterministic kernel, or undecided) and the experiments that decided it (`transient.py`)."""
    told = result.cause if isinstance(result.cause, transient.TransientCause) else None
    if told is None:
        told = transient.not_run("no experiment was run on this step")
    where = distributed.where_text(me)
    drain = health is not None and health.any
    fix, trial = transient.fix_and_trial(told)
    if drain and told.cause in ("machine", "undecided"):
        # the GPU's own record since the job started (Xid, ECC) names the device to drain
        fix, trial = f"Drain {health.gpu or 'this GPU'} and run `fpdoctor health` on it: {health.text()}.", None
    lead = (
        f"Step {step} was non-finite, but replaying it with the same batch, RNG state and weights gave "
        + (f"a finite loss ({result.loss:.4g}) and " if math.isfinite(result.loss) else "")
        + "finite gradients. "
    )
    then = {
        "machine": f" Suspect {where}, not the model.",
        "race": " The code's, not the machine's: a missing synchronisation or a buffer reused too early.",
        "uninitialised-read": " The code's (or a kernel's), not the machine's.",
        "nondeterministic-kernel": " Not the machine's: the step sits at the edge of its range, and the order of a "
        "sum decides which side.",
        "undecided": f" It may be the machine ({where}), a race, an uninitialised read or a nondeterministic kernel; a "
        "fault that recurs at the same step of every run points at a library's or kernel's call count, one at "
        "random steps on one GPU at the GPU.",
    }[told.cause]
    return catalog.make(
        "transient-fault-suspected",
        title=transient.TITLES[told.cause],
        message=(lead + told.decided_by + then + (f" GPU health: {health.text()}." if health is not None else "")),
        where={"module": None, "op": None, "phase": None, "step": step, **place(me)},
        evidence={
            "kind": kind,
            "step": step,
            "replay_loss": result.loss,
            "count": 1,
            "numel": 1,
            **told.to_dict(),
            **{k: v for k, v in me.items() if k in ("gpu", "uuid")},
            **({"gpu_health": health.to_dict()} if health is not None else {}),
        },
        fix=fix,
        trial=trial,
    )


def carried_findings(
    step: int,
    since: int,
    since_scale: float | None,
    *,
    scale: float | None,
    loss: float,
    origin: ReplayResult | None,
    here: dict[str, Any],
) -> list[Finding]:
    """Step `step` began with step `since`'s non-finite gradients still in .grad (step_fn does not zero
    them) and its replay from zeroed gradients is finite: the code's, not the machine's. `origin`: the
    same step replayed at the loss scale of step `since`, which names the op that overflowed there."""
    where_rank = place(here)
    at = f" at loss scale {scale:g}" if scale is not None else ""
    named = origin is not None and origin.verdict == "deterministic-nonfinite" and origin.culprit is not None
    overflow = ""
    if named:
        assert origin is not None and origin.culprit is not None
        overflow = (
            f" Replayed at step {since}'s loss scale ({since_scale:g}) from zeroed gradients, it overflows again: "
            f"{origin.culprit.title} ({origin.culprit.where.get('op')}"
            + (f", {origin.culprit.evidence['location']}" if origin.culprit.evidence.get("location") else "")
            + "). That overflow is the GradScaler's to absorb by lowering its scale, which it did; it could "
            "not recover because the Inf stayed in .grad."
        )
    elif since_scale is not None:
        overflow = f" Step {since} ran at loss scale {since_scale:g}."
    finding = catalog.make(
        "deterministic-nonfinite",
        title=f"The training step never zeroes the gradients: step {since}'s Inf stayed in .grad and made every "
        "later step non-finite",
        message=(
            f"Step {step} began with the non-finite gradients of step {since} still in .grad (the GradScaler skips "
            "a step with Inf gradients and leaves them there, as a plain loop does), and backward added to them. "
            f"Replayed as it ran but with .grad zeroed first{at}, the step's own "
            + (f"loss ({loss:.4g}) and gradients are" if math.isfinite(loss) else "gradients are")
            + " finite: the step, the data and the machine are fine; the gradients carried over are not."
            + overflow
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **where_rank},
        evidence={
            "kind": "+inf",
            "count": 1,
            "numel": 1,
            "step": step,
            "carried_from_step": since,
            "carried_from_scale": since_scale,
            "replay_loss": loss,
        },
        fix="Zero the gradients at the start of every step, before the forward: optimizer.zero_grad(set_to_none=True).",
        trial=Trial.checked(
            "the gradients zeroed before the step",
            metric="the step's gradients",
            before=f"non-finite (carried from step {since})",
            after="finite",
            on=f"step {step}'s batch, RNG state and weights{at}",
        ),
    )
    return [finding]


def unattributed_finding(step: int, kind: str | None, numel: int, *, views: str, here: dict[str, Any]) -> Finding:
    """Non-finite gradients after the reduction across ranks that no rank's own view explains."""
    return catalog.make(
        "nonfinite-gradient",
        message=(
            f"Step {step}: the gradients after the reduction across ranks were not finite; which rank "
            f"produced them is unknown (no pre-reduce view: {views}). Every rank replays its step; the step was "
            "skipped on every rank."
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **here},
        evidence={"kind": kind or "nan", "numel": numel, "step": step},
    )


def collapse_finding(
    step: int, watch: ScaleWatch, steps: int, scale: float, next_scale: float, *, here: dict[str, Any],
    kind: str = "non-finite",
) -> Finding:  # fmt: skip
    """The scale falling step after step; `kind`: what the gradients held where a replay named it (a
    GradScaler's found_inf says only that something was non-finite: an Inf or a NaN)."""
    return catalog.make(
        "amp-scale-collapse",
        message=(
            f"Step {step}: the GradScaler's scale is {next_scale:g} after {watch.consecutive} skipped "
            f"step(s) in a row ({watch.skipped} of {steps} steps skipped for overflow so far)."
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **here},
        evidence={
            "kind": kind,
            "count": watch.consecutive,
            "numel": steps,
            "scale": next_scale,
            "step_scale": scale,
            "consecutive_skips": watch.consecutive,
            "step": step,
        },
    )


def scale_gone_finding(step: int, scale: float, watch: ScaleWatch, *, here: dict[str, Any]) -> Finding:
    """amp-scale-collapse at a scale whose reciprocal is Inf: past it the scaler lets NaN through. Its title
    says the state, not the catalog's "gradients overflow": a scale halved by steps whose loss was NaN (a
    forward's NaN, every step) fell as far with no gradient overflowing."""
    return catalog.make(
        "amp-scale-collapse",
        title="The GradScaler's loss scale fell below what fp32 can invert (1/scale is Inf): no step trains from here",
        message=(
            f"Step {step}: the GradScaler's scale is {scale:g}: halved at every step it skipped, it fell below what "
            "fp32 can invert (1/scale is Inf). From here scaler.unscale_ multiplies every gradient by Inf (0 x Inf "
            "is NaN); where its own check, which reads the scaled gradients, finds them finite, the scaler steps the "
            "optimizer on NaN/Inf gradients and the weights can turn NaN (the watch keeps such steps from them); "
            "where it does not, every step is skipped. Either way the scale never grows back from 0: the run trains "
            "no more."
        ),
        fix=(
            "Fix what made every step overflow before (the run's first finding names the op); a scale this small "
            "means the gradients overflow fp16 even unscaled, so that op in fp32, or bf16, which has fp32's range"
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **here},
        evidence={"kind": "nan", "scale": scale, "overflow_skips": watch.skipped, "step": step},
    )


def spike_finding(
    step: int, loss: float, mean: float, spread: float, window: int, *, here: dict[str, Any], lr: float | None = None
) -> Finding:
    """loss-spike, its fix with the step and the run's learning rate `lr` (where known) spelled out."""
    rate = f" (now {lr:.4g}: a tenth of it is where to start)" if lr is not None else ""
    return catalog.make(
        "loss-spike",
        message=f"Step {step}: loss {loss:.4g} against a recent mean of {mean:.4g} "
        f"(std {spread:.2g} over {window} steps).",
        where={"module": None, "op": None, "phase": "forward", "step": step, **here},
        evidence={"kind": "spike", "loss": loss, "mean": mean, "std": spread, "step": step, "count": 1, "numel": 1},
        fix=(
            f"Look at step {step}'s batch (an outlier or a mislabelled sample makes one spike that comes back); "
            "a loss that stays up or climbs is the learning rate's: clip the gradients "
            f"(torch.nn.utils.clip_grad_norm_(params, 1.0)) or lower the learning rate{rate}."
        ),
    )


def transient_spikes(spikes: list[dict[str, Any]], within: int, *, here: dict[str, Any]) -> Finding:
    """Loss spikes whose loss came back within `within` steps: the batches' noise, said once."""
    shown = ", ".join(f"{s['step']} ({s['loss']:.3g} against {s['mean']:.3g})" for s in spikes[:5])
    return catalog.make(
        "loss-spike",
        severity=Severity.INFO,
        title="The loss spiked and came back",
        message=(
            f"{len(spikes)} step(s) jumped far above the recent mean and the loss was back at its level within "
            f"{within} steps: step {shown}{' ...' if len(spikes) > 5 else ''}. Spikes that come right back are "
            "the batches' noise (a heavy-tailed loss, near convergence); one that stays up or is followed by "
            "NaN/Inf is a warning."
        ),
        fix="none needed while it comes back",
        where={"module": None, "op": None, "phase": "forward", "step": spikes[0]["step"], **here},
        evidence={
            "kind": "transient-spikes",
            "steps": [s["step"] for s in spikes],
            "within": within,
            "spikes": spikes[:20],
            "count": len(spikes),
            "numel": len(spikes),
        },
    )


def error_finding(doing: str, text: str, step: int, *, here: dict[str, Any]) -> Finding:
    return catalog.make(
        "sentinel-error",
        message=f"Step {step}: {doing} failed with {text}; the step went on unguarded.",
        where={"module": None, "op": None, "phase": None, "step": step, **here},
        evidence={"error": text, "step": step},
    )


def checkpoint_finding(step: int, path: str, text: str, *, here: dict[str, Any]) -> Finding:
    return catalog.make(
        "checkpoint-failed",
        message=f"Step {step}: writing {path} failed with {text}; training went on.",
        where={"module": None, "op": None, "phase": None, "step": step, **here},
        evidence={"path": path, "error": text, "step": step},
    )


def observing_finding(step: int, *, here: dict[str, Any]) -> Finding:
    return catalog.make(
        "sentinel-error",
        message=(
            f"Step {step}: step_fn stepped the optimizer itself (optimizer.step() or scaler.step()) although the "
            "optimizer was given to the sentinel; the sentinel did not step again, and from now on it only "
            "observes: a non-finite step is reported but has already been applied, and it is not replayed."
        ),
        where={"module": None, "op": None, "phase": None, "step": step, **here},
        evidence={"step": step},
        fix="Leave optimizer.step() (and scaler.step / scaler.update) to the sentinel, or do not pass the "
        "optimizer to it.",
    )


def optimizer_eps_finding(optimizer: Any, *, with_scaler: bool, here: dict[str, Any]) -> Finding | None:
    """fp16-adam-eps (from the trace's recipe) for the optimizer the sentinel was given, before step 1."""
    if optimizer is None:
        return None
    from fpdoctor.numerics.trace.recipes import OptimizerSeen, adam_eps_finding

    dtypes: dict[str, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + 1
    eps = [float(g["eps"]) for g in optimizer.param_groups if isinstance(g.get("eps"), (int, float))]
    seen = OptimizerSeen(name=type(optimizer).__name__, eps=eps, param_dtypes=dtypes, with_scaler=with_scaler)
    finding = adam_eps_finding(seen)
    if finding is None:
        return None
    return dataclasses.replace(
        finding, where={**finding.where, "step": 1, **here}, evidence={**finding.evidence, "step": 1}
    )


def weights_finding(
    step: int, last_applied: int | None, bad: list[tuple[str, str, Any]], numel: int, *, here: dict[str, Any]
) -> Finding:
    """The parameters themselves are NaN/Inf: the update of the last applied step put them there."""
    names = [name for name, _, _ in bad]
    kinds = [kind for _, kind, _ in bad]
    then = (
        f"the optimizer update of step {last_applied} (the last one applied) made them so"
        if last_applied is not None
        else "they were already so before the first step (the checkpoint or the initialisation)"
    )
    return catalog.make(
        "deterministic-nonfinite",
        title="The weights themselves are NaN/Inf: training cannot continue from them",
        message=(
            f"Step {step}: {len(names)} parameter(s) hold NaN/Inf ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}); {then}. Every "
            "later step is skipped without a replay: no step can recover from these weights."
        ),
        where={"module": None, "op": None, "phase": "optimizer", "step": step, **here},
        evidence={
            "kind": "nan" if "nan" in kinds else kinds[0],
            "count": sum(int((~torch.isfinite(p)).sum()) for _, _, p in bad),
            "numel": sum(p.numel() for _, _, p in bad),
            "dtype": str(bad[0][2].dtype).removeprefix("torch."),
            "parameters": names[:20],
            "step": step,
            **({"applied_step": last_applied} if last_applied is not None else {}),
        },
        fix="Go back to the last good checkpoint and fix what made the update non-finite (see the other "
        "findings, e.g. an Adam eps that fp16 cannot hold).",
        trial=Trial.untried(
            "the weights are already non-finite: the fix is a resume from a checkpoint, which fpdoctor does not do "
            "to a running job; the other findings carry what made the update non-finite"
        ),
    )


def cleared_finding(step: int, cleared: Cleared, *, here: dict[str, Any]) -> Finding:
    """TRN022: the optimizer stepped on gradients cleared after the step's backward."""
    where, via, step_at = cleared.where, cleared.via, cleared.step_at
    call = {"optimizer": "optimizer.zero_grad()", "module": "model.zero_grad()"}.get(cleared.owner)
    what = call or (f"`{cleared.text}`" if cleared.text else "something")
    at = f" at {where[0]}:{where[1]}" if where else ""
    inside = f", called from line {via[1]} ({via[2]})," if via else ""
    held = "None" if cleared.set_to_none else "zero"
    after = f" at line {step_at[1]}" if step_at else ""
    body = ", with its body," if cleared.text and cleared.text.rstrip().endswith(":") else ""  # a `for` loop
    if via and where:  # inside a helper, which may run the backward too: the clear comes out of it, not the call
        fix = (
            f"take the {call or 'clear'} at line {where[1]} of {where[0]} out of {where[2]}(), which line {via[1]} "
            f"calls between loss.backward() and the optimizer's step{after}, and call it just after that step (or "
            "before the step's first forward)"
        )
    elif where:
        fix = (
            f"move line {where[1]} of {where[0]}{body} from between loss.backward() and the optimizer's step{after} "
            "to just after that step (or before the step's first forward; with gradient accumulation, outside the "
            "micro-batch loop, never after each backward)"
        )
    else:
        fix = (
            "find what clears the gradients between loss.backward() and optimizer.step() (a zero_grad(), a "
            "`p.grad = None` or `p.grad.zero_()` loop) and move it to just after optimizer.step()"
        )
    if cleared.discarded:
        return _discarded_finding(step, cleared, what=f"{what}{at}{inside}", after=after, here=here)
    return catalog.make(
        "gradients-cleared",
        message=(
            f"Step {step}: {what}{at}{inside} ran after the step's backward and before the optimizer's step{after}, "
            f"so the optimizer took no gradient: every .grad of its {cleared.params} parameter(s) was {held} when it "
            "stepped. Its step moves no weight by a gradient (a decoupled weight decay still shrinks them), and the "
            "loss cannot fall."
        ),
        where={"module": None, "op": None, "phase": "optimizer", "step": step, **here},
        evidence={
            "step": step,
            "location": f"{where[0]}:{where[1]}" if where else None,
            **({"called_from": f"{via[0]}:{via[1]}"} if via else {}),
            **({"step_location": f"{step_at[0]}:{step_at[1]}"} if step_at else {}),
            "zero_grad_of": cleared.owner,
            "gradients": held,
            "parameters": cleared.params,
        },
        fix=fix,
        trial=Trial.untried(
            "the order of the script's calls is the evidence, with the gradients at the step (all "
            f"{held}): moving a line of the script is the fix, and only the script can run it"
        ),
    )


def _discarded_finding(step: int, cleared: Cleared, *, what: str, after: str, here: dict[str, Any]) -> Finding:
    """TRN022 for a clear inside the micro-batch loop: the step took the last micro-batch's gradients."""
    where, kept = cleared.where, cleared.discarded + 1
    line = f"line {where[1]} of {where[0]}" if where else "the zero_grad() call"
    return catalog.make(
        "gradients-cleared",
        message=(
            f"Step {step}: {what} ran between the step's backward passes, each made by the same statement (a "
            f"micro-batch loop), and cleared the gradients of {cleared.discarded} of its {kept} backward passes "
            f"before the optimizer's step{after} read them: the step took the gradient of the last micro-batch "
            f"alone, 1/{kept} of the batch it was meant to average (a noisier gradient, {kept}x fewer samples "
            "learned from)."
        ),
        where={"module": None, "op": None, "phase": "optimizer", "step": step, **here},
        evidence={
            "step": step,
            "location": f"{where[0]}:{where[1]}" if where else None,
            **({"step_location": f"{cleared.step_at[0]}:{cleared.step_at[1]}"} if cleared.step_at else {}),
            "zero_grad_of": cleared.owner,
            "backward_passes": kept,
            "cleared_before_the_step": cleared.discarded,
        },
        fix=(
            f"move {line} out of the micro-batch loop: call it once per optimizer step, just after the "
            "step (gradients then add up over the micro-batches; divide each micro-batch's loss by their number, "
            f"{kept}, for their mean)"
        ),
        trial=Trial.untried(
            "the order of the script's calls is the evidence (the same backward statement ran again after the "
            "gradients were cleared, before any step): moving a line of the script is the fix, and only the "
            "script can run it"
        ),
    )


def unscaled_backward_finding(
    step: int,
    backward_at: Where | None,
    scale_at: Where | None,
    scale: float,
    optimizer: torch.optim.Optimizer | None,
    *,
    here: dict[str, Any],
) -> Finding:
    """TRN035: the backward ran on the loss scaler.scale() was given; scaler.step() unscaled it anyway."""
    line = f"line {backward_at[1]} of {backward_at[0]}" if backward_at else "the backward"
    made = f" at line {scale_at[1]}" if scale_at else ""
    eps = optimizer.defaults.get("eps") if optimizer is not None else None
    name = type(optimizer).__name__ if optimizer is not None else "the optimizer"
    if isinstance(eps, float):  # Adam and its kin divide by the gradients' running size: the factor cancels
        cost = (
            f"{name} divides by the gradients' running size, so its updates change little, except for gradients "
            f"that, divided by {scale:g}, come near its eps ({eps:g}): those parameters barely move. And the scale "
            "no longer keeps fp16 gradients from flushing to zero in the backward."
        )
    else:
        cost = f"Every update of {name} is 1/{scale:g} of the one meant: the loss barely moves."
    return catalog.make(
        "loss-not-scaled",
        severity=Severity.WARNING if isinstance(eps, float) else None,
        message=(
            f"Step {step}: the backward at {line} ran on the loss that scaler.scale(){made} was given, not on "
            f"the scaled loss it returned: the gradients were never multiplied by the loss scale ({scale:g}), and "
            f"scaler.step() divided them by it before the optimizer's step. {cost}"
        ),
        where={"module": None, "op": None, "phase": "backward", "step": step, **here},
        evidence={
            "step": step,
            "location": f"{backward_at[0]}:{backward_at[1]}" if backward_at else None,
            **({"scale_location": f"{scale_at[0]}:{scale_at[1]}"} if scale_at else {}),
            "scale": scale,
        },
        fix=(
            f"call .backward() on what scaler.scale() returns, at {line}: `scaler.scale(loss).backward()` "
            "(or `scaled = scaler.scale(loss)` then `scaled.backward()`)"
        ),
        trial=Trial.untried(
            "the tensor the backward ran on is the evidence (the one scaler.scale() was handed, not its result): "
            "changing a line of the script is the fix, and only the script can run it"
        ),
    )


def decay_finding(
    groups: list[tuple[int, float, float]], params: int, optimizer: str, *, here: dict[str, Any]
) -> Finding:
    """TRN024: a weight decay that on its own shrinks the weights by a large share every step."""
    _, lr, wd = max(groups, key=lambda g: g[1] * g[2])
    share = lr * wd
    left = f"multiplies its weights by {max(0.0, 1 - share):.3g} every step" + (
        ": it sets them to 0" if share >= 1 else f" (half-life {math.log(2) / -math.log1p(-share):.3g} steps)"
    )
    which = ", ".join(f"group {g}" for g, _, _ in groups)
    return catalog.make(
        "weight-decay-too-strong",
        message=(
            f"{which} of {optimizer}: weight_decay {wd:g}, and at the group's highest lr ({lr:g}) lr x weight_decay = "
            f"{share:.3g}. {optimizer}'s decay, applied apart from the gradient, {left}; "
            + (
                f"its weights settle near 1 / weight_decay ({1 / wd:.2g}) whatever the gradients say"
                if "Adam" in optimizer
                else "its weights are held small whatever the gradients say"
            )
            + f", on its {params} parameter(s), and nothing is NaN."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={
            "groups": [g for g, _, _ in groups],
            "lr": lr,
            "weight_decay": wd,
            "per_step": share,
            "parameters": params,
        },
        fix=(
            f"lower weight_decay on {which}: {optimizer} multiplies it by the learning rate, so 0.01 to 0.1 is usual"
            + (f" ({wd:g} may be {1 / wd:g} mistyped)" if wd >= 1 else "")
        ),
        trial=Trial.untried(
            "read from the optimizer's param groups at the first and the last step: the decay's share of each step "
            "is lr x weight_decay, computed, not run"
        ),
    )


def _zero_lr_fix(schedules: dict[int, Schedule]) -> str:
    frozen = (
        "; to freeze those parameters on purpose, call requires_grad_(False) on them instead, which also saves "
        "their backward"
    )
    if not schedules:
        return "give that group its learning rate where the param_groups are built" + frozen
    k, schedule = next(iter(schedules.items()))
    at = (
        f" (its function at line {schedule.where[1]} of {schedule.where[0]}: `{schedule.where[2]}`)"
        if schedule.where
        else ""
    )
    return (
        f"the {schedule.kind}'s factor for group {k} is 0{at}, though the group was built with lr="
        f"{schedule.initial:g}: make it return the factor meant (it returns 0 at every step so far: an integer "
        "division, `1 // 10` or `(step + 1) // warmup`, is 0 where `/` is not)" + frozen
    )


def unheld_finding(found: Unheld, line: tuple[str, int, str] | None, *, here: dict[str, Any]) -> Finding:
    """TRN025: the model's parameters that got gradients and no optimizer holds, beside the tensors
    the optimizer holds that no forward used (`numerics/observe/unheld.py`)."""
    optimizer, orphans, missing = found.optimizer, [tuple(p.shape) for p in found.orphans], list(found.missing)
    path = owner(missing)
    # as the script writes it (`classifier[2]`); the model's own parameters: "the model's layer"
    module = written(path) if path and not path[0].isdigit() else f"model{written(path)}" if path else "a layer"
    shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
    shapes = ", ".join(str(s) for s in orphans[:4]) + (", ..." if len(orphans) > 4 else "")
    where_made = f" (line {line[1]} of {line[0]}: `{line[2]}`)" if line else ""
    # the script's own name for the new module, from the line that assigns it: `model.head`
    target = line[2].split("=")[0].strip() if line and "setattr" not in line[2] else None
    return catalog.make(
        "parameters-outside-optimizer",
        message=(
            f"{len(missing)} parameter(s) of the model got a gradient and no optimizer that stepped holds them "
            f"({shown}): they never move. {optimizer} holds {len(orphans)} tensor(s) that no training forward used "
            f"and that got no gradient (shapes {shapes}): the optimizer was built before `{module}` was "
            f"replaced{where_made}, and steps the tensors it was given."
        ),
        where={"module": path or None, "op": None, "phase": "optimizer", **here},
        evidence={"optimizer": optimizer, "missing": missing[:20], "orphans": [list(s) for s in orphans[:20]]},
        fix=(
            f"build the optimizer after the model is final: move its line after the one that replaces "
            f"`{module}`{where_made}"
            + (
                f"; or add what it lacks after that line: "
                f"{found.called}.add_param_group({{'params': {target}.parameters()"
                + (f", 'lr': {found.group_lr:g}" if found.group_lr is not None else "")
                + "})"
                if target
                else ""
            )
        ),
        trial=Trial.untried(
            "read from the optimizer's tensors and the model's gradients at its first step: which tensors an "
            "optimizer holds is the script's choice, which fpdoctor does not change in a running job"
        ),
    )


def outrun_finding(o: Outrun, *, here: dict[str, Any]) -> Finding:
    """TRN026: a scheduler stepped once per micro-batch whose schedule, sized in optimizer steps, ran out."""
    at = (
        f" (its function at line {o.where[1]} of {o.where[0]}: `{o.where[2].split('#')[0].strip()}`)" if o.where else ""
    )
    length = f"is {o.end} steps long" if o.declared else f"settles at its step {o.end}{at}"
    ended = f"its schedule {length}, so it ended at optimizer step {o.ended_at} of {o.steps}"
    since = (
        "past its end the cosine rises and falls again, the rate back up to the one the optimizer was built with"
        if o.kind == "CosineAnnealingLR"
        else f"the rate has stayed at its end since ({o.lr_now:.4g} at the last step)"
    )
    return catalog.make(
        "scheduler-per-micro-batch",
        message=(
            f"The {o.kind} was stepped {o.stepped} times in {o.steps} optimizer steps, {o.per_step} per step, once per "
            f"micro-batch: {ended}, and {since}: the updates of the rest of the run are not the ones the schedule "
            "plans, and nothing is NaN."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={
            "scheduler": o.kind,
            "scheduler_steps": o.stepped,
            "optimizer_steps": o.steps,
            "per_step": o.per_step,
            "schedule_end": o.end,
            "ended_at_optimizer_step": o.ended_at,
            "lr": o.lr_now,
        },
        fix=(
            f"call the {o.kind}'s step() once per optimizer step: move it out of the micro-batch loop, next to the "
            f"optimizer's step() (or, if the schedule is meant in micro-batches, size it so: {o.stepped} steps)"
        ),
        trial=Trial.untried(
            "read from the scheduler's step count and the optimizer's at the report: the schedule is the script's, "
            "which fpdoctor does not change in a running job"
        ),
    )


def large_eps_finding(found: LargeEps, *, here: dict[str, Any]) -> Finding:
    """TRN027: an adaptive optimizer whose eps is far above its gradients' size (numerics/observe/adaptive_eps.py)."""
    return catalog.make(
        "optimizer-eps-too-large",
        message=(
            f"{found.optimizer}'s eps is {found.eps:g}, {found.times:.3g}x the size of its gradients (the median root "
            f"of the bias-corrected second moment over its parameters, {found.root_v:.3g}): each update is lr x m / "
            f"(sqrt(v) + eps), {found.shrink:.3g} of the step {found.optimizer} takes with the default eps (1e-8). The "
            "loss falls that much slower, and nothing is NaN."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={"optimizer": found.optimizer, "eps": found.eps, "root_v": found.root_v, "share": found.shrink},
        fix=f"set eps=1e-8 (the default) where the {found.optimizer} is built ({found.eps:g} may be 1e-8 mistyped)",
        trial=Trial.untried(
            "read from the optimizer's second moment at the report: the share is sqrt(v) / (sqrt(v) + eps), computed, "
            "not run"
        ),
    )


def ungraded_finding(
    found: list[tuple[str, list[str]]],
    steps: tuple[int, ...],
    line: tuple[str, int, str],
    model: str,
    *,
    here: dict[str, Any],
) -> Finding:
    """TRN028: modules whose parameters the optimizer holds, requiring gradients, that got none at the
    sampled steps (numerics/observe/ungraded.py)."""
    names = [n for _, params in found for n in params]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    which = ", ".join(f"`{written(m)}`" for m, _ in found[:4]) + (", ..." if len(found) > 4 else "")
    at = ", ".join(str(s + 1) for s in steps[:-1]) + f" and {steps[-1] + 1}"
    stop = f" Line {line[1]} of {line[0]} (`{line[2]}`) runs it without gradients."
    module = written(found[0][0])
    return catalog.make(
        "parameters-without-gradient",
        message=(
            f"{len(names)} parameter(s) of {which} ({shown}) are held by the optimizer and require gradients, and "
            f"had none at its steps {at} while the rest of the model's "
            f"had: the backward never reaches them, and they stay as they were built.{stop}"
        ),
        where={"module": found[0][0], "op": None, "phase": "backward", **here},
        evidence={"modules": [m for m, _ in found], "parameters": names[:20], "steps": [s + 1 for s in steps]},
        fix=(
            f"remove what stops the gradients at line {line[1]} of {line[0]} (`{line[2]}`): run `{module}`'s forward "
            "with gradients (no torch.no_grad() or inference_mode around its call, no .detach() of its output); if it "
            f"is frozen on purpose, say so: {model}.{module}.requires_grad_(False)"
        ),
        trial=Trial.untried(
            "read from the gradients at the sampled steps: the no_grad or detach is the script's own code, which "
            "fpdoctor does not change in a running job"
        ),
    )


def zero_tail_finding(
    since: int, steps: int, scheduler: str | None, optimizer: str, *, here: dict[str, Any]
) -> Finding:
    """TRN023: every param group's rate reached 0 at step `since` and stayed there to the last step."""
    by = f"its {scheduler}" if scheduler else "its schedule"
    return catalog.make(
        "lr-zero-group",
        message=(
            f"Every param group of {optimizer} has had lr 0 since step {since} of {steps}: the last "
            f"{steps - since + 1} steps moved no weight, while the loss and gradients went on. "
            f"{by[0].upper() + by[1:]} ended at step {since}, "
            "before the run did: a schedule sized in epochs and stepped once per optimizer step, or sized for fewer "
            "steps than the run takes, ends there."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={"zero_since": since, "steps": steps, "scheduler": scheduler},
        fix=(
            f"size {by} to the run's optimizer steps ({steps} here; with Lightning, self.trainer."
            "estimated_stepping_batches), or step it at the interval it is sized in (interval='epoch')"
        ),
        trial=Trial.untried(
            "read from the optimizer's param groups at each step: the schedule is the script's, which fpdoctor "
            "does not change in a running job"
        ),
    )


def zero_grads_finding(
    found: ZeroGrads, hook: tuple[str, torch.dtype] | None, loss: float | None, optimizer: str, *,
    here: dict[str, Any], distributed: bool = True,
) -> Finding:  # fmt: skip
    """TRN031: every gradient the optimizer received was 0 at every sampled step (after DDP's all-reduce,
    or on one process, where the loss the script computed hands the model nothing)."""
    steps = ", ".join(str(s) for s in found.looked)
    size = f" (the last loss {'this rank saw' if distributed else 'seen'}: {loss:.3g})" if loss is not None else ""
    read = "the gradients after DDP's all-reduce" if distributed else "the gradients the backward left"
    finite = loss is None or math.isfinite(loss)
    message = (
        f"Every gradient {optimizer} received was exactly 0 at its steps {steps} ({read}, read at those steps), "
        + (
            f"while the loss was finite{size}: "
            if finite
            else f"and the loss was {loss} (the last {'this rank saw' if distributed else 'seen'}): "
        )
        + ("no step moved a weight." if distributed else "no gradient moved a weight.")
    )
    if not finite:  # a NaN loss over zero gradients: Inf / Inf forward, x / Inf = 0 backward
        message += (
            " A non-finite loss over gradients of exactly 0 is often a normaliser that overflowed to Inf dividing "
            "it: its backward, x / Inf, is 0 for every output"
            + (", and Inf / Inf is the NaN" if loss is not None and math.isnan(loss) else "")
            + "."
        )
    if not distributed:
        # one process, 16-bit compute: the backward itself made zeros, from the model's outputs on (watch's reference
        # step is replayed from the gradients there, so it sees zeros too). A loss switched off on purpose (a term
        # weighted 0 until a warm-up ends) does the same: a warning there, which says what to rule out
        zero = loss == 0.0
        message += (
            (" The loss itself is exactly 0" if zero else " The loss reaches the model's outputs as zero gradients")
            + (". Unless that is meant (a loss term weighted 0 until a warm-up ends), what" if zero else ": what")
            + " computes the loss from the outputs hands them no gradient: in 16-bit, a normaliser that overflowed to "
            "Inf dividing it (a count past float16's 65504), or a factor that underflowed to 0."
        )
        fix = (
            "find the line of the loss's computation that makes it "
            + ("0" if zero else "independent of the outputs")
            + ": `fpdoctor trace -- <your script>` follows it op by op and names an overflow an op turns into 0 "
            "(a count or sum past float16's 65504 in a division: sum it in fp32, .sum(dtype=torch.float32)) "
            "with its line"
        )
        return catalog.make(
            "gradients-all-zero",
            # a loss of 0 may be a term switched off on purpose; one that is not 0 yet reaches nothing is never meant
            severity=Severity.WARNING if zero else Severity.ERROR,
            message=message,
            where={"module": None, "op": None, "phase": "backward", **here},
            evidence={"steps_looked": found.looked, "steps_all_zero": found.zero, "comm_hook": None, "last_loss": loss},
            fix=fix,
            trial=Trial.untried(
                "watch sees the model's forward and backward, not the script's loss code, whose ops trace re-runs"
            ),
        )
    if hook is not None:
        name, dtype = hook
        fmt = str(dtype).removeprefix("torch.")
        message += (
            f" The DDP model's communication hook `{name}` casts each gradient bucket to {fmt} before the "
            f"all-reduce, and {fmt} rounds every value under {underflow(dtype):.3g} to 0: gradients made from a "
            "loss this small are all under it."
        )
        if found.local is not None:
            at, top, flushed, in_bf16 = found.local
            message += (
                f" Replayed on this rank without the reduction, step {at}'s local gradients reach {top:.3g} at most, "
                f"and the hook's cast makes {flushed:.0%} of their nonzero values 0 (bf16: {in_bf16:.0%})."
            )
        wider = (
            "bf16_compress_hook (fp32's range; it needs CUDA and NCCL) instead of"
            if dtype == torch.float16
            else "no hook instead of"
        )
        fix = (
            f"bring the gradients into {fmt}'s range: targets standardised or in units where the loss is of order "
            f"1 (a loss of 1e-8 makes gradients of about that size); or register {wider} `{name}`, or no hook "
            "(DDP's fp32 all-reduce)"
        )
    else:
        fix = (
            "find what zeroes the gradients between the backward and the optimizer: run the script on one process "
            "under `fpdoctor watch`, whose reference step names the stage where they part from an fp32 step"
        )
    if hook is not None and found.local is not None and hook[1] == torch.float16 and found.local[3] < found.local[2]:
        trial = Trial.checked(
            f"step {found.local[0]}'s local gradients (replayed on this rank without the reduction) cast to "
            "bfloat16, as bf16_compress_hook does, instead of float16",
            metric="share of their nonzero values made 0",
            before=f"{found.local[2]:.0%}",
            after=f"{found.local[3]:.0%}",
            on=f"step {found.local[0]}'s batch",
        )
    else:
        trial = Trial.untried(
            "under torch.distributed the gradients are reduced inside the backward: a run with another hook, or "
            "another loss, is another job, which fpdoctor does not start"
        )
    return catalog.make(
        "gradients-all-zero",
        message=message,
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={"steps_looked": found.looked, "steps_all_zero": found.zero, "comm_hook": hook[0] if hook else None,
                  "last_loss": loss,
                  **({"local_grad_absmax": found.local[1], "flushed_share": found.local[2],
                      "flushed_share_bf16": found.local[3]} if found.local else {})},
        fix=fix,
        trial=trial,
    )  # fmt: skip


def some_zero_grads_finding(
    names: list[str], hook: tuple[str, torch.dtype], optimizer: str, *, looked: list[int], here: dict[str, Any]
) -> Finding:
    """TRN031 for some layers only: their gradients reach the optimizer as zeros at every step looked at,
    behind a communication hook that casts the buckets to a narrower format, while the others' do not."""
    name, dtype = hook
    fmt = str(dtype).removeprefix("torch.")
    shown = ", ".join(f"`{n}`" for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    steps = ", ".join(str(s) for s in looked)
    return catalog.make(
        "gradients-all-zero",
        title=f"The gradients of {len(names)} parameter(s) reach {optimizer} as zeros: they never train",
        message=(
            f"At every optimizer step looked at ({steps}), {optimizer} received gradients of exact zeros for "
            f"{shown}, while the other parameters' were not zero. The DDP model's communication hook `{name}` "
            f"casts each gradient bucket to {fmt} before the all-reduce, and {fmt} rounds every value under "
            f"{underflow(dtype):.3g} to 0: these parameters' gradients are all under it (a loss term in small units, "
            "a head whose output is scaled down), so they never move; the run's loss may not show it."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={"parameters": names, "steps_looked": looked, "comm_hook": name},
        fix=(
            f"bring those gradients into {fmt}'s range (the loss term that trains them in units where it is of order "
            f"1, or its weight raised), or register no hook (DDP's fp32 all-reduce) instead of `{name}`"
            + ("; bf16_compress_hook has fp32's range but needs CUDA and NCCL" if dtype == torch.float16 else "")
        ),
        trial=Trial.untried(
            "under torch.distributed the gradients are reduced inside the backward: a run with another hook is "
            "another job, which fpdoctor does not start"
        ),
    )


def stale_casts_finding(found: Stale, optimizer: str, *, here: dict[str, Any]) -> Finding:
    """TRN030: an autocast block open across optimizer steps (numerics/observe/autocast_cache.py)."""
    how = found.block[3] if found.block is not None else None
    if found.block is not None:
        path, line, text, _ = found.block
        at = f"{os.path.basename(path)}:{line}"
        block = {
            "decorator": f"the `{text}` decorator at {at}",
            "enter_context": f"the autocast entered by `{text}` at {at}",
        }.get(how or "", f"the `{text}` block at {at}")
        where_block = f"{path}:{line}"
    else:
        block, where_block = "an autocast block", None
    if how == "decorator":
        fix = (
            f"take {block} off its function: it holds the whole function, the optimizer's steps included; wrap the "
            "forward and the loss in `with torch.autocast(...):` inside the loop instead, with `loss.backward()` and "
            "`optimizer.step()` after it (or pass `cache_enabled=False` to that decorator, which casts the weights "
            "afresh at every use)"
        )
    elif how == "enter_context":
        fix = (
            f"{block} stays on until the stack closes: enter autocast once per step, around the forward and the loss "
            "only (`with torch.autocast(...):` inside the loop), with `loss.backward()` and `optimizer.step()` after "
            "it (or pass `cache_enabled=False` to that torch.autocast, which casts the weights afresh at every use)"
        )
    else:
        fix = (
            f"end the autocast block before the backward: move {block} inside the loop, around the forward and the "
            "loss only, with `loss.backward()` and `optimizer.step()` after it (or pass `cache_enabled=False` to "
            "that torch.autocast, which casts the weights afresh at every use)"
        )
    cost = (
        f" Step {found.measured_at}'s forward ran the weights as they were cast then: its outputs differ by "
        f"{found.difference:.3g} (relative) from the same forward with the weights as they are."
        if found.difference is not None
        else ""
    )
    trial = (
        Trial.checked(
            f"step {found.measured_at}'s forward run again with the weights cast afresh (autocast with "
            "cache_enabled=False, what a block ending before the step gives), on its own inputs, RNG and buffers",
            metric="outputs' relative difference from the weights as they are",
            before=round(found.difference, 4),
            after=0.0,
            on=f"step {found.measured_at}'s batch",
        )
        if found.difference is not None
        else Trial.untried(
            "read from autocast's cast cache by a probe of fpdoctor's own; the steps' forwards run again with the "
            "weights cast afresh gave the same outputs (no weight had moved yet: skipped steps, an lr of 0) or could "
            "not be run as they ran (an input or output written in place since)"
        )
    )
    return catalog.make(
        "autocast-spans-steps",
        message=(
            f"{optimizer}'s steps run inside {block}, which stays open from one step to the next: a tensor cast "
            f"under it at step {found.since} came back from autocast's cast cache unchanged at step {found.step}. "
            f"Autocast casts each fp32 weight to {found.dtype} once and reuses that copy until the outermost "
            "autocast block exits, so every forward after the first runs the weights as they were cast at the "
            f"first.{cost} The optimizer moves the fp32 weights; the forward never sees them, so the loss stays where "
            "it was."
        ),
        where={"module": None, "op": None, "phase": "forward", "line": where_block, **here},
        evidence={
            "step": found.step,
            "cast_at_step": found.since,
            "outputs_relative_difference": found.difference,
            "device_type": found.device_type,
            "dtype": found.dtype,
        },
        fix=fix,
        trial=trial,
    )


def scaler_rebuilt_finding(found: Scalers, skipped: int, optimizer: str, *, here: dict[str, Any]) -> Finding:
    """TRN029: a GradScaler made anew for most steps (numerics/observe/scaler_rebuilt.py)."""
    start = f" at its init scale ({found.init_scale:g})" if found.init_scale is not None else ""
    return catalog.make(
        "grad-scaler-rebuilt",
        message=(
            f"{optimizer} was stepped by a new GradScaler on {found.new} of its {found.steps} scaled steps: each "
            f"started{start} and was thrown away, so the scale never came down to where the gradients fit, and "
            f"{skipped} of the {found.steps} steps were skipped by it. The overflows are its scale's, not the "
            "model's: a scaler kept across steps halves its scale after each and settles."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={"scalers": found.new, "steps": found.steps, "skipped_steps": skipped, "init_scale": found.init_scale},
        fix="build the GradScaler once, before the training loop (not inside the step or epoch function), and "
        "step every optimizer step with that one",
        trial=Trial.untried(
            "read from which GradScaler stepped the optimizer at each step: where the scaler is made is the "
            "script's code, which fpdoctor does not change in a running job"
        ),
    )


def frozen_group_finding(
    groups: list[tuple[int, list[str]]], steps: int, schedules: dict[int, Schedule], *, here: dict[str, Any]
) -> Finding:
    """TRN023: param groups whose lr stayed 0 while another group's did not: their parameters get
    gradients (they require them) and never move. `schedules`: per group, the scheduler whose factor is
    0 where the group was built with a rate."""
    count = sum(len(names) for _, names in groups)
    which = "; ".join(
        f"group {k} ({len(names)} parameter(s): {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for k, names in groups
    )
    return catalog.make(
        "lr-zero-group",
        message=(
            f"{which} had lr 0 at the first step and at the last ({steps} steps) while another group's was not: "
            f"its {count} parameter(s) require gradients, get them every step, and never move."
        ),
        where={"module": None, "op": None, "phase": "optimizer", **here},
        evidence={
            "groups": [k for k, _ in groups],
            "parameters": [n for _, names in groups for n in names][:20],
            "count": count,
            "steps": steps,
        },
        fix=_zero_lr_fix(schedules),
        trial=Trial.untried(
            "read from the optimizer's param groups at the first and the last step: a learning rate is the "
            "script's choice, which fpdoctor does not change in a running job"
        ),
    )


# the GradScaler findings of a run's first steps are calibration where the last SETTLED steps all applied and
# most of the run did: the scale went down to where the gradients fit (below 1 for gradients in large units)
SETTLED = 100
_SETTLING = ("amp-scale-collapse", "training-stalled", "deterministic-nonfinite")


def settled(found: list[Finding], history: list[Any], scale: float | None) -> list[Finding]:
    """The scaler's early findings read again once the run is over: where its scale settled (the last
    SETTLED steps applied, nine in ten of all of them) those that only named steps before that are the
    scale calibrating down, said as information, with the scale it settled at."""
    if len(history) < 2 * SETTLED or scale is None:
        return found
    # a NaN made from finite values (sqrt's backward at 0) is a bug at any scale: nothing was calibration
    if any("nan" in str(f.evidence.get("kind", "")).lower() for f in found if f.name in _SETTLING):
        return found
    tail = history[-SETTLED:]
    applied = sum(1 for h in history if not h.skipped)
    if any(h.skipped or not h.finite for h in tail) or applied < 0.9 * len(history):
        return found
    start = tail[0].step
    out = []
    for f in found:
        steps = [f.evidence.get("step"), f.evidence.get("last_step")]
        early = all(s is None or (isinstance(s, int) and s < start) for s in steps) and f.evidence.get("step")
        if f.name in _SETTLING and early and f.severity != Severity.INFO:
            note = (
                f" Afterwards the scale settled at {scale:.3g} and the last {SETTLED} of the {len(history)} steps "
                f"were all applied ({applied} in all): the scaler calibrating down to where the gradients fit fp16, "
                "not a stall."
                + (
                    " Below 1 it says the gradients themselves pass fp16's range unscaled: a loss or targets in "
                    "large units (standardise them) keep the scale there."
                    if scale < 1
                    else ""
                )
            )
            title = f"Early in the run, then the scale settled at {scale:.3g}: {f.title[0].lower()}{f.title[1:]}"
            out.append(dataclasses.replace(f, severity=Severity.INFO, title=title, message=f.message + note))
        else:
            out.append(f)
    return out


def timeline(history: list[Any], found: list[Finding], points: int) -> dict[str, list[Any]]:
    """Loss per step for plots, at most `points` of them (evenly thinned) plus every step that
    was non-finite, skipped by AMP or a spike, so that no event is thinned away; beside the loss,
    the gradient norm where it was taken and GradScaler's scale where there is one."""
    spikes = {f.evidence.get("step") for f in found if f.name == "loss-spike"}
    stride = max(1, math.ceil(len(history) / points))
    kept = [h for i, h in enumerate(history) if i % stride == 0 or not h.finite or h.step in spikes]
    out: dict[str, list[Any]] = {
        "step": [h.step for h in kept],
        "loss": [h.loss for h in kept],
        "nonfinite": [h.step for h in history if not h.finite and h.verdict != "amp-skip"],
        "amp_skipped": [h.step for h in history if h.verdict == "amp-skip"],
        "spikes": sorted(s for s in spikes if isinstance(s, int)),
    }
    normed = [h for h in history if getattr(h, "grad_norm", None) is not None]
    normed = normed[:: max(1, math.ceil(len(normed) / points))]
    if normed:
        out["grad_norm_step"] = [h.step for h in normed]
        out["grad_norm"] = [h.grad_norm for h in normed]
    if any(getattr(h, "scale", None) is not None for h in kept):
        out["scale"] = [h.scale for h in kept]
    return out


def stall_finding(
    *,
    steps: int,
    window: list[Any],
    first_skip: int,
    last_good: int | None,
    found: list[Finding],
    here: dict[str, Any],
    lr_trial: LrTrial | None = None,
    climbing: bool = False,
    run: tuple[int, int] | None = None,
) -> Finding:
    """training-stalled: most recent steps skipped, and the cause the run's other findings point to.
    `window`: the episode's StepOutcomes; `found`: the run's findings so far; `lr_trial`: a lower
    learning rate tried from the climb's first step, where the evidence points at the rate;
    `climbing`: the loss was still up from its climb at the last finite step (then the stall leads the
    verdicts it explains); `run`: the steps skipped in the whole run and the first of them, said where
    the run skipped more than this episode (a stall from step 37 in a run that skipped from step 4 on)."""
    skipped = [h for h in window if h.skipped]
    amp_skips = sum(1 for h in skipped if h.verdict == "amp-skip")
    never = last_good is None
    applied = [h for h in window if not (h.finite or h.skipped)]  # a non-finite loss, finite gradients
    if applied and not skipped:
        head = (
            f"The loss was non-finite on {len(applied)} of the last {len(window)} optimizer steps (steps "
            f"{window[0].step}-{window[-1].step}, first at step {first_skip}), each applied as your code applies it "
            "(its gradients were finite)"
        )
        head += ": no step was finite." if never else f": the last finite step was step {last_good}."
    else:
        if skipped and amp_skips == len(skipped):
            head = f"GradScaler skipped {len(skipped)} of {len(window)} optimizer steps"
        else:
            head = f"{len(skipped)} of the last {len(window)} optimizer steps were skipped"
            if amp_skips:
                head += f" ({amp_skips} by the GradScaler for overflow)"
        head += f" (steps {window[0].step}-{window[-1].step}, first skip at step {first_skip}"
        if run is not None and run[0] > len(skipped):
            head += f"; {run[0]} of the run's {steps} steps were skipped, the first at step {run[1]}"
        head += ")"
        head += ": the optimizer never ran." if never else f": the last step applied was step {last_good}."
    cause, fix, trial = _stall_cause(first_skip, found, lr_trial)
    climb = climbed_before(first_skip, found)
    return catalog.make(
        "training-stalled",
        message=f"{head} {cause}",
        where={"module": None, "op": None, "phase": "optimizer", "step": first_skip, **here},
        evidence={
            "kind": "skipped" if skipped or not applied else "nonfinite-applied",
            "count": len(skipped) or len(applied),
            "numel": len(window),
            "step": first_skip,
            "steps": steps,
            "amp_skips": amp_skips,
            "last_good_step": last_good,
            **({"lr_tried": lr_trial.evidence()} if lr_trial is not None else {}),
            **({"climbed_at_step": climb.evidence.get("step")} if climb is not None and climbing else {}),
        },
        fix=fix,
        trial=trial,
    )


def _spikes_before(first_skip: int, found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.name == "loss-spike" and f.evidence.get("step", first_skip) < first_skip]


def climbed_before(step: int, found: list[Finding]) -> Finding | None:
    """The last loss spike before `step`: the climb a later non-finite step follows."""
    spikes = _spikes_before(step, found)
    return spikes[-1] if spikes else None


def learning_rate_points(first_skip: int, found: list[Finding]) -> bool:
    """The evidence points a stall at the learning rate: the loss climbed before the first skip."""
    return bool(_spikes_before(first_skip, found))


def _stall_cause(
    first_skip: int, found: list[Finding], lr_trial: LrTrial | None = None
) -> tuple[str, str | None, Trial | None]:
    """What the evidence supports, in this order: a loss that climbed before the first skip, an op whose
    fp32 control replay was finite, an op that reproduces, a fault that did not, the scaler's collapse."""
    spikes = _spikes_before(first_skip, found)
    if spikes:
        spike = spikes[-1]
        ev = spike.evidence
        top = ev.get("last_step", ev.get("step"))
        cause = (
            f"The loss climbed before the first skip (loss-spike at step {ev.get('step')}"
            + (f" to {top}" if top != ev.get("step") else "")
            + f", {ev.get('loss', math.nan):.4g} against a mean of {ev.get('mean', math.nan):.4g}): the updates "
            "drove the weights out of range - a learning rate too high for this model (or a bad batch), not the "
            "precision."
        )
        return cause + (lr_trial.text() if lr_trial is not None else ""), _lr_fix(lr_trial), _lr_trial(lr_trial)
    by_name = {f.name: f for f in reversed(found)}  # the first of each name
    det = by_name.get("deterministic-nonfinite")
    if det is not None:
        where = det.where
        module = f"`{where.get('module')}`" if where.get("module") else "the root module"
        op = f"{where.get('op')} in {module}" if where.get("op") else None
        if op is None:  # the replay of the model named no op: said as it is, not as a cause named
            return (
                "Every replay makes it again from the same batch (see deterministic-nonfinite, which names no op "
                "in the model: the value is made after it, in the loss or its backward).",
                det.fix or None,
                det.trial,
            )
        if det.evidence.get("control_fp32") == "finite":
            return (
                f"Every replay names the same cause, {op}, and its fp32 control replay is finite: the precision of "
                "that op stops training (see deterministic-nonfinite).",
                det.fix or None,
                det.trial,
            )
        return (f"Every replay names the same cause, {op} (see deterministic-nonfinite).", det.fix or None, det.trial)
    if "transient-fault-suspected" in by_name:
        told = by_name["transient-fault-suspected"]
        cause = told.evidence.get("cause", "undecided")
        said = {
            "machine": "the machine",
            "race": "a race",
            "uninitialised-read": "an uninitialised read",
            "nondeterministic-kernel": "a nondeterministic kernel",
        }.get(cause, "the machine, a race, an uninitialised read or a nondeterministic kernel (undecided)")
        return (
            f"The bad steps did not reproduce on replay: {said} (see transient-fault-suspected).",
            told.fix if cause != "machine" else None,
            told.trial,
        )
    if "amp-scale-collapse" in by_name:
        collapse = by_name["amp-scale-collapse"]
        return (
            "The scale collapsed: the gradients overflow fp16 even unscaled (see amp-scale-collapse).",
            collapse.fix or None,
            collapse.trial,
        )
    return ("", None, None)


def _lr_trial(trial: LrTrial | None) -> Trial:
    """What `_lr_fix`'s advice was checked with: a lower rate that settled where the run's did not."""
    if trial is None or trial.as_is is None:
        return Trial.untried(trial.why_not if trial is not None and trial.why_not else "no learning-rate trial ran")
    best = trial.best
    if best is not None and not trial.as_is.settles:
        return Trial.checked(
            f"lr {trial.as_is.lr:.4g} -> {best.lr:.4g}",
            metric=f"the {'loss' if best.loss_seen else 'gradients'} over {trial.steps} steps",
            before=trial.as_is.said(),
            after=best.said(),
            on=f"copies of {trial.start}, on its batch",
        )
    return Trial.untried(
        "lowering the learning rate was tried and did not separate the rates (see the message); the advice "
        "left is what the trial could not test"
    )


def _lr_fix(trial: LrTrial | None) -> str:
    """The learning-rate advice with what trying it gave: never a tried rate that did not help as the fix."""
    rest = "and clip gradients (torch.nn.utils.clip_grad_norm_); resume from a checkpoint before the climb."
    if trial is None or trial.as_is is None:
        reason = f" (not tried: {trial.why_not})" if trial is not None and trial.why_not else ""
        return f"Lower the learning rate (or add warm-up){reason}, {rest}"
    as_is, best = trial.as_is, trial.best
    if best is not None and not as_is.settles:
        lower = (
            trial.schedule.fix(best.lr) + ","
            if trial.schedule is not None
            else f"Lower the learning rate to {best.lr:.4g} or below (the run's {as_is.lr:.4g} / "
            f"{as_is.lr / best.lr:g}),"
        )
        return (
            f"{lower} {rest} Checked: from {trial.origin}, {trial.steps} steps at "
            f"{best.lr:.4g} {best.said()}; at {as_is.lr:.4g} they {as_is.said()}."
        )
    if best is not None:
        return (
            f"Lower the learning rate (or add warm-up), {rest} Tried: from {trial.origin}, {trial.steps} steps on "
            f"its batch settle at the run's {as_is.lr:.4g} as well as at "
            f"{best.lr:.4g}, so the trial does not show the rate alone is the cause."
        )
    tried = ", ".join(f"{a.lr:.4g}" for a in trial.lowered)
    return (
        "Resume from a checkpoint before the climb and look at the batches of the climb (a bad batch), with "
        f"gradient clipping (torch.nn.utils.clip_grad_norm_) and warm-up. Tried: learning rates of {tried} from "
        f"{trial.origin} did not keep the steps finite with a loss that did not climb, so "
        "lowering it alone is not the fix."
    )
