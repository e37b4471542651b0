"""The model's own code around its submodules, where it loses more than its submodules do.

A sampler around a denoiser, a rollout around a learned step, a scheduler around a network: the
model's forward computes a schedule, a running state and their updates itself and calls a
submodule in between. In bf16 its own ops can lose far more than their floor (a cumulative product
of 1 - beta, each factor rounded near 1; a state rounded on every step) while the end-to-end error
grows less than the DIVERGENCE_RATIO a divergence takes over what came in: the submodules' own
error is of the same order, and no single line's fix in fp32 (compare.forced) takes it away, as
the schedule and the state each lose part of it. No rule names it, and compare said OK.

The experiment is the fix the field uses (diffusers' schedulers compute in fp32 around a bf16
UNet): every op of the model's own forward in fp32, on its inputs as given and with its buffers in
fp32, its submodules as the candidate runs them (their inputs cast to its dtype, their outputs back
to fp32). One forward. Where it divides the end-to-end error by OWN_FALLS or more, the own code is a
cause and the finding says by how much; what is left is the submodules' own error.
"""

from __future__ import annotations

import inspect

from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.candidates import plain_fp32
from fpdoctor.precision.profile import DIVERGENCE_RATIO
from fpdoctor.report.model import Finding, Severity, Trial

# The model's own ops in fp32 are a cause where they take the end-to-end error down this much (6 dB):
# a sampler's schedule and state in fp32 around its trained bf16 denoiser, 0.0184 -> 0.0070 (a warning) ...
OWN_FALLS = 2.0
# ... and the cause where they take it down this much (12 dB, profile.RAISED_FALLS, as a line's fix
# confirms a divergence): around an untrained denoiser of small error, 0.0149 -> 0.00019 (an error)
OWN_CURES = 4.0


def span(model: nn.Module) -> str:
    """Where the model's forward is written ("lines 50-61 of ddim.py (DDIMSampler.forward)"), or its
    class's name where the source cannot be read."""
    forward = inspect.unwrap(type(model).forward)  # under @torch.no_grad(), the function it wraps
    name = f"{type(model).__name__}.forward"
    try:
        source, first = inspect.getsourcelines(forward)
        file = inspect.getsourcefile(forward)
    except (OSError, TypeError):
        return f"`{name}`"
    return f"lines {first}-{first + len(source) - 1} of {file} ({name})"


def finding(
    model: nn.Module, *, fmt: str, dtype: str, before: float, after: float, floor: float, op: str,
    location: str | None, ratio: float, grew: str, on: str,
) -> Finding:  # fmt: skip
    """`precision-divergence`: the model's own ops in `fmt` add to the error what their fp32
    computation takes away (`before` -> `after`, checked), beside its submodules' own error; an error
    where that takes it down OWN_CURES times, a warning where the submodules keep more of it."""
    children = [name for name, _ in model.named_children()]
    subs = ", ".join(f"`{c}`" for c in children[:4]) + (f" and {len(children) - 4} more" if len(children) > 4 else "")
    buffers = [n for n, b in model.named_buffers(recurse=False) if b.is_floating_point()]
    where = f" ({location})" if location else ""
    message = (
        f"In {fmt}, the model's own ops (what its forward computes around {subs}) lose precision: the worst, "
        f"{op}{where}, run alone in {fmt} is {ratio:.3g}x its noise floor, and in the candidate's run the "
        f"model's output error is {grew} what came in, short of the {DIVERGENCE_RATIO:g}x a divergence takes. "
        f"Computed in fp32, with {subs} still in {fmt}, they take the end-to-end error from {before:.3g} to "
        f"{after:.3g} (rounding the exact output to {fmt}: {floor:.3g}): what is left is the {fmt} error of {subs} "
        f"{'themselves' if len(children) > 1 else 'itself'}."
    )
    kept = (
        f"; its buffer{'s' if len(buffers) > 1 else ''} {', '.join(f'`{b}`' for b in buffers)} kept in fp32 "
        f"across the model's cast ({plain_fp32(buffers)})"
        if buffers
        else ""
    )
    fix = (
        f"Compute the model's own ops in fp32 and only {subs} in {fmt}, as the check ran it: in {span(model)}, "
        f"its inputs and every value it carries from step to step in fp32 (.float()){kept}; call {subs} on "
        f"{'their inputs' if len(children) > 1 else 'its input'} cast to {dtype} (.to(p.dtype), p a parameter of "
        f"{'each' if len(children) > 1 else 'it'}) and take {'their outputs' if len(children) > 1 else 'its output'} "
        f"back .float(). Checked: the end-to-end error goes from {before:.3g} to {after:.3g}; then `fpdoctor "
        "compare --inputs-as-given` checks the changed model fed its inputs as they are"
    )
    return catalog.make(
        "precision-divergence",
        title=f"The model's own ops in {fmt} add to the error what fp32 takes away",
        message=message,
        severity=Severity.ERROR if after * OWN_CURES <= before else Severity.WARNING,
        where={"module": None, "op": op, "phase": "forward"},
        evidence={
            "kind": "own-code",
            "own_op": op,
            "own_op_location": location,
            "isolated_ratio": ratio,
            "propagated_rel": before,
            "own_in_fp32_rel": after,
            "floor_rel": floor,
            "submodules": children,
            "buffers_kept": buffers,
        },
        fix=fix,
        trial=Trial.checked(
            f"the model's own ops in fp32 on its inputs as given, {subs} in {fmt}",
            metric="end-to-end error",
            before=before,
            after=after,
            on=on,
        ),
    )


def reason(before: float, after: float | None) -> str:
    """The note where the check ran and the own code is not the cause."""
    if after is None:
        return "the model's own ops in fp32 (its submodules as the candidate runs them) could not be run"
    return (
        f"the model's own ops in fp32 (its submodules as the candidate runs them) leave the end-to-end error at "
        f"{after:.3g} (from {before:.3g}): not the cause"
    )
