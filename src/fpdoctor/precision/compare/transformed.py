"""compare's candidate made by a function of the user's (`candidate=fn`, `--candidate file.py:fn`):
the model as `fn` returns it from an fp32 copy in eval mode (torch.ao.quantization.quantize_dynamic,
a pruning, a layer swapped for a fused or approximate one), fed the inputs in fp32, against the model
in fp64 (the referee), every forward from the same RNG state (the caller's left as it was). Its floor
is the fp32 model's own error, what the model loses before the transform.

What such a candidate changes is a set of modules: those whose class differs from the fp32 model's
at the same name (a DynamicQuantizedLinear where a Linear was). A module in it has no dtype to raise,
so the what-if is the module put back as the fp32 model has it, one at a time (one forward each), in
the order of what each gives back, then together, greedily, until the candidate gives the decisions
back: the modules to leave out of the transform, checked by the forward that ran with them left out.
For quantize_dynamic, that is exactly the model quantize_dynamic makes with a qconfig_spec of the
other modules' names (each module is quantized on its own), which the fix prints.

An output of logits (the fp32 model's last leaf a Linear to classes, a table of classes, or
`decisions="argmax"`) is judged by its decisions: top-1 agreement with fp64 and KL, the fp32 model's
beside them as the floor (decide.py). Any other output by its error against fp64: a transform's own
error is the price it was chosen for, so a finding only where the output is off by TRANSFORMED_REL of
its norm or more, with the modules that give most of it back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.candidates import cast_inputs, copy_module, make_run, split_inputs
from fpdoctor.precision.compare import use
from fpdoctor.precision.decide import Decisions, pct, top1_and_kl
from fpdoctor.precision.inputs import describe, input_sets
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import flat_sample, floating, l2_norm, rel_error, sqnr_db
from fpdoctor.precision.profile import CompareResult, ReferenceFailed
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Finding, Report, Severity, Trial

MAX_TRIED = 16  # modules put back one at a time (a forward each), in the fp32 model's call order
MAX_KEPT = 4  # modules put back together at most, before the transform is said to lose it everywhere
NEAR = 1.25  # a partial fix of fewer modules that leaves at most this times what the best partial run leaves is it
# an output that decides nothing is off by this share of its norm (SQNR below 20 dB): a finding
TRANSFORMED_REL = 0.1

Transform = Callable[[nn.Module], nn.Module]


@dataclasses.dataclass
class _Run:
    """The three models and what the search measured on the judged input set."""

    name: str
    fp32: nn.Module
    candidate: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    truth: torch.Tensor  # the fp64 model's output (its first floating tensor)
    order: list[str]  # the fp32 model's leaf calls, in order
    changed: list[str]  # the modules the transform changed (outermost), in call order
    rng: RngState  # the RNG state every forward starts from (a dropout left on draws the same numbers)
    tried: list[tuple[list[str], float]] = dataclasses.field(default_factory=list)  # put back -> the metric

    def output(self, put_back: Sequence[str] = ()) -> torch.Tensor | None:
        """The candidate's output with `put_back` as the fp32 model has them, for one forward."""
        swapped = []
        for name in put_back:
            parent, _, child = name.rpartition(".")
            holder = self.candidate.get_submodule(parent)
            swapped.append((holder, child, getattr(holder, child)))
            setattr(holder, child, self.fp32.get_submodule(name))  # read only: the fp32 copy is ours
        try:
            self.rng.restore()
            with torch.no_grad():
                return next(floating(self.candidate(*self.args, **self.kwargs)), None)
        finally:
            for holder, child, original in reversed(swapped):
                setattr(holder, child, original)


def compare_transformed(
    model: nn.Module, inputs: Any, *, transform: Transform, name: str | None = None, decisions: str | None = None
) -> CompareResult:
    """The candidate `transform(fp32 copy of model)` against fp64, judged by what its output decides
    (or its error), with the modules to leave out of the transform checked (the module docstring)."""
    name = name or getattr(transform, "__name__", None) or type(transform).__name__
    rng = RngState.capture()  # every forward starts from it, and the caller's RNG is left as it was
    try:
        return _compare(model, inputs, transform, name=name, decisions=decisions, rng=rng)
    finally:
        rng.restore()


