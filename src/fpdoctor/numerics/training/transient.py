"""A bad step that did not reproduce on replay: which of four causes, each decided by an experiment.

A non-finite step whose replay (same batch, RNG state, weights) is finite did not compute the first
time what its code asks for. Four things do that, each with its own fix and its own owner:

- the machine: the same inputs give another result on this device only (a faulty GPU);
- a race: a read that runs before its write (two streams without a synchronisation, a buffer the
  caching allocator handed out again while another stream still wrote it);
- an uninitialised read: memory from torch.empty* read before anything wrote it, whose garbage is
  sometimes NaN;
- a nondeterministic kernel: atomics that add in another order on every run, one of which overflows.

Each experiment re-runs the step from its saved state as the replay does (`replay.replay`: the
user's step_fn, the weights as they were, nothing reaching them), with one thing changed, and
fingerprints every run bit for bit (an integer sum of the loss's and gradients' bit patterns: exact,
so the fingerprint adds no nondeterminism of its own):

| experiment    | changed                                                             | decides                 |
|---------------|---------------------------------------------------------------------|-------------------------|
| as run        | nothing (twice more)                                                | does the result vary?   |
| deterministic | torch.use_deterministic_algorithms(True, warn_only=True), no fill   | nondeterministic kernel |
| fill          | the same plus fill_uninitialized_memory: NaN in every fresh tensor  | uninitialised read      |
| ordered       | the device synchronised after every op; every tensor the step makes | race                    |
|               | kept to the step's end, so that no memory block is handed out twice |                         |
| ordered+fill  | both: a read of fresh memory that ordering removes was a race       | race vs uninitialised   |
| zero-fill     | every torch.empty* of the step zero-filled (only after a fill run   | the fix of an           |
|               | went NaN): the fix of an uninitialised read, tried                  | uninitialised read      |
| neighbour     | the step on another device (a second GPU, or the CPU for one GPU)   | the machine             |

`decide` reads them in that order (`_decide`): NaN that the fill puts in fresh memory reaching the
result is an uninitialised read, unless ordering the ops removes it (a race); a result that varies
from run to run and is one under deterministic algorithms is a nondeterministic kernel, one under
ordering a race, one on the neighbour only the machine; a result that never varies, in any of them,
was the machine's once. Anything else is undecided, with what was tried.

The user's settings are put back exactly (deterministic algorithms, warn_only, the fill, cuDNN's
flags); they are process-wide, so another thread of the program runs under them while an experiment
does. Not run under torch.distributed: every rank would have to issue each re-run's collectives alike.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.observe.gradcheck import dense_values, grads_of
from fpdoctor.numerics.training.replay import ReplayResult, replay
from fpdoctor.report.model import Trial
from fpdoctor.torchprivate import DisableTorchDispatch, EagerDispatchMode, named_parameters, pytree, reparametrized

CAUSES = ("machine", "race", "uninitialised-read", "nondeterministic-kernel", "undecided")
REPEATS = 2  # runs per experiment whose results are compared bit for bit: two differ or agree
# The steps that did not reproduce whose causes are told apart; a later one is counted under them
# (each costs about ten re-runs of the step: the first few say what the next would).
STEPS_TOLD_APART = 3
# A copy of the model on the neighbour is made up to this size (the CPU's memory is not the GPU's).
NEIGHBOUR_MAX_BYTES = 4 << 30
# The ops that hand out memory without writing it (what fill_uninitialized_memory fills).
_FRESH = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STEP = "this step's batch, RNG state and weights"

Contexts = Callable[[], list[contextlib.AbstractContextManager[Any]]]


@dataclass(frozen=True)
class Run:
    """One re-run of the step: finite / nonfinite / failed, and its bit-level fingerprint."""

    outcome: str
    fingerprint: tuple[int, ...] = ()
    loss: float = math.nan
    op: str | None = None  # the op the trace named, on a traced run that was non-finite
    module: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.outcome}
        if math.isfinite(self.loss):
            out["loss"] = self.loss
        out |= {k: v for k, v in (("op", self.op), ("module", self.module), ("error", self.error)) if v}
        return out


@dataclass
class Experiment:
    name: str
    changed: str  # what was changed, in words
    runs: list[Run] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)  # what this machine could not apply, and why
    notes: list[str] = field(default_factory=list)  # e.g. ops that have no deterministic implementation

    @property
    def ran(self) -> list[Run]:
        return [r for r in self.runs if r.outcome != "failed"]

    @property
    def results(self) -> int:
        """How many different results (outcome and fingerprint) the runs that ran gave."""
        return len({(r.outcome, r.fingerprint) for r in self.ran})

    @property
    def stable(self) -> bool:
        """Every run ran and gave the same result, bit for bit, finite."""
        return bool(self.runs) and len(self.ran) == len(self.runs) and self.results == 1 and self.finite

    @property
    def varies(self) -> bool:
        return len(self.ran) >= 2 and self.results > 1

    @property
    def finite(self) -> bool:
        return bool(self.ran) and all(r.outcome == "finite" for r in self.ran)

    @property
    def nonfinite(self) -> bool:
        return any(r.outcome == "nonfinite" for r in self.ran)

    def said(self) -> str:
        """What it gave, in words: '1 result in 2 runs, finite'."""
        if not self.ran:
            errors = {r.error for r in self.runs if r.error}
            return "could not run (" + "; ".join(sorted(errors)) + ")" if errors else "not run"
        bad = sum(r.outcome == "nonfinite" for r in self.ran)
        n = len(self.ran)
        head = f"{self.results} result{'s' if self.results > 1 else ''} in {n} run{'s' if n > 1 else ''}"
        tail = "finite" if not bad else "non-finite" if bad == n else f"{bad} non-finite"
        return f"{head}, {tail}" if n > 1 else tail

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "changed": self.changed, "gave": self.said()}
        out["runs"] = [r.to_dict() for r in self.runs]
        if self.not_applied:
            out["not_applied"] = list(self.not_applied)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


@dataclass
class TransientCause:
    """The cause of a step that did not reproduce, the sentence of the experiment that decided it, and
    every experiment made (`why_not`: none was made, and why)."""

    cause: str
    decided_by: str
    experiments: list[Experiment] = field(default_factory=list)
    why_not: str | None = None

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {', '.join(CAUSES)}, got {self.cause!r}")

    def experiment(self, name: str) -> Experiment | None:
        return next((e for e in self.experiments if e.name == name), None)

    def tried(self) -> str:
        """Every experiment and what it gave, one clause each."""
        if not self.experiments:
            return f"nothing ({self.why_not})" if self.why_not else "nothing"
        return "; ".join(f"{e.name} ({e.changed}): {e.said()}" for e in self.experiments)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cause": self.cause, "decided_by": self.decided_by}
        if self.experiments:
            out["experiments"] = [e.to_dict() for e in self.experiments]
        if self.why_not:
            out["not_run"] = self.why_not
        return out


def not_run(why: str) -> TransientCause:
    return TransientCause("undecided", f"The causes were not told apart: {why}.", why_not=why)


class Experiments:
    """Tells the causes of the first `limit` steps that do not reproduce; later ones say which did."""

    def __init__(self, limit: int = STEPS_TOLD_APART) -> None:
        self.limit = limit
        self.decided: dict[int, str] = {}  # step -> cause

    def decide(
        self,
        model: nn.Module,
        params: list[torch.Tensor],
        step_fn: Callable[..., Any],
        window: list[MicroBatch],
        contexts: Contexts,
        *,
        step: int,
        distributed: bool = False,
    ) -> TransientCause:
        """Never raises; every parameter's .grad is left as it was found."""
        if distributed:
            return not_run(
                "under torch.distributed every rank would have to re-run the step's collectives alike for each "
                "experiment"
            )
        if len(self.decided) >= self.limit:
            said = ", ".join(f"step {s}: {c}" for s, c in self.decided.items())
            return not_run(f"the experiments ran on the first {self.limit} steps that did not reproduce ({said})")
        saved = [(p, p.grad) for p in params]
        try:
            told = decide(model, params, step_fn, window, contexts)
        except Exception as exc:  # the observer's own failure: said, never raised
            told = not_run(f"the experiments failed: {type(exc).__name__}: {exc}")
        finally:
            for p, g in saved:
                p.grad = g
        self.decided[step] = told.cause
        return told


