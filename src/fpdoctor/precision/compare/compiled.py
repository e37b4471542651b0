"""compare's compiled candidates (`compiled`, `compiled-bf16`, `compiled-fp16`): the model in that
dtype under torch.compile (Inductor) against the same model run eagerly, both against fp64.

Per module judged, fed the fp64 run's inputs rounded to the dtype (its isolated figures):
  eager      the eager module's relative error against the fp64 output
  compiled   the compiled module's
  departure  the compiled output against the eager one (relative to the fp64 output's norm)
  floor      rounding the fp64 output to the dtype, or the reference's own error (fed the same fp64
             inputs) where that is larger: what a different summation order may change
A module departs when its departure is non-finite or more than DIVERGENCE_RATIO times the floor.

Hooks cannot see inside a compiled graph, so the search compiles modules alone: the whole model
first; when it departs, its children one by one in the order they ran, down to the first child
that departs by itself, and on from there; at most MAX_COMPILES compiles in all. The first module
that departs with no child that does is compiled once more with Inductor's
`emulate_precision_casts` (it rounds each low-precision intermediate as eager does): when the
departure then falls within the floor, the difference is Inductor's fused fp32 intermediates
(expected); when it stays, the compiled program computes something else (an error).

Every compile is of a copy, with a backend made for it: Dynamo's cache never hands back another
compile (the same module class is compiled again with other settings), and nothing is added to
the user's compiled code.
"""

from __future__ import annotations

import contextlib
import io
import math
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.candidates import (
    Call,
    cast_inputs,
    compute_dtype,
    make_run,
    split_inputs,
    uncompiled,
)
from fpdoctor.precision.inputs import describe, input_sets
from fpdoctor.precision.metrics import flat_sample, l2_norm, rel_error, round_to
from fpdoctor.precision.names import PRECISIONS
from fpdoctor.precision.profile import DIVERGENCE_RATIO, UNKNOWN_FLOOR, CompareResult, ReferenceFailed
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Report, Severity, Trial
from fpdoctor.torchprivate import (
    compile_fx,
    dynamo_cache_entries,
    dynamo_config,
    dynamo_input_codes,
    inductor_config,
    lookup_backend,
    reset_dynamo_code,
)
from fpdoctor.userframes import is_user_file

# compiles one compare may make (each is seconds to minutes): enough to go down a few levels
MAX_COMPILES = 12
EMULATE = {"emulate_precision_casts": True}


@dataclass
class Judged:
    """One module compiled alone against itself run eagerly, both against fp64."""

    module: str
    eager: float
    compiled: float
    departure: float
    floor: float
    emulated: float | None = None  # the departure compiled with emulate_precision_casts
    decomposed: float | None = None  # the departure with Inductor's decompositions alone (no lowering, no fusion)
    failed: str | None = None  # why it could not be compiled

    @property
    def ratio(self) -> float:
        return self.departure / max(self.floor, UNKNOWN_FLOOR)

    @property
    def departs(self) -> bool:
        return self.failed is None and (not math.isfinite(self.departure) or self.ratio > DIVERGENCE_RATIO)

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module or "<root>",
            "eager_rel": self.eager,
            "compiled_rel": self.compiled,
            "departure_rel": self.departure,
            "floor_rel": self.floor,
            "ratio": self.ratio,
            "departs": self.departs,
            "emulated_departure_rel": self.emulated,
            "decomposed_departure_rel": self.decomposed,
            "failed": self.failed,
        }


def is_compiled(candidate: str) -> bool:
    """A candidate that is a dtype under torch.compile (its PRECISIONS entry says so)."""
    return PRECISIONS[candidate].compiled