def _compare(
    model: nn.Module, inputs: Any, transform: Transform, *, name: str, decisions: str | None, rng: RngState
) -> CompareResult:
    sets = input_sets(inputs)
    one = sets[0]
    fp32 = make_run(model, "fp32").eval()
    truth_model = make_run(model, "fp64").eval()
    made = transform(copy_module(fp32))
    rng.restore()
    if not isinstance(made, nn.Module):
        raise ValueError(
            f"the candidate function {name} returned {type(made).__name__}; it must return the model it made from "
            "the one it is given (an nn.Module), e.g. torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, "
            "dtype=torch.qint8)"
        )
    args64, kwargs64 = split_inputs(cast_inputs(one, torch.float64, copy=True))
    args, kwargs = split_inputs(cast_inputs(one, torch.float32, copy=True))
    try:
        with torch.no_grad():
            rng.restore()
            truth = next(floating(truth_model(*args64, **kwargs64)), None)
    except Exception as exc:
        raise ReferenceFailed(
            f"the model does not run in fp64 ({type(exc).__name__}: {exc})",
            "compare needs the fp64 run as its referee: make the model run in float64",
        ) from None
    if truth is None:
        raise ValueError("the model's output holds no floating tensor: compare judges floating outputs")
    rng.restore()
    order, last, float_out = _calls(fp32, args, kwargs)
    run = _Run(name, fp32, made, args, kwargs, truth, order, _changed(fp32, made, order), rng)
    cand_out = _candidate_output(run)
    source = _decision_source(fp32, last, float_out, one, decisions)
    judged = _decisions(run, source, cand_out, float_out) if source is not None and cand_out is not None else None
    sample = flat_sample(truth)
    norm = l2_norm(sample) if sample is not None else 0.0  # the errors are of this strided sample (flat_sample)
    rel, floor = _rel(cand_out, truth, norm), _rel(float_out, truth, norm)
    findings: list[Finding] = []
    if judged is not None and judged.changed:
        findings.append(_decisions_finding(run, judged, one))
    elif judged is None and rel >= TRANSFORMED_REL:
        findings.append(_error_finding(run, rel, floor, norm, one))
    summary = [
        (
            "candidate / floor model",
            f"{name} (the model as {name} returns it from an fp32 copy, fed fp32 inputs) against fp64 (the "
            "referee); the floor is the fp32 model's own error",
        ),
        ("inputs", inputs_text(describe(one)) + (f"; the first of {len(sets)} input sets" if len(sets) > 1 else "")),
        ("modules the transform changed", _changed_text(run)),
        ("end-to-end error", f"{rel:.3g} ({sqnr_db(rel):.1f} dB SQNR); the fp32 model's {floor:.3g}"),
    ]
    if judged is not None:
        summary.append(
            (
                f"decisions ({judged.source})",
                f"top-1 agreement {pct(judged.top1)} (the fp32 model's: {pct(judged.floor_top1)}), KL "
                f"{judged.kl:.3g} nats ({judged.floor_kl:.3g}) over {judged.rows} rows of {judged.classes}",
            )
        )
    if run.tried:
        summary.append(("each put back", _tried_text(run, judged)))
    data: dict[str, Any] = {
        "summary": summary,
        "candidate": name,
        "inputs": describe(one),
        "transformed": {
            "modules": [
                {
                    "module": n,
                    "from": _kind(fp32.get_submodule(n)),
                    "to": _kind(made.get_submodule(n), fp32.get_submodule(n)),
                }
                for n in run.changed
            ],
            "put_back": [{"modules": m, ("top1" if judged is not None else "rel"): v} for m, v in run.tried],
        },
        "end_to_end": {"rel": rel, "floor": floor},
        "not_checked": {"input sets": f"the first of {len(sets)} was judged"} if len(sets) > 1 else {},
    }
    if judged is not None:
        data["decisions"] = judged.to_dict()
    report = Report(command="compare", findings=findings, data=data)
    first = findings[0].where.get("module") if findings else None
    return CompareResult(report, [], first)


def _rel(out: torch.Tensor | None, truth: torch.Tensor, norm: float) -> float:
    """The relative error of an output against fp64's; inf where there is none or it differs in size."""
    ours, theirs = flat_sample(out) if out is not None else None, flat_sample(truth)
    if ours is None or theirs is None or ours.numel() != theirs.numel():
        return math.inf
    return rel_error(ours, theirs, norm)


def _candidate_output(run: _Run) -> torch.Tensor | None:
    try:
        return run.output()
    except Exception as exc:
        raise ValueError(
            f"the model {run.name} made does not run on the inputs in fp32 ({type(exc).__name__}: {exc})"
        ) from None


