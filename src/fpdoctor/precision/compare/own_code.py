"""The model's own code around its submodules, where it loses more than its submodules do.

A sampler around a denoiser, a rollout around a learned step, a scheduler around a network: the
model's forward computes a schedule, a running state and their updates itself and calls a
submodule in between. In bf16 its own ops can lose far more than their floor (a cumulative product
of 1 - beta, each factor rounded near 1; a state rounded on every step) while the end-to-end error
grows less than the DIVERGENCE_RATIO a divergence takes over what came in: the submodules' own
error is of the same order, and no single line's fix in fp32 (compare.forced) takes it away, as
the schedule and the state each lose part of it. No rule names it, and compare said OK.

The experiment is the fix the field uses (diffusers' schedulers compute in fp32 around a bf16
UNet): every op of the model's own forward in fp32, on its inputs as given and with its own
parameters and buffers in fp32, its submodules as the candidate runs them (their inputs cast to its
dtype, their outputs back to fp32). One forward. Where it divides the end-to-end error by OWN_FALLS
or more, the own code is a cause and the finding says by how much; what is left is the submodules'.
"""

from __future__ import annotations

import inspect
import math

from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.profile import DIVERGENCE_RATIO, RAISED_FALLS
from fpdoctor.precision.units import plain_fp32
from fpdoctor.report.model import Finding, Severity, Trial

# The model's own ops in fp32 are a cause where they take the end-to-end error down this much (6 dB):
# a sampler's schedule and state in fp32 around its trained bf16 denoiser, 0.0184 -> 0.0070 (a warning);
# an error where they take it down RAISED_FALLS, as a line's fix confirms a divergence
OWN_FALLS = 2.0
_LISTS = (nn.ModuleList, nn.ModuleDict)  # never called themselves: their members are


def submodules(model: nn.Module) -> list[str]:
    """The modules the model's own code calls that the check runs as the candidate does: its children
    that hold floating weights, the members of a ModuleList or ModuleDict in their place. A child
    without weights (an activation, a dropout) computes what the own code would: it is own code."""
    out: list[str] = []

    def weighted(module: nn.Module) -> bool:
        tensors = [*module.parameters(), *module.buffers()]
        return any(t.is_floating_point() for t in tensors)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _LISTS):
                visit(f"{path}.", child)
            elif weighted(child):
                out.append(path)

    visit("", model)
    return out


def own_tensors(model: nn.Module) -> list[str]:
    """The floating parameters and buffers the model holds itself, not in a submodule: what its own code
    reads, which the own-code checks keep in fp32 and their fixes name."""
    return [n for n, t in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]
            if t is not None and t.is_floating_point()]  # fmt: skip


def span(model: nn.Module, location: str | None) -> str:
    """Where the model's forward is written ("lines 50-61 of ddim.py (DDIMSampler.forward)"); the
    worst op's own line where that is not inside it (a forward that delegates), or the class's
    name where the source cannot be read."""
    forward = inspect.unwrap(type(model).forward)  # under @torch.no_grad(), the function it wraps
    name = getattr(forward, "__qualname__", f"{type(model).__name__}.forward")
    try:
        source, first = inspect.getsourcelines(forward)
        file = inspect.getsourcefile(forward)
    except (OSError, TypeError):
        return f"`{name}`" if location is None else f"`{name}` (its worst op at {location})"
    last = first + len(source) - 1
    at_file, _, at_line = (location or "").rpartition(":")
    if location and (at_file != file or not at_line.isdigit() or not first <= int(at_line) <= last):
        return f"the code of {location} and what it runs in the model's forward"
    return f"lines {first}-{last} of {file} ({name})"