def decide(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: Contexts,
    *,
    neighbour: torch.device | str | None = "auto",
    repeats: int = REPEATS,
) -> TransientCause:
    """Run the experiments on the step (the window and state the replay ran) and decide the cause.
    `neighbour`: the other device to run it on ("auto": a second GPU, else the CPU; None: none)."""
    device = params[0].device if params else torch.device("cpu")
    other = _neighbour_of(device) if neighbour == "auto" else neighbour
    assert other is None or isinstance(other, torch.device)

    def runs(n: int, *, traced: bool = False, around: Callable[[], Any] = contextlib.nullcontext) -> list[Run]:
        out = []
        for _ in range(n):
            with around() as extra:
                out.append(_run(model, params, step_fn, window, [*contexts(), *(extra or [])], traced=traced))
        return out

    done: list[Experiment] = []
    as_run = Experiment("as run", "nothing: the step run again as it ran", runs(repeats))
    done.append(as_run)

    deterministic = Experiment("deterministic", "torch.use_deterministic_algorithms(True, warn_only=True)")
    for _ in range(repeats):
        with _settings(deterministic=True, fill=False) as caught:
            deterministic.runs += runs(1)
        deterministic.notes = _merge(deterministic.notes, _undeterministic(caught))
    done.append(deterministic)

    fill = Experiment(
        "fill",
        "deterministic algorithms and torch.utils.deterministic.fill_uninitialized_memory: NaN in every "
        "tensor made by torch.empty*",
    )
    with _settings(deterministic=True, fill=True):
        fill.runs = runs(1, traced=True)
    done.append(fill)

    ordered = Experiment("ordered", "a synchronisation after every op; every tensor the step makes kept to its end")
    ordered.not_applied = _not_ordered(device)
    ordered.runs = runs(repeats, around=lambda: _ordering(device))
    done.append(ordered)

    both = Experiment("ordered+fill", "the fill and the ordering together")
    with _settings(deterministic=True, fill=True):
        both.runs = runs(1, traced=True, around=lambda: _ordering(device))
    done.append(both)

    if _fill_mattered(fill, deterministic):  # the fix of an uninitialised read, tried: zeros in fresh memory
        zero = Experiment("zero-fill", "every tensor the step makes with torch.empty* filled with zeros")
        zero.runs = runs(1, around=lambda: _single(_ZeroFresh()))
        done.append(zero)

    if other is not None:
        near = Experiment("neighbour", f"the step on {other} (a copy of the weights, buffers and batch)")
        why = _too_big(model, other)
        if why is not None:
            near.runs = [Run("failed", error=why)]
        else:
            near.runs = [
                _on_device(model, params, step_fn=step_fn, window=window, contexts=contexts, other=other, traced=False)
                for _ in range(repeats)
            ]
        done.append(near)
    cause, sentence = _decide({e.name: e for e in done}, device, other)
    return TransientCause(cause, sentence, done)