def compare_compiled(model: nn.Module, inputs: Any, *, candidate: str, reference: str) -> CompareResult:
    """The first module whose compiled program departs from its eager run beyond the floor, and
    whether emulate_precision_casts takes the departure away (see the module's docstring)."""
    sets = input_sets(inputs)
    search = _Search(uncompiled(model), candidate, reference)
    one = sets[0]
    args, kwargs = split_inputs(cast_inputs(one, torch.float64, copy=True))
    _check_reference(search.truth, args, kwargs)
    path = search.descend("", search.truth, args, kwargs)
    notes = {
        "inside a module": "hooks cannot see inside a compiled graph: modules are compiled alone, fed the fp64 "
        "run's inputs, down the path of the first departure",
        "random draws": "Inductor's random numbers are not eager's: a forward that draws them departs",
    }
    if len(sets) > 1:
        notes["input sets"] = f"the first of {len(sets)} input sets was judged (each compile is slow)"
    if search.out_of_budget:
        notes["compiles"] = f"the search stopped after {MAX_COMPILES} compiles; the module named is as deep as it got"
    search.notes.update(notes)
    return _result(path, search, reference, describe(one))


class _Search:
    def __init__(self, model: nn.Module, candidate: str, reference: str) -> None:
        self.candidate, self.reference = candidate, reference
        self.dtype = compute_dtype(candidate)
        self.truth = make_run(model, "fp64")
        self.compiles = 0
        self.out_of_budget = False
        self.judged: list[Judged] = []
        self.notes: dict[str, str] = {}

    def descend(self, name: str, module64: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Judged]:
        """The departing modules from `name` down, outermost first; [] when `name` does not depart."""
        here = self.judge(name, module64, args, kwargs)
        if here is None or not here.departs:
            return []
        for child, child64, child_args, child_kwargs in _child_calls(name, module64, args, kwargs):
            if self.compiles >= MAX_COMPILES:
                self.out_of_budget = True
                break
            below = self.descend(child, child64, child_args, child_kwargs)
            if below:
                return [here, *below]
        self.settle(here, module64, args, kwargs)
        return [here]

    def settle(self, here: Judged, module64: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What changes the first module that departs with no child that does: Inductor rounding as
        eager does, then (where that leaves it) the decompositions run without Inductor's lowering."""
        try:
            if self.compiles < MAX_COMPILES:
                here.emulated = self._departure(module64, args, kwargs, EMULATE)[2]
            if _within(here.emulated, here.floor):
                return
            if self.compiles < MAX_COMPILES:
                here.decomposed = self._departure(module64, args, kwargs, {}, decompositions_only=True)[2]
                return
        except Exception as exc:  # the evidence says what could not be run
            self.notes["settling"] = f"`{here.module or '<root>'}`: {type(exc).__name__}: {exc}"[:300]
            return
        self.out_of_budget = True

    def judge(self, name: str, module64: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Judged | None:
        if self.compiles >= MAX_COMPILES:
            self.out_of_budget = True
            return None
        truth = _forward(module64, args, kwargs, None)
        if truth is None:  # no floating output: nothing to judge
            return None
        norm = l2_norm(truth)
        floor = max(rel_error(round_to(truth, self.candidate), truth, norm), self._reference(module64, args, kwargs,
                    truth, norm))  # fmt: skip
        try:
            eager, compiled, departure = self._departure(module64, args, kwargs, {}, truth)
        except Exception as exc:  # a module Inductor cannot compile alone: said, and not descended into
            judged = Judged(name, math.nan, math.nan, math.nan, floor, failed=f"{type(exc).__name__}: {exc}"[:300])
        else:
            judged = Judged(name, eager, compiled, departure, floor)
        self.judged.append(judged)
        return judged

    def _reference(self, module64: nn.Module, args: Any, kwargs: Any, truth: torch.Tensor, norm: float) -> float:
        out = _forward(make_run(module64, self.reference), args, kwargs, compute_dtype(self.reference))
        return 0.0 if out is None else rel_error(out, truth, norm)

    def _departure(
        self,
        module64: nn.Module,
        args: Any,
        kwargs: Any,
        config: dict[str, Any],
        truth: torch.Tensor | None = None,
        *,
        decompositions_only: bool = False,
    ) -> tuple[float, float, float]:
        """(eager's error, compiled's error, compiled against eager), the module in the dtype fed
        the fp64 inputs rounded to it; Inductor's `config` patched on for the compile."""
        truth = _forward(module64, args, kwargs, None) if truth is None else truth
        assert truth is not None  # the caller judged a module with a floating output
        norm = l2_norm(truth)
        low = make_run(module64, self.candidate)
        eager = _forward(low, args, kwargs, self.dtype)
        self.compiles += 1
        out = _run_compiled(low, cast_inputs(args, self.dtype, copy=True), cast_inputs(kwargs, self.dtype, copy=True),
                            config, decompositions_only)  # fmt: skip
        compiled = flat_sample(out)
        if eager is None or compiled is None:
            return math.nan, math.nan, math.nan
        return rel_error(eager, truth, norm), rel_error(compiled, truth, norm), rel_error(compiled, eager, norm)


def _check_reference(truth: nn.Module, args: Any, kwargs: Any) -> None:
    """The fp64 copy runs and makes no NaN, else the one-line error (ReferenceFailed) that says where:
    a compiled program compared with a reference that fails or is NaN judges nothing (every ratio NaN)."""
    try:
        with torch.no_grad(), _same_rng():
            out = truth(*cast_inputs(args, None, copy=True), **cast_inputs(kwargs, None, copy=True))
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
        at = f" at {frames[-1].filename}:{frames[-1].lineno} (`{(frames[-1].line or '').strip()}`)" if frames else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ReferenceFailed(
            f"the model fails in the reference run (its fp64 copy){at}: {type(exc).__name__}: {text}",
            fix="write the forward for any dtype (x.to(q.dtype), not .float() or .half()), so that its fp64 copy runs",
        ) from exc
    nan = sum(int(torch.isnan(t).sum()) for t in tensors_in(out) if t.is_floating_point())
    if nan:
        raise ReferenceFailed(
            f"the model's output holds {nan} NaN values in its fp64 run (eager) too: its eager forward is broken "
            "before any compile, so there is no compiled departure to judge",
            fix="`fpdoctor trace` on a script that runs the model eagerly names the op that makes them and its fix",
        )


def _forward(module: nn.Module, args: Any, kwargs: Any, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A float64 sample of `module`'s output, fed copies of the inputs in `dtype` (None: as they are)."""
    with torch.no_grad(), _same_rng():
        return flat_sample(module(*cast_inputs(args, dtype, copy=True), **cast_inputs(kwargs, dtype, copy=True)))


def _within(departure: float | None, floor: float) -> bool:
    return (
        departure is not None and math.isfinite(departure) and departure / max(floor, UNKNOWN_FLOOR) <= DIVERGENCE_RATIO
    )


def _run_compiled(module: nn.Module, args: Any, kwargs: Any, config: dict[str, Any], decompositions_only: bool) -> Any:
    """`module` under torch.compile with Inductor (`config` patched on, never left set), called once;
    `decompositions_only`: with Inductor's decompositions run eagerly instead (aot_eager_decomp_partition)."""
    compile_graph = lookup_backend("aot_eager_decomp_partition") if decompositions_only else compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # a backend of its own: Dynamo's cache is per backend, so no other compile is reused
        with inductor_config().patch(config):
            return compile_graph(gm, example_inputs)

    compiled = torch.compile(module, backend=backend, dynamic=False)
    # the same module class compiled again with another backend is a recompile, not a fallback to eager
    limits = {"recompile_limit": 10**6, "accumulated_recompile_limit": 10**6}
    try:
        with dynamo_config().patch(limits), inductor_config().patch(config), torch.no_grad(), _same_rng(), _quiet():
            return compiled(*args, **kwargs)
    finally:
        _forget(backend)


def _forget(backend: Any) -> None:
    """Dynamo's cache entries this compile left on code objects (a module class's forward) dropped,
    so the user's own compiles of the same code never count them towards Dynamo's recompile limit.
    Dynamo drops a code object's entries all together: one holding an entry of the user's too keeps ours."""

    def ours(entry: Any) -> bool:
        return entry.backend is backend or getattr(entry.backend, "compiler_fn", None) is backend

    for code in dynamo_input_codes():
        entries = dynamo_cache_entries(code)
        if entries and all(ours(e) for e in entries):
            reset_dynamo_code(code)


def _child_calls(
    name: str, module64: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]]:
    """The submodules `module64`'s forward calls itself (not from inside another submodule: a
    ModuleList's blocks, never called as a list, are its children here), in the order they ran,
    each with the fp64 inputs of its first call."""
    seen: dict[str, Any] = {}
    hooks = []
    named = dict(module64.named_modules())
    named.pop("", None)
    inside = [0]  # submodule calls under way: only the outermost are module64's own

    def keep(child: str) -> Any:
        def hook(_m: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
            if inside[0] == 0 and child not in seen:
                seen[child] = cast_inputs(Call(a, k), None, copy=True)
            inside[0] += 1

        return hook

    def left(*_: Any) -> None:
        inside[0] -= 1

    for child, sub in named.items():
        hooks.append(sub.register_forward_pre_hook(keep(child), with_kwargs=True))
        hooks.append(sub.register_forward_hook(left))
    try:
        with torch.no_grad(), _same_rng():
            module64(*cast_inputs(args, None, copy=True), **cast_inputs(kwargs, None, copy=True))
    finally:
        for h in hooks:
            h.remove()
    prefix = f"{name}." if name else ""
    return [(prefix + child, named[child], call.args, call.kwargs) for child, call in seen.items()]


@contextlib.contextmanager
def _same_rng() -> Any:
    """Every run of a module draws the same random numbers eager would (the user's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


@contextlib.contextmanager
def _quiet() -> Any:
    """Inductor's prints kept off the user's console."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3g}"


def _upper(text: str) -> str:
    return text[:1].upper() + text[1:]


def _result(path: list[Judged], search: _Search, reference: str, inputs: Any) -> CompareResult:
    candidate, notes = search.candidate, search.notes
    dtype = str(search.dtype).removeprefix("torch.")
    root = search.judged[0] if search.judged else None
    first = path[-1] if path else None
    findings = [_finding(first, path, candidate, dtype)] if first is not None else []
    failed = [j for j in search.judged if j.failed]
    if failed:
        notes["not compiled"] = "; ".join(f"`{j.module or '<root>'}`: {j.failed}" for j in failed[:3])
    summary = [
        (
            "candidate / floor model",
            f"{candidate} (torch.compile, Inductor, {dtype}) against the same model run eagerly in {dtype}; both "
            f"against fp64 (the referee); the floor is rounding to {dtype} or the {reference} model's own error",
        ),
        ("modules compiled", f"{len(search.judged)} ({search.compiles} compiles)"),
        ("first departing module", f"`{first.module or '<root>'}`" if first is not None else "none"),
        (
            "end-to-end",
            "-"
            if root is None
            else f"eager {_fmt(root.eager)}, compiled {_fmt(root.compiled)} against fp64; "
            f"compiled against eager {_fmt(root.departure)} (floor {_fmt(root.floor)})",
        ),
    ]
    report = Report(
        command="compare",
        findings=findings,
        data={
            "summary": summary,
            "compiled": [j.as_dict() for j in search.judged],
            "not_checked": notes,
            "divergence_ratio": DIVERGENCE_RATIO,
            "inputs": inputs,
        },
    )
    bad = first is not None and findings[0].name == "compiled-departure"
    return CompareResult(report, [], first.module if bad and first is not None else None)


def _finding(first: Judged, path: list[Judged], candidate: str, dtype: str) -> Finding:
    name = f"`{first.module}`" if first.module else "the whole model (no child departs by itself)"
    numbers = (
        f"fed the fp64 run's inputs, eager's error against fp64 is {_fmt(first.eager)}, compiled's "
        f"{_fmt(first.compiled)}; compiled against eager {_fmt(first.departure)}, "
        + ("non-finite" if not math.isfinite(first.departure) else f"{first.ratio:.3g}x the floor {_fmt(first.floor)}")
    )
    evidence = {
        "candidate": candidate,
        "dtype": dtype,
        "referee": "fp64",
        "backend": "inductor",
        "path": [j.module or "<root>" for j in path],
        **{k: v for k, v in first.as_dict().items() if k != "module"},
    }
    where = {"module": first.module, "op": None, "phase": "forward"}
    settled = _within(first.emulated, first.floor)
    emulated = (
        "emulate_precision_casts was not tried (out of compiles)"
        if first.emulated is None
        else f"compiled with emulate_precision_casts=True, compiled against eager is {_fmt(first.emulated)}"
    )
    broken = _eager_broken(first)
    both = not broken and min(first.eager, first.compiled) > DIVERGENCE_RATIO * max(first.floor, UNKNOWN_FLOOR)
    if (settled or broken) and dtype != "float32":
        evidence = {"kind": "compiled-fused-precision", **evidence}
        message = f"In {candidate}, {name} compiled departs from its eager run: {numbers}. {_upper(emulated)}" + (
            f", within the floor: Inductor keeps the fused {dtype} intermediates in fp32 where eager rounds each."
            if settled
            else "."
        )
        eager = candidate.removeprefix("compiled-")
        if broken or both:
            # compiled is right and eager is the broken one (or both are off): "nothing is wrong" and a setting that
            # makes compiled round as eager does would ship eager's error (a variance by hand, 166 off in eager bf16)
            said = (
                f" Eager {dtype} is the one that is wrong: its error against fp64 "
                + ("is non-finite" if not math.isfinite(first.eager) else f"is {_fmt(first.eager)}")
                + f", far past the floor {_fmt(first.floor)}, where compiled's is {_fmt(first.compiled)}: compiled "
                "is closer to fp64 only because its fusion skips the roundings where eager loses it."
                if broken
                else f" Both are far off fp64 ({_fmt(first.eager)} eager, {_fmt(first.compiled)} compiled, the floor "
                f"{_fmt(first.floor)}): whichever runs, the model loses it in {dtype}."
            )
            return catalog.make(
                "compiled-fused-precision",
                message=message + said,
                severity=Severity.WARNING,
                where=where,
                evidence=evidence | {"eager_broken": broken, "both_off": both},
                fix=(
                    ("Do not set torch._inductor.config.emulate_precision_casts: it would make compiled round as eager "
                     "does and lose what eager loses. " if broken else "")
                    + f"Find why eager {dtype} loses it: `fpdoctor compare MODEL --candidate {eager}` on the eager "
                    "model names the lines and checks their fix"
                    + ("; code that relies on compiled's fusion to stay accurate breaks where the model runs eagerly "
                       "(a graph break, debugging, another backend)" if broken else "")
                ),
                trial=Trial.untried(
                    f"compare --candidate {eager} is a compare of its own (this one compared compiled with eager)"
                ),
            )  # fmt: skip
        return catalog.make(
            "compiled-fused-precision",
            message=message,
            where=where,
            evidence=evidence,
        )
    if first.decomposed is None:
        cause = "a fusion, decomposition, lowering or pass changes it"
    elif _within(first.decomposed, first.floor):
        cause = (
            f"with Inductor's decompositions alone (aot_eager_decomp_partition) it is {_fmt(first.decomposed)}, "
            "within the floor: Inductor's lowering, fusion or a graph pass changes it"
        )
    else:
        cause = (
            f"with Inductor's decompositions alone (aot_eager_decomp_partition) it is {_fmt(first.decomposed)}: "
            "a decomposition changes it"
        )
    evidence = {"kind": "compiled-departure", **evidence}
    return catalog.make(
        "compiled-departure",
        message=(
            f"In {candidate}, {name} compiled computes something else than eager: {numbers}. {_upper(emulated)}"
            + ("." if settled else f": not a rounding difference; {cause}.")
        ),
        where=where,
        evidence=evidence,
    )


def _eager_broken(first: Judged) -> bool:
    """Eager is far off fp64 where compiled is not: eager's error non-finite, or DIVERGENCE_RATIO
    past both its floor and compiled's error, compiled's finite."""
    if not math.isfinite(first.compiled):
        return False
    return not math.isfinite(first.eager) or first.eager > DIVERGENCE_RATIO * max(
        first.compiled, first.floor, UNKNOWN_FLOOR
    )


__all__ = ["MAX_COMPILES", "Judged", "compare_compiled", "is_compiled"]