def finding(
    model: nn.Module, subs: list[str], *, fmt: str, dtype: str, before: float, after: float, floor: float,
    op: str, location: str | None, ratio: float, came: float, on: str,
) -> Finding:  # fmt: skip
    """`precision-divergence`: the model's own ops in `fmt` add to the error what their fp32
    computation takes away (`before` -> `after`, checked), beside its submodules' own error (`subs`:
    those the check ran as the candidate); an error where that takes it down RAISED_FALLS times, a
    warning where the submodules keep more of it. `came`: the error that came in with the inputs."""
    many = len(subs) > 1
    named = [f"`{c}`" for c in subs[:4]]
    listed = (
        f"{', '.join(named[:-1])} and {named[-1]}"
        if many and len(subs) <= 4
        else ", ".join(named) + (f" and {len(subs) - 4} more" if len(subs) > 4 else "")
    )
    own = own_tensors(model)
    where = f" ({location})" if location else ""
    base = max(came, floor) if math.isfinite(came) else math.inf
    grew = (
        f"{before / base:.2g}x what came in with its inputs or its floor, whichever is larger"
        if math.isfinite(base) and base > 0
        else "more than its inputs, which are exact,"
    )
    message = (
        f"In {fmt}, the model's own ops (what its forward computes around {listed}) lose precision: the worst, "
        f"{op}{where}, run alone in {fmt} is {ratio:.3g}x its noise floor, and in the candidate's run the "
        f"model's output error is {grew}, short of the {DIVERGENCE_RATIO:g}x a divergence takes. "
        f"Computed in fp32, with {listed} still in {fmt}, they take the end-to-end error from {before:.3g} to "
        f"{after:.3g} (the noise floor: {floor:.3g}): what is left is the {fmt} error of {listed} "
        f"{'themselves' if many else 'itself'}."
    )
    kept = (
        f"; {'its tensors' if len(own) > 1 else 'its tensor'} {', '.join(f'`{b}`' for b in own)} kept in fp32 "
        f"across the model's cast ({plain_fp32(own, [n for n, _ in model.named_parameters(recurse=False)])})"
        if own
        else ""
    )
    fix = (
        f"Compute the model's own ops in fp32 and only {listed} in {fmt}, as the check ran it: in "
        f"{span(model, location)}, its inputs and every value it carries from step to step in fp32 (.float()){kept}; "
        f"call {listed} on {'their inputs' if many else 'its input'} cast to {dtype} (.to(p.dtype), p a parameter "
        f"of {'each' if many else 'it'}) and take {'their outputs' if many else 'its output'} back .float(). "
        f"Checked: the end-to-end error goes from {before:.3g} to {after:.3g}; then `fpdoctor compare "
        "--inputs-as-given` checks the changed model fed its inputs as they are"
    )
    return catalog.make(
        "precision-divergence",
        title=f"The model's own ops in {fmt} add to the error what fp32 takes away",
        message=message,
        severity=Severity.ERROR if after * RAISED_FALLS <= before else Severity.WARNING,
        where={"module": None, "op": op, "phase": "forward"},
        evidence={
            "kind": "own-code",
            "own_op": op,
            "own_op_location": location,
            "isolated_ratio": ratio,
            "propagated_rel": before,
            "own_in_fp32_rel": after,
            "floor_rel": floor,
            "submodules": subs,
            "kept_in_fp32": own,
        },
        fix=fix,
        trial=Trial.checked(
            f"the model's own ops in fp32 on its inputs as given, {listed} in {fmt}",
            metric="end-to-end error",
            before=before,
            after=after,
            on=on,
        ),
    )


def reason(before: float, after: float | None, errors: list[str]) -> str:
    """The note where the check ran and the own code is not the cause, or could not run."""
    if after is None:
        why = f": {errors[-1]}" if errors else ""
        return f"the model's own ops in fp32 (its submodules as the candidate runs them) could not be run{why}"
    return (
        f"the model's own ops in fp32 (its submodules as the candidate runs them) leave the end-to-end error at "
        f"{after:.3g} (from {before:.3g}), under the {OWN_FALLS:g}x fall a cause takes"
    )