def _decide(by: dict[str, Experiment], device: torch.device, other: torch.device | None) -> tuple[str, str]:
    """The cause and the sentence that says which experiment decided it (see the module's table)."""
    as_run, det, fill, ordered, both = (by[n] for n in ("as run", "deterministic", "fill", "ordered", "ordered+fill"))
    near = by.get("neighbour")
    if _fill_mattered(fill, det):
        at = _at(fill)
        if both.finite:
            return "race", (
                f"With every fresh tensor filled with NaN the step was non-finite{at}, and with a synchronisation "
                "after every op as well it was finite: a read reached memory before its write landed (a race between "
                "streams or with a copy), not a buffer nothing writes."
            )
        if both.nonfinite:
            return "uninitialised-read", (
                f"With every fresh tensor filled with NaN (fill_uninitialized_memory) the step was non-finite{at}, "
                "with every op synchronised too: memory is read before anything writes it, and its garbage is "
                "sometimes NaN."
            )
    if as_run.varies:
        head = f"Run again as it ran, the step gave {as_run.said()}"
        if det.stable:
            ops = f" (ops with no deterministic implementation warned: {', '.join(det.notes)})" if det.notes else ""
            return "nondeterministic-kernel", (
                f"{head}; under torch.use_deterministic_algorithms(True) it gave {det.said()}: a kernel whose result "
                f"depends on the order its threads add in (atomics in a reduction){ops}."
            )
        if ordered.stable and det.varies:
            return "race", (
                f"{head}, and {det.said()} under deterministic algorithms; with a synchronisation after every op and "
                f"no memory block reused within the step it gave {ordered.said()}: a read ran before its write."
            )
        if near is not None and near.stable and not (det.stable or ordered.stable):
            return "machine", (
                f"{head}, and no setting made it one result on {device}; on {other} it gave {near.said()}: the "
                f"result varies on {device} only."
            )
        return "undecided", f"{head}; neither deterministic algorithms nor ordering every op made it one result."
    every = [as_run, det, fill, ordered, both]
    if all(e.stable for e in every):
        if near is not None and near.nonfinite:
            return "undecided", (
                f"Every re-run on {device} gave one finite result, but on {other} the step was non-finite: the step "
                "itself is not safe on every device, and the bad run on this one is not explained."
            )
        there = (
            f"; on {other} it is finite too ({near.said()})"
            if near is not None and near.finite
            else f"; on {other} it could not run ({near.said()})"
            if near is not None
            else "; there is no other device here to run it on"
        )
        return "machine", (
            f"Re-run {sum(len(e.runs) for e in every)} times on {device} (as it ran, under deterministic "
            "algorithms, with fresh memory NaN-filled, with every op synchronised and no block reused), the step "
            f"gave one result each time, finite: nothing in the step's software varies from run to run{there}. "
            "The one bad result came from outside the step: the machine."
        )
    varied = [e.name for e in every if not e.stable]
    return "undecided", f"The re-runs did not agree with one another in a way any cause explains ({', '.join(varied)})."