def _calls(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], tuple[str, Any], torch.Tensor]:
    """The fp32 model's forward: its leaf modules' calls in order, the last one (name, output: what
    made the logits), and its output (its first floating tensor)."""
    names = {m: n for n, m in model.named_modules()}
    order: list[str] = []
    last: list[tuple[str, Any]] = [("", None)]

    def hook(module: nn.Module, _: Any, output: Any) -> None:
        if not any(True for _ in module.children()):
            order.append(names[module])
            last[0] = (names[module], output)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        with torch.no_grad():
            output = next(floating(model(*args, **kwargs)), None)
    finally:
        handle.remove()
    if output is None:
        raise ValueError("the model's output holds no floating tensor: compare judges floating outputs")
    return order, last[0], output


def _changed(fp32: nn.Module, made: nn.Module, order: list[str]) -> list[str]:
    """The outermost modules whose class the transform changed, in the order the fp32 model calls
    them (a changed container before its first leaf's call)."""
    mine = dict(fp32.named_modules())
    found: list[str] = []
    for name, module in made.named_modules():
        changed = name and name in mine and type(module) is not type(mine[name])
        if changed and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)

    def first_call(name: str) -> int:
        return next((i for i, leaf in enumerate(order) if leaf == name or leaf.startswith(f"{name}.")), len(order))

    return sorted(found, key=first_call)


def _decision_source(fp32: nn.Module, last: tuple[str, Any], output: torch.Tensor, inputs: Any,
                     decisions: str | None) -> str | None:  # fmt: skip
    """How the report names the output as logits (use.py's tests, on the fp32 model), or None."""
    if decisions == "argmax":
        return "scores declared to decide by their argmax over the last dim"
    name, made = last
    if made is None or not isinstance(made, torch.Tensor) or made.shape != output.shape:
        return None
    module = fp32.get_submodule(name)
    return use.logits_source(name, module, made, ids=use.reads_ids(inputs)) or use.class_table_source(
        name, module, made
    )


def _decisions(run: _Run, source: str, cand_out: torch.Tensor, float_out: torch.Tensor) -> Decisions | None:
    """The candidate's decisions against fp64's, the fp32 model's (`float_out`) as the floor."""
    found = use.decisions(run.truth, cand_out, "fp32", source)
    floor = top1_and_kl(run.truth, float_out)
    if found is None or floor is None:
        return None
    return dataclasses.replace(found, floor_top1=floor[0], floor_kl=floor[1], floor_format="the fp32 model")


def _search(run: _Run, score: Callable[[torch.Tensor | None], float], done: Callable[[float], bool]) -> list[str]:
    """Each changed module put back alone, best first; then together, greedily, until `done` (the
    modules that are the fix, [] where MAX_KEPT of them are not): every run in `run.tried`."""
    singles = []
    for name in run.changed[:MAX_TRIED]:
        value = score(run.output([name]))
        run.tried.append(([name], value))
        singles.append((value, name))
        if done(value):
            return [name]
    singles.sort(key=lambda t: -t[0])
    kept: list[str] = []
    for _, name in singles[:MAX_KEPT]:
        kept.append(name)
        if len(kept) == 1:
            continue
        value = score(run.output(kept))
        run.tried.append((list(kept), value))
        if done(value):
            return kept
    return []


