"""The update findings: updates rounded away, optimizer states or gradients that stopped moving
(data in, Finding out; the judge in `judge.py` decides when each is made)."""

from __future__ import annotations

from typing import Any

from fpdoctor import catalog
from fpdoctor.numerics.updates.measure import ParamUpdate, StateUpdate, UpdateStats
from fpdoctor.numerics.updates.whatif import WhatIf, master_weights_code, stochastic_rounding_hint
from fpdoctor.report.model import Finding, Severity, Trial


def _module_of(parameter: str) -> str | None:
    return parameter.rsplit(".", 1)[0] if "." in parameter else None


def _tried_text(tried: WhatIf | None, untried: str) -> tuple[str, dict[str, Any]]:
    if tried is None:
        return f" The fix was not tried (no what-if run: {untried}).", {"what_if": {"tried": False, "why_not": untried}}
    evidence = {
        "what_if": {
            "tried": tried.error is None,
            "steps": tried.steps,
            "loss_as_is": tried.loss_as_is,
            "loss_fp32_master": tried.loss_fixed,
            "moved_as_is": tried.moved_as_is,
            "moved_fp32_master": tried.moved_fixed,
            "seconds": tried.seconds,
            **({"error": tried.error} if tried.error else {}),
        }
    }
    if tried.error is not None:
        return f" The what-if run with fp32 master weights failed ({tried.error}); the fix is untried.", evidence
    loss = (
        f"{tried.loss_is} after {tried.steps} steps on this step's batch was {tried.loss_fixed:.4g} against "
        f"{tried.loss_as_is:.4g} as it is (the loss backward() got on that batch, as the script scales it: under "
        "gradient accumulation one micro-batch's share, not the printed total)"
        if tried.loss_known
        else f"over {tried.steps} steps on this step's batch (its loss is not known here: the step was run from "
        "the gradients at the model's outputs, without the loss function)"
    )
    text = (
        f"with fp32 master weights, {tried.moved_fixed:.0%} of the master weights moved per step of the what-if, "
        f"which repeats this step's batch (the low-precision weights as it is: {tried.moved_as_is:.0%} there, where "
        "an adaptive optimizer's steps on a batch seen again grow: the run's own share is the one above) and "
        f"{loss}"
    )
    if tried.helped:
        return f" Tried: {text} (checked, {tried.seconds:.2g} s, on copies).", evidence
    if tried.immaterial:
        fall = (tried.loss_as_is - tried.loss_fixed) / abs(tried.loss_as_is) if tried.loss_as_is else 0.0
        return (
            f" Tried: {text}, {fall:.2%} lower, within the batch's noise over {tried.steps} steps: too few to tell "
            f"what {1 - tried.moved_as_is:.0%} of the weights standing still each step costs over a run (the "
            "progress check and the reference step judge the run itself).",
            evidence,
        )
    return f" Tried, and it did not help here: {text}.", evidence


def framework_switch(framework: str | None, dtype: str) -> str | None:
    """Where a framework steps the optimizer, its own switch for what the master-weights fix keeps (the
    weights and the optimizer state in fp32), computing in the weights' 16-bit format under autocast."""
    half = dtype in ("float16", "torch.float16", "fp16")
    name = "float16" if half else "bfloat16"
    kept = (
        "its weights and the optimizer's state in fp32, as the master-weights fix below keeps them, the forward in "
        "16 bits under autocast"
    )
    if framework == "transformers":
        return (
            f"in the Trainer: the model loaded in fp32 (no torch_dtype=torch.{name} in from_pretrained, no "
            f".to(torch.{name})) and TrainingArguments({'fp16' if half else 'bf16'}=True): {kept} (the Trainer calls "
            "optimizer.step() itself: the code below goes in an optimizer of your own, passed as "
            "Trainer(optimizers=(optimizer, None)))"
        )
    if framework == "lightning":
        mixed, true = ("16-mixed", "16-true") if half else ("bf16-mixed", "bf16-true")
        return (
            f'in Lightning: the module in fp32 (no .to(torch.{name}), no precision="{true}") and '
            f'Trainer(precision="{mixed}"): {kept} (Lightning calls optimizer.step() itself: the code below goes in '
            "configure_optimizers' optimizer, as an optimizer of your own)"
        )
    return None


# torch-optimi's optimizers, each with kahan_sum for bf16 weights (optimi's documentation)
OPTIMI = frozenset({"SGD", "Adam", "AdamW", "RAdam", "Adan", "Lion", "Ranger", "StableAdamW"})