def _fill_mattered(fill: Experiment, det: Experiment) -> bool:
    """The NaN fill made the step non-finite: with the same deterministic algorithms and no fill, every
    run was finite (else the NaN may be the step's own, as run)."""
    return fill.nonfinite and det.finite


def _at(experiment: Experiment) -> str:
    bad = next((r for r in experiment.ran if r.outcome == "nonfinite" and r.op), None)
    if bad is None:
        return ""
    return f" (the trace's first non-finite op: {bad.op}" + (f" in `{bad.module}`" if bad.module else "") + ")"


# -- the verdict's words, fix and trial -------------------------------------------------------------

_TITLE = "A non-finite step did not reproduce when replayed"
TITLES = {
    "machine": f"{_TITLE}: the machine (every re-run of the same inputs agrees)",
    "race": f"{_TITLE}: a race (a read ran before its write)",
    "uninitialised-read": f"{_TITLE}: an uninitialised read (fresh memory reaches the result)",
    "nondeterministic-kernel": f"{_TITLE}: a nondeterministic kernel (deterministic algorithms give one result)",
    "undecided": f"{_TITLE}, and no experiment decided why",
}


def fix_and_trial(told: TransientCause) -> tuple[str, Trial | None]:
    """The fix the cause calls for and what trying it gave; no trial for the machine's (a drain: the
    catalogue's `untried` says why)."""
    by = {e.name: e for e in told.experiments}
    if told.cause == "race":
        filled = _fill_mattered(by["fill"], by["deterministic"])
        ordered = by["ordered+fill"] if filled else by["ordered"]
        before = by["fill"] if filled else by["as run"]
        return (
            "Find the read that does not wait for its write: a tensor made or written on another stream (a side "
            "stream, a non_blocking copy, a collective's output) and used on this one without "
            "torch.cuda.current_stream().wait_stream(...), or freed while another stream still uses it (call "
            "tensor.record_stream(stream)). Running the step with CUDA_LAUNCH_BLOCKING=1 confirms it.",
            Trial.checked(
                "a synchronisation after every op, every tensor of the step kept to its end",
                metric="the step's loss and gradients",
                before=before.said() + (" with fresh memory NaN-filled" if filled else ""),
                after=ordered.said(),
                on=_STEP,
            ),
        )
    if told.cause == "uninitialised-read":
        zero = by.get("zero-fill")
        fix = (
            "Write every element of the buffer before it is read: torch.zeros (or torch.full) in place of "
            "torch.empty where the code, a custom kernel or its padding leaves part of it unwritten"
            + _at(by["fill"]).replace(" (", "; with the fill, ").removesuffix(")")
            + "."
        )
        if zero is not None and zero.finite:
            return fix, Trial.checked(
                "every tensor the step makes with torch.empty* filled with zeros",
                metric="the step's loss and gradients",
                before="non-finite with fresh memory filled with NaN",
                after=zero.said(),
                on=_STEP,
            )
        return fix, Trial.untried(
            "zero-filling the step's fresh memory "
            + (f"gave {zero.said()}" if zero is not None else "was not run")
            + ": the buffer to initialise is in the code, which fpdoctor does not write"
        )
    if told.cause == "nondeterministic-kernel":
        det = by["deterministic"]
        return (
            "Turn deterministic algorithms on: torch.use_deterministic_algorithms(True) (with "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA) gave one result. A sum that overflows in one order sits at "
            "the edge of its dtype's range: keep that reduction in fp32 as well.",
            Trial.checked(
                "torch.use_deterministic_algorithms(True, warn_only=True)",
                metric="the step's loss and gradients",
                before=by["as run"].said(),
                after=det.said(),
                on=_STEP,
            ),
        )
    if told.cause == "undecided":
        return (
            "Watch where it recurs: at the same step of every run (a library's or kernel's call count), at random "
            "steps on one GPU only (the machine: `fpdoctor health` there), on every GPU (the code: run the step "
            "with CUDA_LAUNCH_BLOCKING=1 and torch.use_deterministic_algorithms(True)).",
            Trial.untried(f"no experiment decided the cause. Tried: {told.tried()}"),
        )
    return (
        "Check the device: `fpdoctor health` on it (ECC, Xid, a GEMM fingerprint), nvidia-smi -q -d ECC, dmesg for "
        "Xid; drain it if a fault recurs there, at random steps.",
        None,  # an action on the machine: the catalogue says why no run tries it
    )