def _decisions_finding(run: _Run, judged: Decisions, inputs: Any) -> Finding:
    def score(out: torch.Tensor | None) -> float:
        got = use.top1(run.truth, out) if out is not None else None
        return got if got is not None else 0.0

    flipped = 1.0 - judged.top1
    kept, everything = _unless_everything(
        run,
        _search(run, score, judged.recovered),
        lambda v: 1 - v <= flipped / 2,
        lambda v: max(judged.floor_top1 - v, 0.0),
    )
    message = (
        f"{run.name}'s model picks another class than fp64 on {pct(flipped)} of its {judged.rows} rows, where the "
        f"fp32 model it was made from differs on {pct(1.0 - judged.floor_top1)}: the transform changes the "
        f"decisions (KL {judged.kl:.3g} nats against {judged.floor_kl:.3g})."
    )
    on = inputs_text(describe(inputs))
    if kept:
        after = next(v for m, v in run.tried if m == kept)
        alone = _alone(run, kept, pct)
        fix = _fix(run, kept) + f"; checked: top-1 {pct(judged.top1)} -> {pct(after)}{alone}{_partly(everything)}."
        trial = Trial.checked(
            f"{_names(kept)} put back as the fp32 model has them, the rest as {run.name} made them",
            metric="top-1 agreement with fp64", before=pct(judged.top1), after=pct(after), on=on,
        )  # fmt: skip
    else:
        best = max((v for m, v in run.tried if m != everything), default=None)
        fix = (
            f"No module left out of {run.name} gives the decisions back (each tried and up to {MAX_KEPT} together"
            f"{_everything_text(everything)}): the transform loses them across the model; a milder one (per-channel "
            "scales, a wider dtype, fewer layers) is the next step, judged the same way."
        )
        trial = Trial.untried(
            "the next step, not a fix that was tried: "
            + (
                f"the best run left top-1 agreement at {pct(best)} against {pct(judged.top1)}"
                if best is not None
                else f"leaving out every module it changed ({_names(everything)}) was the only run, and that leaves "
                "nothing transformed"
                if everything
                else "the transform changed no module's class: there is no module to put back"
            )
        )
    return catalog.make(
        "decisions-changed",
        message=message,
        fix=fix,
        where={"module": kept[0] if kept else None, "op": None},
        evidence={"decisions": judged.to_dict(), "put_back_tried": [{"modules": m, "top1": v} for m, v in run.tried]},
        trial=trial,
    )


def _error_finding(run: _Run, rel: float, floor: float, norm: float, inputs: Any) -> Finding:
    def score(out: torch.Tensor | None) -> float:  # higher is better: the error's negative
        return -_rel(out, run.truth, norm)

    searched = _search(run, score, lambda value: -value < TRANSFORMED_REL)
    kept, everything = _unless_everything(run, searched, lambda v: -v <= rel / 2, lambda v: max(-v - floor, 0.0))
    message = (
        f"{run.name}'s model is off by {rel:.3g} of its output's norm against fp64 ({sqnr_db(rel):.1f} dB SQNR), where "
        f"the fp32 model it was made from is off by {floor:.3g}: past {TRANSFORMED_REL:g}, what the output is used "
        "for is not what the fp32 model's is."
    )
    on = inputs_text(describe(inputs))
    if kept:
        after = -next(v for m, v in run.tried if m == kept)
        alone = _alone(run, kept, lambda v: f"{-v:.3g}")
        fix = (
            _fix(run, kept)
            + f"; checked: the end-to-end error goes from {rel:.3g} to {after:.3g}{alone}{_partly(everything)}."
        )
        trial = Trial.checked(
            f"{_names(kept)} put back as the fp32 model has them, the rest as {run.name} made them",
            metric="end-to-end error against fp64", before=rel, after=after, on=on,
        )  # fmt: skip
    else:
        fix = (
            f"No module left out of {run.name} brings the error below {TRANSFORMED_REL:g} (each tried and up to "
            f"{MAX_KEPT} together{_everything_text(everything)}): a milder transform (per-channel scales, a wider "
            "dtype) is the next step, judged the same way."
        )
        trial = Trial.untried("the next step, not a fix that was tried")
    return catalog.make(
        "precision-divergence",
        title=f"{run.name}'s model is far from fp64",
        message=message,
        fix=fix,
        severity=Severity.WARNING,
        where={"module": kept[0] if kept else None, "op": None, "phase": "forward"},
        evidence={
            "kind": "transformed",
            "rel": rel,
            "floor": floor,
            "put_back_tried": [{"modules": m, "rel": -v} for m, v in run.tried],
        },
        trial=trial,
    )


def _unless_everything(
    run: _Run, kept: list[str], halfway: Callable[[float], bool], left: Callable[[float], float]
) -> tuple[list[str], list[str]]:
    """`kept` and [], unless it is every module the transform changed: leaving them all out is no
    transform at all, never printed as its fix. Then, of the runs that took at least half the way back
    (`halfway` of a score: a partial fix, said as one), the fewest modules whose run leaves at most NEAR
    times what the best run leaves (`left` of a score: what it adds to the fp32 model's own flips or
    error), and `kept`. A module that takes a sliver more off is not worth keeping out of the transform (a
    layer it does not hurt)."""
    if not kept or not set(kept) >= set(run.changed):
        return kept, []
    fewer = [(m, v) for m, v in run.tried if not set(m) >= set(run.changed) and halfway(v)]
    if not fewer:
        return [], kept
    least = min(left(v) for _, v in fewer)
    near = [(m, v) for m, v in fewer if left(v) <= NEAR * least]
    return min(near, key=lambda t: (len(t[0]), -t[1]))[0], kept