def rounded_away_finding(
    stats: UpdateStats,
    affected: list[ParamUpdate],
    tried: WhatIf | None,
    optimizer: Any,
    *,
    here: dict[str, Any],
    why_untried: str = "what_if_steps=0",
    framework: str | None = None,
) -> Finding:
    """update-rounded-away: the parameters whose updates the dtype rounds away, the spacing against the
    update, weight decay apart, and the fix - tried by the what-if run where there was one. `framework`:
    the one that calls optimizer.step() (the code in place of it cannot go there): its own switch first."""

    dtype = affected[0].dtype
    listed = ", ".join(f"{p.name} {p.rounded_share:.0%} ({p.numel} elements)" for p in affected[:6])
    more = f" and {len(affected) - 6} more" if len(affected) > 6 else ""
    lost = sum(p.numel for p in affected)
    total = sum(p.numel for p in stats.params)
    worst = affected[0]
    decay = [p.decay_lost_share for p in affected if p.decay_lost_share is not None]
    decay_text = (
        f" Weight decay alone (lr*wd*|w|) is below half the spacing for {max(decay):.0%} of the sampled weights: "
        "it is lost entirely."
        if decay and max(decay) > 0
        else ""
    )
    tried_text, tried_ev = _tried_text(tried, why_untried)
    message = (
        f"Step {stats.step}: the optimizer's updates were rounded away in {dtype}: {listed}{more} of the sampled "
        f"non-zero updates left the weight bit for bit as it was ({lost} of the {total} low-precision weights). "
        f"The typical update of {worst.name} is {worst.typical_ratio:.2g}x the {dtype} spacing at its weights "
        f"(it must reach 0.5x to move them); its update-to-weight ratio is {worst.update_to_weight:.2g} "
        f"({stats.optimizer}, lr {stats.hyper.get('lr')}).{decay_text}{tried_text}"
    )
    helped = tried is not None and tried.helped
    # a what-if too short to tell (the loss within the batch's noise) leaves the fix untried, not refuted
    untried = tried is None or tried.error is not None or tried.immaterial
    master = (
        "fp32 master weights (+4 bytes per parameter, and the optimizer state in fp32), for your "
        f"{stats.optimizer}:\n{master_weights_code(optimizer)}"
    )
    half = str(dtype) in ("float16", "torch.float16")
    low, name = ("fp16", "float16") if half else ("bf16", "bfloat16")
    others = [
        f"keep the model in fp32 and compute in {low} under torch.autocast(device_type, dtype=torch.{name}) "
        f"around the forward{' with a torch.amp.GradScaler' if half else ''} (+2 bytes per parameter over {low} "
        f"weights, the state in fp32; activations stay {low})",
    ]
    if not half:  # both keep bf16 weights (torchao's stochastic rounding and optimi's Kahan sums are bf16's)
        kind = type(optimizer).__name__
        others += [
            f"stochastic rounding: {stochastic_rounding_hint(optimizer)} (no extra memory)",
            f"Kahan summation: torch-optimi's optimi.{kind if kind in OPTIMI else 'AdamW'}(params, ..., "
            "kahan_sum=True) (+2 bytes per parameter)",
        ]
    ranked = [master, *others] if helped or untried else others
    switch = framework_switch(framework, str(dtype))
    if switch is not None and (helped or untried):  # the framework's own form of fp32 weights and state
        ranked = [switch, *ranked]
    trial = (
        Trial.checked(
            "fp32 master weights",
            metric="the share of weights an update moves",
            before=f"{tried.moved_as_is:.0%}",
            after=f"{tried.moved_fixed:.0%}",
            on=f"{tried.steps} steps on this step's batch, on copies",
        )
        if helped and tried is not None
        else Trial.untried(
            f"the what-if run did not run ({why_untried})"
            if tried is None
            else f"the what-if run failed ({tried.error})"
            if tried.error is not None
            else f"the what-if run's {tried.steps} steps could not tell (the loss within the batch's noise: see the "
            "message)"
            if tried.immaterial
            else "fp32 master weights were tried and did not help (see the message); the others are not tried"
        )
    )
    fix = "\n".join(f"{i}. {text}" for i, text in enumerate(ranked, start=1))
    if not (helped or untried):
        fix += "\n(fp32 master weights were tried by the what-if run and did not help: see the message.)"
    groups = getattr(optimizer, "param_groups", None) or []
    decays = any(float(g.get("weight_decay") or 0.0) for g in groups if isinstance(g, dict))
    fix += (
        "\nNot a larger learning rate: the update must clear half the spacing of the largest weights, which makes "
        "it too large for the small ones and for the directions that were moving"
        + (f"; and lr*wd stays below {dtype}'s relative spacing, so weight decay is still lost." if decays else ".")
    )
    return catalog.make(
        "update-rounded-away",
        message=message,
        fix=fix,
        trial=trial,
        # measured as no loss gained: information, not a warning on a run that matches its fp32 copy
        severity=Severity.INFO if tried is not None and tried.immaterial else None,
        where={"module": _module_of(worst.name), "op": None, "phase": "optimizer", "step": stats.step, **here},
        evidence={
            "kind": "rounded-away",
            "count": sum(p.rounded for p in affected),
            "numel": sum(p.intended for p in affected),
            "dtype": dtype,
            "step": stats.step,
            "optimizer": stats.optimizer,
            "parameters": [
                {
                    "name": p.name,
                    "numel": p.numel,
                    "sampled": p.sampled,
                    "rounded_share": p.rounded_share,
                    "update_over_spacing": p.typical_ratio,
                    "update_to_weight": p.update_to_weight,
                    **({"decay_lost_share": p.decay_lost_share} if p.decay_lost_share is not None else {}),
                }
                for p in affected[:20]
            ],
            **tried_ev,
        },
    )