# -- running the step ----------------------------------------------------------------------------


def _run(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
    *,
    traced: bool,
) -> Run:
    prints: list[int] = []

    def observe(index: int, loss: Any, ps: list[torch.Tensor]) -> None:
        prints.extend(_fingerprint(loss, ps))

    try:
        result = replay(model, params, step_fn, window, contexts, traced=traced, observe=observe)
    except Exception as exc:
        return Run("failed", error=f"{type(exc).__name__}: {exc}")
    return _run_of(result, tuple(prints))


def _run_of(result: ReplayResult, fingerprint: tuple[int, ...]) -> Run:
    if result.verdict == "replay-failed":
        return Run("failed", error=result.error)
    outcome = "nonfinite" if result.verdict == "deterministic-nonfinite" else "finite"
    culprit = result.culprit
    op = culprit.where.get("op") if culprit is not None else None
    module = culprit.where.get("module") if culprit is not None else None
    return Run(outcome, fingerprint, result.loss, op=op, module=module)


def _fingerprint(loss: Any, params: list[torch.Tensor]) -> list[int]:
    """One integer per tensor, the loss's and each gradient's: the sum of its elements' bit patterns
    in int64. Integer sums are exact in any order, so equal runs give equal numbers on any device;
    one flipped bit changes it. One host read per micro-batch (re-runs only)."""
    tensors = [loss] if isinstance(loss, torch.Tensor) else []
    tensors += dense_values(grads_of(params))
    if not tensors:
        return []
    with DisableTorchDispatch(), torch.no_grad():
        sums = []
        for tensor in tensors:
            t = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor.detach()
            bits = _INT_OF_SIZE.get(t.element_size())
            if bits is None or t.dtype == torch.bool:
                continue
            sums.append(t.contiguous().reshape(-1).view(bits).long().sum())
        return [int(v) for v in torch.stack(sums).tolist()] if sums else []


@contextlib.contextmanager
def _settings(*, deterministic: bool, fill: bool) -> Iterator[list[warnings.WarningMessage]]:
    """Deterministic algorithms (warn_only: an op without a deterministic implementation warns and
    runs) and the fill, for the block; the user's settings, all four, put back exactly after it. The
    warnings are caught (they name the ops that stayed nondeterministic) and not shown."""
    import torch.utils.deterministic as det

    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,  # type: ignore[attr-defined]
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            det.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
            if deterministic:
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            yield caught
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        det.fill_uninitialized_memory = was[2]  # type: ignore[attr-defined]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[3], was[4]


def _undeterministic(caught: list[warnings.WarningMessage]) -> list[str]:
    """The ops torch warned have no deterministic implementation (their names, as torch gives them)."""
    marker = " does not have a deterministic implementation"
    found = [str(w.message).split(marker)[0].strip() for w in caught if marker in str(w.message)]
    return list(dict.fromkeys(found))