def _alone(run: _Run, kept: list[str], said: Callable[[float], str]) -> str:
    """Where several modules are the fix, the best of them alone beside it (what the others add, and what
    keeping them costs, is the user's call); '' for one."""
    if len(kept) < 2:
        return ""
    single = max(((m, v) for m, v in run.tried if len(m) == 1 and m[0] in kept), key=lambda t: t[1], default=None)
    return f" ({_names(single[0])} alone: {said(single[1])})" if single is not None else ""


def _share(run: _Run, kept: list[str]) -> str:
    """' (N of the model's M parameters, P%)': what leaving `kept` out of the transform keeps as it was
    (a parameter tied into two of them counted once)."""
    total = sum(p.numel() for p in run.fp32.parameters())
    held_by = {id(p): p.numel() for name in kept for p in run.fp32.get_submodule(name).parameters()}
    held = sum(held_by.values())
    return f" ({held:,} of the model's {total:,} parameters, {held / total:.0%})" if total else ""


def _partly(everything: list[str]) -> str:
    """After a partial fix's figures: what the rest takes."""
    if not everything:
        return ""
    return (
        f", part of the way; only leaving out every module it changed ({_names(everything)}: nothing transformed) "
        "gives the rest back, so a milder transform of the others (per-channel scales, a wider dtype) is the next step"
    )


def _everything_text(everything: list[str]) -> str:
    if not everything:
        return ""
    return f"; only leaving out every module it changed ({_names(everything)}) does, which leaves nothing transformed"


def _fix(run: _Run, kept: list[str]) -> str:
    """Leave `kept` out of the transform, said for quantize_dynamic as its qconfig_spec."""
    others = [n for n in run.changed if n not in kept]
    quantized = all(type(run.candidate.get_submodule(n)).__module__.startswith("torch.ao.nn.quantized") for n in kept)
    if not quantized:
        return (
            f"Leave {_names(kept)} out of {run.name}: apply it to the other modules only, {_names(kept)} as the fp32 "
            f"model has {'them' if len(kept) > 1 else 'it'}{_share(run, kept)}"
        )
    spec = (
        "{" + ", ".join(repr(n) for n in others) + "}"
        if len(others) <= 8
        else "{n for n, m in model.named_modules() if type(m) in (nn.Linear,)} - {"
        + ", ".join(repr(n) for n in kept)
        + "}"
    )
    return (
        f"Leave {_names(kept)} unquantized{_share(run, kept)}: quantize the other modules only, their names as "
        "quantize_dynamic's "
        f"qconfig_spec, e.g. torch.ao.quantization.quantize_dynamic(model, {spec}, dtype=torch.qint8) (the dtype you "
        "used)"
    )


def _names(modules: list[str]) -> str:
    return " and ".join(f"`{m}`" for m in modules)


def _changed_text(run: _Run) -> str:
    if not run.changed:
        return "none (no module's class changed: weights or ops changed in place, which no run can put back)"
    pairs = [(n, run.fp32.get_submodule(n), run.candidate.get_submodule(n)) for n in run.changed[:6]]
    shown = ", ".join(f"`{n}` ({_kind(was)} -> {_kind(now, was)})" for n, was, now in pairs)
    more = f" and {len(run.changed) - 6} more" if len(run.changed) > 6 else ""
    return f"{len(run.changed)}: {shown}{more}"


def _kind(module: nn.Module, before: nn.Module | None = None) -> str:
    """A module's class as the report names it: with its package where the class it replaced has the same
    name (torch.ao.nn.quantized.dynamic's Linear for nn.Linear)."""
    cls = type(module)
    if before is not None and type(before).__name__ == cls.__name__:
        package = cls.__module__.rpartition(".modules")[0] or cls.__module__
        return f"{package}.{cls.__name__}"
    return cls.__name__


def _tried_text(run: _Run, judged: Decisions | None) -> str:
    parts = []
    for modules, value in run.tried[:8]:
        figure = pct(value) if judged is not None else f"{-value:.3g}"
        parts.append(f"{_names(modules)}: {figure}")
    if len(run.tried) > 8:
        parts.append(f"and {len(run.tried) - 8} more (in the JSON)")
    what = "top-1 agreement" if judged is not None else "end-to-end error"
    return f"{what} with each module left out of the transform: " + "; ".join(parts)


__all__ = ["MAX_KEPT", "MAX_TRIED", "TRANSFORMED_REL", "Transform", "compare_transformed"]