def state_stalled_finding(stats: UpdateStats, state: StateUpdate, *, here: dict[str, Any]) -> Finding:
    """accumulation-stalled for a low-precision optimizer state (exp_avg_sq in bf16)."""
    return catalog.make(
        "accumulation-stalled",
        message=(
            f"Step {stats.step}: {stats.optimizer}'s {state.key} is kept in {state.dtype}, and of the sampled elements "
            f"the step changed in fp32, {state.stalled / state.changed:.0%} stayed bit for bit as they were and "
            f"{state.flushed / state.changed:.0%} flushed to zero ({', '.join(state.parameters[:4])}"
            f"{' ...' if len(state.parameters) > 4 else ''}): the state no longer follows the gradients."
        ),
        where={
            "module": _module_of(state.parameters[0]),
            "op": None,
            "phase": "optimizer",
            "step": stats.step,
            **here,
        },
        evidence={
            "kind": "optimizer-state",
            "state": state.key,
            "count": state.stalled + state.flushed,
            "numel": state.changed,
            "dtype": state.dtype,
            "step": stats.step,
            "parameters": state.parameters[:20],
        },
        fix="Keep the optimizer state in fp32: fp32 master weights (the optimizer over fp32 copies of the "
        "parameters, its state then fp32: +4 bytes per parameter for the copy, +2 per state tensor), or the model in "
        "fp32 under torch.autocast.",
        trial=Trial.checked(
            f"the step's {state.key} update computed in fp32",
            metric=f"the share of changed elements the {state.dtype} state kept",
            before=f"{1 - (state.stalled + state.flushed) / state.changed:.0%}",
            after="100%",
            on="the sampled elements of this step",
        ),
    )


def grads_stalled_finding(
    stats: UpdateStats, rows: list[tuple[str, str, int, float, float]], *, here: dict[str, Any]
) -> Finding:
    """accumulation-stalled for gradients accumulated over micro-batches in a low-precision .grad."""
    name, dtype, adds, _, held = rows[0]
    listed = ", ".join(f"{n} {e:.0%} off" for n, _, _, e, _ in rows[:4])
    return catalog.make(
        "accumulation-stalled",
        message=(
            f"Step {stats.step}: the gradients accumulated over {adds} micro-batches in {dtype} .grad are short of "
            f"what an fp32 sum of the same micro-batch gradients holds: {listed} (on a sample; the {dtype} sum of "
            f"{name} is {held:.0%} of the fp32 one): once the sum is ~256x a micro-batch's gradient, bf16 adds "
            "nothing more."
        ),
        where={"module": _module_of(name), "op": None, "phase": "backward", "step": stats.step, **here},
        evidence={
            "kind": "gradient-accumulation",
            "count": len(rows),
            "numel": len(stats.grads),
            "dtype": dtype,
            "step": stats.step,
            "micro_batches": adds,
            "parameters": [{"name": n, "relative_error": e, "held_over_fp32": h} for n, _, _, e, h in rows[:20]],
        },
        fix="Accumulate in fp32: after each micro-batch's backward, add p.grad.float() into an fp32 buffer per "
        "parameter and set p.grad = None (+4 bytes per parameter), and step on the buffers; or fp32 master weights, "
        "whose .grad is fp32.",
        trial=Trial.checked(
            f"the same {adds} micro-batch gradients summed in fp32",
            metric=f"{name}'s accumulated gradient, relative error",
            before=rows[0][3],
            after=0.0,
            on="the sampled elements of this step's micro-batches",
        ),
    )
