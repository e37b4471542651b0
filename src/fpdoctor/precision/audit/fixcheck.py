"""A dtype fix, checked: applied, then the forward run again.

Casting the input fixes `mat1 and mat2` at the first layer of a mostly-fp16 model, and moves the
crash to the fp32 layer after it. So audit applies each fix it proposes - a module cast (undone
afterwards: the model's own tensors are put back) or an input cast (on a copy) - runs the
forward again, and follows the next failure the same way, up to FIX_STEPS fixes: the report then
gives every fix it takes, with where each failure moved, or says that one fix is enough.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.trace.mismatch import fix_action, module_expr, what_failed
from fpdoctor.precision.candidates import Call, split_inputs
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import buffers_of

# the forward under audit's origin-tracking mode: (failure explained, error raised, tracker)
Forward = Callable[[nn.Module, Any], tuple[dict[str, Any] | None, BaseException | None, Any]]

FIX_STEPS = 4  # fixes applied in a row to see whether the forward then runs (each is one forward)


def follow_fixes(
    model: nn.Module, inputs: Any, failure: dict[str, Any], main: str | None, *, forward: Forward
) -> list[tuple[dict[str, str], dict[str, Any] | None, BaseException | None]]:
    """Apply the fix for `failure` (a module cast, undone afterwards; an input cast, on a copy)
    and run the forward again, then the fix for what fails next, and so on: (the fix, what
    failed after it, the error) per step, until the forward runs or a fix is not one audit can
    apply (a tensor the forward makes itself)."""
    steps: list[tuple[dict[str, str], dict[str, Any] | None, BaseException | None]] = []
    actions: list[dict[str, str]] = []
    current = failure
    for _ in range(FIX_STEPS):
        action = fix_action(current, main, model)
        if action is None or action in actions:
            break
        actions.append(action)
        with contextlib.ExitStack() as undo:
            fixed = inputs
            for done in actions:
                if "module" in done:
                    undo.enter_context(_cast_for_now(model, done["module"], done["dtype"]))
                else:
                    fixed = _cast_input(fixed, done["input"], done["dtype"])
            after, error, _ = forward(model, fixed)
        steps.append((action, after, error))
        if after is None:
            break
        current = after
    return steps


@contextlib.contextmanager
def _cast_for_now(model: nn.Module, path: str, dtype: str) -> Iterator[None]:
    """`model`'s submodule `path` in `dtype` for the block; its own tensors are put back after."""
    module = model.get_submodule(path) if path else model
    params = [(p, p.data) for p in module.parameters()]
    buffers = [(m, name, b) for m in module.modules() for name, b in buffers_of(m).items() if b is not None]
    module.to(getattr(torch, dtype.removeprefix("torch.")))
    try:
        yield
    finally:
        for p, data in params:
            p.data = data
        for m, name, b in buffers:
            buffers_of(m)[name] = b


def _cast_input(inputs: Any, name: str, dtype: str) -> Any:
    """`inputs` with the input `name` (`inputs[0]`, `inputs['x']`) cast to `dtype`."""
    args, kwargs = split_inputs(inputs)
    key = name.removeprefix("inputs[").removesuffix("]")
    target = getattr(torch, dtype.removeprefix("torch."))
    if key.isdigit():
        args = tuple(a.to(target) if i == int(key) else a for i, a in enumerate(args))
    else:
        kwargs = {k: v.to(target) if repr(k) == key else v for k, v in kwargs.items()}
    return Call(args, kwargs)


def _action_code(action: dict[str, str]) -> str:
    if "input" in action:
        return f"{action['input']}.to({action['dtype']})   # the input"
    target = module_expr(action["module"]) if action["module"] else "model"
    return f"{target}.to({action['dtype']})"


def _then(after: dict[str, Any] | None, error: BaseException | None) -> str:
    """What happened once a fix was applied."""
    if after is not None:
        return f"{what_failed(after)} fails: {after['error']}"
    if error is not None:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    return "the forward runs"


def checked(
    finding: Finding, steps: list[tuple[dict[str, str], dict[str, Any] | None, BaseException | None]]
) -> Finding:
    """The finding with its fix checked: one fix that lets the forward run says so; one that only
    moves the failure to the next op becomes the list of every fix it takes, with where each
    failure moved to."""
    if not steps:
        return finding
    chain = [{"fix": _action_code(action), "then": _then(after, error)} for action, after, error in steps]
    runs = chain[-1]["then"] == "the forward runs"
    evidence = {**finding.evidence, "fix_checked": chain}
    trial = Trial.checked(
        "; ".join(step["fix"] for step in chain),
        metric="the forward",
        before="raises",
        after="runs",
        on="the example inputs",
    )
    if len(steps) == 1 and runs:
        return dataclasses.replace(
            finding,
            message=finding.message + " With the fix below, the forward runs (checked).",
            evidence=evidence,
            trial=trial,
        )
    if not runs:
        message = f" After the fix below the forward still fails: {chain[-1]['then']}."
        return dataclasses.replace(finding, message=finding.message + message, evidence=evidence)
    moved = "; then ".join(step["then"] for step in chain[:-1])
    message = (
        f" One fix alone only moves the failure ({moved}); with all {len(steps)} below, the forward runs (checked)."
    )
    fix = "\n".join(["# all of:", *(step["fix"] for step in chain), "# or: fpdoctor.harmonize(model, device)"])
    return dataclasses.replace(finding, message=finding.message + message, evidence=evidence, fix=fix, trial=trial)