def _merge(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))


class _Ordered(EagerDispatchMode):
    """After every op: the device synchronised (so every stream's work has finished before the next op
    is issued, as on one stream), and the op's outputs kept until the step ends (so that no memory
    block is handed out twice within it: the caching allocator's reuse, taken away)."""

    def __init__(self, sync: Callable[[], None] | None) -> None:
        super().__init__()
        self.sync = sync
        self.kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.kept.extend(t for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if self.sync is not None:
            self.sync()
        return out


class _ZeroFresh(EagerDispatchMode):
    """Every tensor an op hands out unwritten (torch.empty*, new_empty) filled with zeros."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _FRESH and isinstance(out, torch.Tensor) and not out.is_meta:
            with DisableTorchDispatch(), torch.no_grad():
                out.zero_()
        return out


@contextlib.contextmanager
def _single(mode: EagerDispatchMode) -> Iterator[list[contextlib.AbstractContextManager[Any]]]:
    yield [mode]


@contextlib.contextmanager
def _ordering(device: torch.device) -> Iterator[list[contextlib.AbstractContextManager[Any]]]:
    mode = _Ordered(_sync_of(device))
    try:
        yield [mode]
    finally:
        mode.kept.clear()


def _sync_of(device: torch.device) -> Callable[[], None] | None:
    """The device's synchronize(): CUDA's waits for every stream on the device; the CPU's
    (torch.cpu.synchronize) waits for nothing in eager PyTorch, and is called all the same."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    return sync if callable(sync) else None


def _not_ordered(device: torch.device) -> list[str]:
    """What the ordering experiment cannot apply on this device, in words."""
    if device.type == "cuda":
        return [
            "the caching allocator cannot be switched off in a running process (PYTORCH_NO_CUDA_MEMORY_CACHING is "
            "read at start-up): every tensor the step makes is kept to its end instead, so no block is handed out "
            "twice within the step",
            "a single stream is not forced (the step's own torch.cuda.stream regions keep their streams): the "
            "synchronisation after every op orders them as one stream would",
        ]
    if device.type == "cpu":
        return [
            "the synchronisation orders nothing on the CPU: eager CPU ops have finished when they return "
            "(torch.cpu.synchronize() is called after every op and waits for no stream); the allocator's reuse is "
            "taken away by keeping every tensor the step makes to its end",
        ]
    return [f"{device.type} has no synchronize() here: only the allocator's reuse is taken away"]


# -- the neighbour --------------------------------------------------------------------------------


def _neighbour_of(device: torch.device) -> torch.device | None:
    """A second GPU where there is one, else the CPU; none for a step on the CPU."""
    if device.type == "cpu":
        return None
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return torch.device("cuda", ((device.index or 0) + 1) % torch.cuda.device_count())
    return torch.device("cpu")


def _too_big(model: nn.Module, other: torch.device) -> str | None:
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if size > NEIGHBOUR_MAX_BYTES:
        return f"not copied to {other}: the model's weights and buffers are {size / 2**30:.1f} GiB"
    return None


def _on_device(
    model: nn.Module,
    params: list[torch.Tensor],
    *,
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: Contexts,
    other: torch.device,
    traced: bool,
) -> Run:
    """The step on copies of the weights, buffers and batch on `other` (the user's tensors untouched:
    the copies stand in for them on the module for this run only). A step_fn that makes tensors on
    its own device cannot run there: a failed run, with its error."""

    def there(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != other:
            return value.detach().to(other).requires_grad_(value.requires_grad)
        return value

    try:
        stand_ins: dict[str, torch.Tensor] = {
            name: p.detach().to(other).requires_grad_(p.requires_grad) for name, p in named_parameters(model)
        }
        stand_ins.update({name: b.detach().to(other) for name, b in model.named_buffers()})
        by_id = {id(p): name for name, p in named_parameters(model)}
        judged = [stand_ins.get(by_id.get(id(p), ""), p) for p in params]
        moved = [MicroBatch(m.rng, pytree.tree_map(there, m.args), pytree.tree_map(there, m.kwargs)) for m in window]
        with reparametrized(model, stand_ins, tie_weights=True):
            return _run(model, judged, step_fn, moved, contexts(), traced=traced)
    except Exception as exc:
        return Run("failed", error=f"{type(exc).__name__}: {exc}")
