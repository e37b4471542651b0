"""The training sentinel on a script nobody edits: `fpdoctor watch -- train.py` and `fpdoctor.watch()`.

`ScriptWatch` collects what happens in each optimizer step of every optimizer the script creates,
through torch's own global hooks, and hands it to the step judge (`numerics.step_judge`), which
decides as it does for `fpdoctor.Sentinel` and the framework callbacks. Nothing is set on the
user's objects; the hooks and the two class attributes swapped (`GradScaler.step`, and
`torch.autograd.backward` to see the loss) are put back when the watch ends.

How a step is captured, so that it can be replayed without a `step_fn`:
- every top-level call of a module with trainable parameters made with gradients enabled (a
  training forward; evaluation under `no_grad` is left alone) is noted with references to its
  arguments (not copies), the RNG state before it, the autocast state it ran under, and each
  argument tensor's version counter;
- a hook on each output tensor keeps the gradient that arrives there in the backward: the loss's
  gradient with respect to the model's outputs, scaled as the GradScaler scaled it;
- the loss is what `backward()` was called on (the scaler's scale divided out for the curve).
A replay restores each call's RNG state and autocast, calls the module again on the same
arguments and the pre-step weights under `trace`, and back-propagates the kept output gradients:
the model's forward and backward as they ran, without knowing the loss function. A call whose
argument was written in place after the forward (a data loader reusing its buffers) cannot be
replayed faithfully: the step is then decided without a replay, and the report says why.

A bad step is kept from the weights by setting its optimizer's gradients to None before the step
(torch's optimizers, foreach and fused, then leave weights and state untouched); under a
GradScaler an overflow is the scaler's to skip, counted as AMP's. What this holds per step: one
reference per argument of a training forward and the gradient of each of its outputs (the size of
the model's outputs, e.g. the logits), dropped when the step is decided.

On a GPU with a fused optimizer (`device_skip`) the host does not wait for the check: the step's
flags stay on the device, the optimizer is given them as its `found_inf` (the GradScaler protocol:
it skips a bad step on the device by itself), and they come back asynchronously (pinned memory and
an event). `device_skip=True` does the same for any optimizer: a foreach one's step is undone on the
device where the flag is set (`gradcheck.StepUndo`), at the cost of a copy of the weights and their
optimizer state during the step. The step is decided at the next training forward, before it runs (or at the next
optimizer step, or when the watch ends), replayed from what was kept: its weights were not updated,
its buffers are put back as a host-read step's are. On the CPU a flag costs nothing to read: the
step is decided before `optimizer.step()` by default.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as optimizer_mod
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fpdoctor import catalog
from fpdoctor.integrations import _watch as framework
from fpdoctor.integrations import hf_switch
from fpdoctor.integrations._outputs import KeptGradients, backward_from
from fpdoctor.integrations._toplevel import TopLevelCalls
from fpdoctor.integrations._traced_step import TracedStep
from fpdoctor.numerics.compiled import graphs
from fpdoctor.numerics.observe import amp, autocast_cache, dynamo, scaler_rebuilt, unheld, zero_grads
from fpdoctor.numerics.observe.batches import MicroBatch, OutputsOnly
from fpdoctor.numerics.observe.grad_clears import Cleared, GradClears, Where, call_site, zero_grad_owners
from fpdoctor.numerics.observe.gradcheck import (
    FlagRead,
    HostRead,
    StepUndo,
    grads_of,
    nonfinite_flag,
    nonfinite_now,
    skip_on_device,
    skips_on_device,
)
from fpdoctor.numerics.observe.loader import LoaderBatches
from fpdoctor.numerics.observe.scaler_order import Mixed, ScalerOrder
from fpdoctor.numerics.trace.scaled_grads import ScaledGrads
from fpdoctor.numerics.training import between, distributed, loss_factors, reference
from fpdoctor.numerics.training.findings import (
    scale_upstream,
    scaler_rebuilt_finding,
    some_zero_grads_finding,
    stale_casts_finding,
    unheld_finding,
    zero_grads_finding,
)
from fpdoctor.numerics.training.judge import StepFacts, StepJudge, StepOutcome
from fpdoctor.numerics.training.live import Live, StopRun, in_progress
from fpdoctor.numerics.updates.measure import UpdateProbe, UpdateStats
from fpdoctor.preserve import RngState, preserved
from fpdoctor.report.model import Finding, Report, Severity, Trial
from fpdoctor.torchprivate import pytree, snapshot_optimizer_hooks
from fpdoctor.userframes import called_from, user_frames, user_location

_DEVICE_TYPES = ("cpu", "cuda")


_CLEARS = "checking where zero_grad() runs"  # grad_clears.py
_ORDER = "checking the GradScaler's order"  # what the observer was doing, where it fails (scaler_order.py)


@dataclass
class _Call:
    """One top-level training forward: what its replay needs, by reference."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    autocast: list[tuple[str, torch.dtype]]  # the device types autocast was on for, with their dtype
    versions: list[tuple[torch.Tensor, int]]  # argument tensors and their version counters then
    created_at: int = 0  # the watch's step count when the forward ran
    kept: KeptGradients = field(default_factory=KeptGradients)  # the gradients at its outputs
    output_versions: list[int] = field(default_factory=list)  # its outputs' version counters after the forward
    site: tuple[str, int, str] | None = None  # the user's line that called the model: where a replay's ops ran


class _PerThread(threading.local):
    """Per thread: the top-level training forward in progress (a class default: no AttributeError
    raised and caught where a thread has none)."""

    call: _Call | None = None


CALLS_KEPT = 256  # training forwards kept for a step's replay where no step takes them (micro-batches of one step)
HANDS_KEPT = 256  # backwards' loss constants kept until a step takes them (a loop that never steps reads no more)
NEVER_STEPPED = 20  # training forwards with no backward after any: TRN020

# the summary lines a judge counts for its own optimizer
_PER_OPTIMIZER = ("steps", "non-finite steps", "skipped optimizer steps", "last good step")


@dataclass
class _Run:
    """One optimizer's watch: its judge and the calls since its last step."""

    judge: StepJudge
    params: list[torch.Tensor]
    modules: list[nn.Module]
    number: int  # the optimizer's number, from 1, in the order the script first stepped them
    # low-precision weights: every `probe.every`-th applied step is measured on a sample for updates
    # the dtype rounds away (numerics.updates); the sample taken before the step, read after it
    probe: UpdateProbe | None = None
    sample: Any = None
    device_skip: bool = False  # its bad steps are skipped on the device and decided a step later
    fused: bool = False  # it takes found_inf (else its step is undone on the device: StepUndo)
    # a step the GradScaler skipped leaves its Inf gradients in .grad: (step, scale) of the first such
    # step until the script is seen to zero them, checked when the next training forward starts; and
    # the step they were carried into (the judge replays it from zeroed gradients and says so)
    left: tuple[int, float | None] | None = None
    carried: tuple[int, float | None] | None = None
    groups: tuple[tuple[int, int], ...] = ()  # `_groups(optimizer)` when `params` was made
    optimizer: Any = None
    zeros: zero_grads.ZeroGrads = field(default_factory=zero_grads.ZeroGrads)  # under DDP: reduced to zeros?


# per device: the scale slot of the flags of a step without a scaler (copied by the stack, never written)
_NAN: dict[torch.device, torch.Tensor] = {}


def _nan(device: torch.device) -> torch.Tensor:
    nan = _NAN.get(device)
    if nan is None:
        nan = _NAN[device] = torch.full((), math.nan, device=device)
    return nan


def _trainable(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _mastered(params: list[torch.Tensor], called: list[nn.Module]) -> list[nn.Module]:
    """The module that the optimizer's tensors are master copies of (the pre-AMP recipe: fp32 copies of a
    model's fp16 parameters, stepped by the optimizer and copied back): one whose trainable parameters have
    the same shapes, in order, in a wider dtype. Its forwards are the step's; none where no module fits."""
    shapes = [tuple(p.shape) for p in params]
    fits = []
    for module in dict.fromkeys(called):
        own = [p for p in module.parameters() if p.requires_grad]
        if [tuple(p.shape) for p in own] == shapes and all(
            p.is_floating_point() and q.dtype != p.dtype and torch.finfo(q.dtype).bits > torch.finfo(p.dtype).bits
            for p, q in zip(own, params, strict=True)
        ):
            fits.append(module)
    return fits if len(fits) == 1 else []  # two that fit: whose copies they are cannot be told


def _cleared_by_code(params: list[torch.Tensor]) -> Cleared | None:
    """A step whose gradients are all None though a backward reached the model: the statement between
    the backward and the step that cleared them, read from the source (`p.grad = None` in a loop); None
    where no such statement is there or no parameter requires a gradient any more."""
    trainable = sum(1 for p in params if p.requires_grad)
    seen = between.read() if trainable else None
    found = between.clearing(seen) if seen is not None else None
    if seen is None or found is None:
        return None
    at = user_location(sys._getframe(1))
    return Cleared((seen.path, found[0], at[2] if at else ""), "code", True, trainable, step_at=at, text=found[1])


def _groups(optimizer: Any) -> tuple[tuple[int, int], ...]:
    """Each param group's list and its length: checked on every step for the cost of a few groups,
    where comparing the parameters themselves would cost one look per parameter."""
    return tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)


@dataclass
class _Pending:
    """One optimizer step between its check on the device and its decision on the host."""

    run: _Run
    step: int  # the optimizer's step count, from 1
    flags: FlagRead | HostRead  # the loss flag (`loss_agreed`), the gradients' flag, the scale, this rank's losses
    calls: list[_Call]
    scaler: Any
    skipped_by_scaler: bool
    on_device: bool  # given to the optimizer already, its flag as found_inf (or undone: `undo`)
    undo: StepUndo | None = None
    loss_agreed: bool = False  # the flags' first value is the loss's flag (else the losses are judged on the host)
    hand: loss_factors.StepFactors | None = None  # constants on the loss the gradients should not carry


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a call's arguments; plain tensors passed positionally (the usual forward)
    without pytree's walk, which costs more than the rest of noting the call."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return list(args)
    return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    on = []
    for device in _DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device):
                on.append((device, torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError, AttributeError):  # an older torch, or no such device type
            continue
    return on


class ScriptWatch:
    """Watches every optimizer step of the process while it is entered.

    `replay`: replay bad steps under trace (on by default). `notify`: called with one line when a
    step is skipped or a verdict is reached (the CLI prints it on stderr). `gpu_health`: read the
    GPU's health at the start and on a fault that does not reproduce. `device_skip`: skip bad
    steps on the device and decide them a step later. None (default): on a GPU, for optimizers
    that take `found_inf` (fused ones). True: every optimizer (one that takes no found_inf has its
    step undone on the device, a copy of its weights and state per step). False: never.

    Every finding is said through `notify` when it is decided (`live`, one for all its judges);
    `live.writer`, where its owner sets one, rewrites the report file as findings arrive.
    `stop_on`: the first finding at that severity ends the script at the next optimizer step
    (`StopRun` raised from it, once), after the report file is brought up to date."""

    def __init__(
        self,
        *,
        replay: bool = True,
        notify: Callable[[str], None] | None = None,
        gpu_health: bool = True,
        device_skip: bool | None = None,
        stop_on: Severity | None = None,
        reference_every: int = reference.EVERY,
    ) -> None:
        self.replay = replay
        # the model's backward at steps 1, 1 + N, ... against an fp32 one (reference.py); 0: off
        self.reference_every = reference_every
        self.live = Live(say=notify, stop_on=stop_on)
        self._stopping = False
        self.device_skip = device_skip
        self._pending: list[_Pending] = []  # steps skipped or applied on the device, not yet decided
        self._undo: dict[int, Callable[[], None]] = {}  # id(optimizer) -> its found_inf put back
        self.notify = notify
        self.gpu_health = gpu_health
        self.runs: dict[int, _Run] = {}  # id(optimizer) -> its run
        self.unwatched: dict[str, str] = {}  # what could not be watched, and why
        self.errors: list[Finding] = []
        self._optimizers: list[Any] = []  # held while watched, so their ids stay theirs
        # each optimizer's first step, read by numerics/observe/unheld.py (the optimizer held: its id stays its own)
        self._unheld: dict[int, tuple[Any, unheld.Unheld | None]] = {}
        self._calls: list[_Call] = []
        self._losses: list[torch.Tensor] = []
        # each backward's constant factors on its loss since the last step (loss_factors.py), with the backward's line
        self._hand: list[tuple[loss_factors.Factors | None, Where | None]] = []
        self._trainable: dict[int, bool] = {}
        self._local = _PerThread()
        # the thread whose training is judged: the first that steps an optimizer, or the next to do so once that
        # one has ended (trials run one after another, a thread each). One step's forwards, backward and step are
        # one thread's; another thread's, interleaved with them, would be judged as this one's (its losses, its
        # steps' order, its replays): they pass through, and the report names each thread that stepped so
        self._thread: threading.Thread | None = None
        self._traced = TracedStep()  # a step traced after a bad step its replay could not explain
        self._penalty: ScaledGrads | None = None  # autograd.grad of a scaled output, seen (a gradient penalty)
        self._top = TopLevelCalls(self._pre, self._post)
        self._scaler_now: dict[int, Any] = {}  # id(optimizer) -> the GradScaler stepping it now
        self._scalers: dict[int, scaler_rebuilt.Scalers] = {}  # id(optimizer) -> the scalers that stepped it
        self._stale = autocast_cache.StaleCasts()  # autocast's cast cache across steps (an epoch-long block)
        self._order = ScalerOrder()  # the script's unscale_, update() and backwards, in their order
        self._held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # a skipped step's gradients, by optimizer
        self._clears = GradClears()  # zero_grad() between a backward and the optimizer's step (grad_clears.py)
        # what the script gave scaler.scale() since the last step, by id: (the tensor, the line); and a backward
        # run on one of them, not on what scale() returned: (the backward's line, scale()'s line)
        self._scale_given: dict[int, tuple[weakref.ref[torch.Tensor], Where | None]] = {}
        self._unscaled: tuple[Where | None, Where | None] | None = None
        self._mixed: dict[int, Mixed] = {}  # id(optimizer) -> its step in progress mixes unscaled gradients
        self._judged: set[int] = set()  # optimizers judged inside the scaler's step in progress
        self._replaying = False
        self._stack: contextlib.ExitStack | None = None
        self._told: dict[str, int] = {}  # bad-step lines said, by verdict
        self._before: set[int] = set()
        self._event = 0  # optimizer steps (of any optimizer) seen so far: when each forward's backward ran
        self._forwards = 0  # training forwards seen (training mode, trainable, gradients on) ...
        self._reached = 0  # ... and those a backward reached: none of many is a script that never trains
        self._optimized = False  # at the NEVER_STEPPED-th of them, none reached: an optimizer holds the model's
        # at the NEVER_STEPPED-th of them, no optimizer stepped: a few values of the model's first weights, to
        # tell at the report whether code of the script's own updated them (TRN033)
        self._weights: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._optimizer_steps = 0  # torch.optim steps of any kind seen: none, and the weights changed, is TRN033
        self._graphs_at_start = _graphs_compiled()

    # -- entering and leaving --------------------------------------------------------------------
    def __enter__(self) -> ScriptWatch:
        if self._stack is not None:  # `with fpdoctor.watch() as w`: watch() entered it already
            return self
        stack = contextlib.ExitStack()
        try:
            # torch.compile'd code compiles as it would without the watch (numerics/observe/dynamo.py)
            dynamo.keep_out(dynamo.fpdoctor_modules())
            stack.callback(dynamo.quiet_wrapper_warning())
            stack.callback(graphs.watching())  # each compiled graph checked once a judge is made
            # the top-level module calls only: the submodule calls inside them pay nothing
            stack.callback(self._top.close)
            self._top.start()
            # torch iterates its global optimizer hooks at every step of every thread, and a replay's hooks
            # come and go inside one: read as snapshots while the watch is on, no step sees its dict change
            stack.enter_context(snapshot_optimizer_hooks(optimizer_mod))
            stack.callback(register_optimizer_step_pre_hook(self._before_step).remove)
            stack.callback(register_optimizer_step_post_hook(self._after_step).remove)
            stack.enter_context(self._swapped(torch.autograd, "backward", self._backward_of))
            scaler = amp.grad_scaler_class()
            stack.enter_context(self._swapped(scaler, "step", self._scaler_step_of))
            stack.enter_context(self._swapped(scaler, "scale", self._scale_of))
            # the script's unscale_ and update() calls: a backward between an unscale_ and the step (scaler_order.py)
            stack.enter_context(self._swapped(scaler, "unscale_", self._unscale_of))
            stack.enter_context(self._swapped(scaler, "update", self._update_of))
            for owner in zero_grad_owners():  # a zero_grad() after the backward leaves the step no gradient
                stack.enter_context(self._swapped(owner, "zero_grad", self._zero_grad_of))
            # a gradient penalty on the gradients of a GradScaler-scaled output: its loss reads gradients
            # that overflow at the scaler's first scales (calibration, not a bug), and whether the code
            # unscales them the step traced once tells
            self._penalty = stack.enter_context(ScaledGrads(lambda: 0, reads=False))
            # the dataset indices of each DataLoader batch: a replayed bad step names its items
            stack.enter_context(LoaderBatches())
            # a Hugging Face Trainer made inside gets the fpdoctor callback, which judges its steps
            stack.enter_context(hf_switch.callback_in_trainers(self._error))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._before = set(map(id, framework.ACTIVE))  # callbacks of earlier trainings are not this run's
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._decide_pending()  # the last steps, whose flags are still on their way
            for undo in list(self._undo.values()):  # an optimizer whose step raised keeps no flag of ours
                self._guarded(undo, "putting the optimizer's step back")
            self._undo.clear()
        finally:  # whatever failed, no hook or swapped function of the watch outlives it
            if self._traced.running:  # the script ended between the traced forward and its backward
                self._finish_trace()
            if self._stack is not None:
                self._stack.close()
                self._stack = None
        for run in self.runs.values():  # the compiled-output checks on the script's compiled modules
            run.judge.close()
        self._calls, self._losses, self._hand = [], [], []

    @staticmethod
    @contextlib.contextmanager
    def _swapped(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
        """`owner.name` replaced by `make(original)` inside the block, put back as it was after."""
        own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        try:
            yield
        finally:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    # -- what the script does ----------------------------------------------------------------------
    def _mine(self, steps: bool = False) -> bool:
        """Whether the calling thread is the one whose training is judged (any thread, until one has
        stepped an optimizer, or once that one has ended); `steps`: the call steps an optimizer, which
        makes the thread that one where none is, or where that one has ended."""
        thread = threading.current_thread()
        judged = self._thread
        if judged is thread:
            return True
        if judged is None or not judged.is_alive():  # none yet, or it has ended: the next one's forwards count
            if steps:
                self._thread = thread
            return True
        if steps:
            self.unwatched.setdefault(
                f"training in thread {thread.name!r}",
                f"watch judges one training thread at a time ({judged.name!r} here): the forwards, backward and "
                "step of another, interleaved with its own, would be judged as its; run each thread's loop under "
                "fpdoctor.Sentinel (docs/sentinel.md), which judges the steps it is given in any thread",
            )
        return False

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Before a top-level module call (`TopLevelCalls`)."""
        self._local.call = None
        if self._replaying or not torch.is_grad_enabled():
            return
        try:
            if not self._is_trainable(module):
                return
            if not self._mine():  # a forward with gradients on in another thread: not one of the judged steps
                thread = threading.current_thread()
                self.unwatched.setdefault(
                    f"forwards in thread {thread.name!r}",
                    "training forwards (gradients on) ran there while watch judged the steps of another thread: "
                    "they are in none of its checks or replays; where they feed its steps (a thread pool inside "
                    "one step), run the loop under fpdoctor.Sentinel (docs/sentinel.md)",
                )
                return
            if self._pending:
                # the steps decided on the device are looked at before the next training forward
                # writes the buffers (a bad one's are put back) or draws from the RNG
                self._decide_pending()
            self._still_left()
            # its RNG and autocast state before it runs
            call = _Call(module, (), {}, RngState.capture(), _autocast_state(), [], created_at=self._event)
            call.site = user_location(sys._getframe())
            if call.autocast and not self._stale.done:  # does the cast cache outlive the optimizer's steps?
                frames = functools.partial(user_frames, sys._getframe())
                self._guarded(lambda: self._stale.at_forward(self._event, call.autocast, frames), _STALE)
            call.kept.clock = self._clock
            self._local.call = call
            if self._traced.running and self._traced.closing:  # its optimizer stepped: the trace ends here
                self._finish_trace()
            if self._traced.armed_by is not None and not self._traced.done:
                self._traced.start(module, 1 + max((r.judge.steps for r in self.runs.values()), default=0))
        except Exception as exc:
            self._error("noting a forward", exc)

    def _still_left(self) -> None:
        """At a training forward after a step the scaler skipped: are its gradients still in .grad (a
        host read after a skipped step only)? Then the next step carries them, whatever it computes."""
        for run in self.runs.values():
            if run.left is None or run.carried is not None:
                continue
            if nonfinite_flag(grads_of(run.params), run.judge.device).item():
                run.carried = run.left
            else:
                run.left = None  # the script zeroes its gradients: nothing is carried

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any = None) -> None:
        """After a top-level module call; called without `output` when the forward raised."""
        call = self._local.call
        if call is None or call.module is not module:
            return
        self._local.call = None
        try:
            if output is None:  # the forward raised (the script may catch it and go on): nothing to keep
                return
            call.args, call.kwargs = tuple(args), dict(kwargs)
            call.versions = [(t, t._version) for t in _tensors(args, kwargs)]
            call.kept.watch(output)
            call.output_versions = [t._version for t in call.kept.originals]  # shared with the outputs
            if call.kept.outputs:
                self._forwards += module.training
                if self._forwards == NEVER_STEPPED and not self._reached and not self.runs:  # once, while it runs
                    self._optimized = _optimized(module)
                if self._forwards == NEVER_STEPPED and not self._optimizer_steps:
                    self._weights = _first_values(module)
                self._calls.append(call)
                if len(self._calls) > CALLS_KEPT:  # forwards no step took (a loop that skips them): the latest
                    del self._calls[0]
        except Exception as exc:
            self._error("noting a forward's outputs", exc)

    def _clock(self) -> int:
        return self._event

    def _is_trainable(self, module: nn.Module) -> bool:
        key = id(module)
        known = self._trainable.get(key)
        if known is None:
            known = any(p.requires_grad for p in module.parameters())
            self._trainable[key] = known
        return known

    def _backward_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self._replaying or dynamo.compiling() or not self._mine():
                return original(tensors, *args, **kwargs)
            loss: torch.Tensor | None = None
            waiting: list[tuple[_Call, int]] = []
            try:
                for t in [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ()):
                    if isinstance(t, torch.Tensor) and t.numel() == 1:
                        loss = t.detach()
                        loss = (loss.reshape(()) if loss.dim() else loss).float()  # a view op less for a 0-d loss
                        self._losses.append(loss)
                # every forward this backward reaches (one an autograd.grad went through before included)
                waiting = [(c, c.kept.fills) for c in self._calls]
            except Exception as exc:
                self._error("reading the loss", exc)
            if loss is not None and isinstance(tensors, torch.Tensor) and len(self._hand) < HANDS_KEPT:
                # `(loss * 1024 / accum).backward()`: the constants on the loss, read from its autograd root
                caller = sys._getframe(1)
                self._guarded(lambda: self._hand_of(tensors, caller), "reading the loss's constants")
            after = self._order_check()
            result = original(tensors, *args, **kwargs)
            self._clears.backward(call_site(sys._getframe(1)))
            if self._scale_given and isinstance(tensors, torch.Tensor):  # the loss scale() was given, not its result
                given = self._scale_given.get(id(tensors))
                if given is not None and given[0]() is tensors:
                    self._unscaled = (user_location(sys._getframe(1)), given[1])
            if after is not None:
                self._guarded(after, _ORDER)
            for call, fills in waiting:  # the forwards this backward reached: this loss is theirs
                if call.kept.fills != fills:
                    self._reached += call.kept.loss is None and call.module.training
                    call.kept.loss = loss
            if self._traced.running and not self._traced.until_step:
                self._finish_trace()
            return result

        return backward

    def _hand_of(self, root: torch.Tensor, frame: Any) -> None:
        factors = loss_factors.of_root(root) if root.grad_fn is not None else None
        self._hand.append((factors, user_location(frame) if factors else None))

    def _scaler_step_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            key = id(optimizer)
            # a disabled scaler is no scaler: its step() is the optimizer's
            if not amp.enabled(scaler) or not self._mine(steps=True):
                return original(scaler, optimizer, *args, **kwargs)
            self._scaler_now[key] = scaler
            seen = self._scalers.get(key)
            if seen is None:
                seen = self._scalers[key] = scaler_rebuilt.Scalers()
            seen.stepped(scaler)
            self._judged.discard(key)
            self._note_order(optimizer)
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                self._scaler_now.pop(key, None)
                if key not in self._judged:  # skipped by the scaler: no optimizer hook ran
                    self._guarded(lambda: self._stepping(optimizer))
                    self._guarded(lambda: self._step(optimizer, scaler=scaler, skipped_by_scaler=True))
                self._judged.discard(key)
                self._stop_here()

        return step

    def _scale_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and result is not outputs and amp.enabled(scaler) and self._mine():
                if len(self._scale_given) >= 64:  # steps taken with a closure (Lightning's) never clear it
                    self._scale_given.clear()
                given = (weakref.ref(outputs), user_location(sys._getframe(1)))
                self._guarded(lambda: self._scale_given.__setitem__(id(outputs), given), _ORDER)
            return result

        return scale

    def _unscale_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def unscale_(scaler: Any, optimizer: Any) -> Any:
            result = original(scaler, optimizer)
            # the script's own call; the one scaler.step() makes for itself is the step's
            if amp.enabled(scaler) and not self._replaying and id(optimizer) not in self._scaler_now and self._mine():
                self._guarded(lambda: self._order.unscaled(scaler, optimizer, user_location(sys._getframe(1))), _ORDER)
            return result

        return unscale_

    def _update_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(scaler, *args, **kwargs)
            if amp.enabled(scaler) and not self._replaying and self._mine():
                self._guarded(lambda: self._order.updated(user_location(sys._getframe(1))), _ORDER)
            return result

        return update

    def _zero_grad_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        # its signature as torch's (accelerate reads zero_grad's parameters for set_to_none)
        @functools.wraps(original)
        def zero_grad(owner: Any, *args: Any, **kwargs: Any) -> Any:
            # only then is its line looked up
            if self._clears.after_backward and not self._replaying and self._mine():
                self._guarded(lambda: self._clears.zero_grad(owner, user_frames(sys._getframe(2))), _CLEARS)
            return original(owner, *args, **kwargs)

        return zero_grad

    def _order_check(self) -> Callable[[], None] | None:
        """Before a backward: what checks, after it, whether it added to gradients already unscaled."""
        try:
            return self._order.around_backward()
        except Exception as exc:
            self._error(_ORDER, exc)
            return None

    def _note_order(self, optimizer: Any) -> None:
        """At an optimizer's step (once, the scaler's or the optimizer's own): its unscale_ record closed."""
        try:
            mixed = self._order.stepped(optimizer, user_location(sys._getframe(1)))
        except Exception as exc:
            self._error(_ORDER, exc)
            return
        if mixed is not None:
            self._mixed[id(optimizer)] = mixed

    def _stepping(self, optimizer: Any) -> None:
        """An optimizer's step, taken or skipped by its scaler: the traced step's end where it was
        its optimizer's; after a gradient penalty on scaled gradients was seen, the first step's
        optimizer (the one the penalty's loss feeds) has its next step traced."""
        self._traced.stepped(optimizer)
        if self._penalty is not None and self._penalty.calls and not self._traced.done:
            params = {id(p) for g in optimizer.param_groups for p in g["params"]}
            run = self.runs.get(id(optimizer))
            self._traced.arm(run.judge.steps + 1 if run is not None else 1, params, penalty=True)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if dynamo.compiling():  # a step traced into a graph: judged where it runs eagerly, or not at all
            return
        if not self._mine(steps=True):
            return
        self._optimizer_steps += 1  # any torch.optim step, judged here or not (a callback's, a closure's)
        key = id(optimizer)
        scaler = self._scaler_now.get(key)
        self._judged.add(key)
        if scaler is None:  # optimizer.step() called by the script itself
            self._note_order(optimizer)
        self._stepping(optimizer)
        # step(closure): LBFGS, Lightning's loop (args holds the optimizer itself first)
        if (len(args) > 1 or kwargs) and any(callable(a) for a in (*args[1:], *kwargs.values())):
            # the forward and backward run inside step(), after this hook: there is nothing to judge yet
            self._calls, self._losses, self._hand = [], [], []
            self.unwatched.setdefault(
                f"optimizer {type(optimizer).__name__}",
                "it steps with a closure (forward and backward run inside step()); with Lightning the "
                "fpdoctor callback judges its steps (switched on by `fpdoctor watch`)",
            )
            return
        self._decide_pending()  # a step with no training forward since the last one
        self._guarded(lambda: self._step(optimizer, scaler=scaler, skipped_by_scaler=False))
        self._stop_here()

    def _stop_here(self) -> None:
        """At an optimizer step, once: a finding at the `stop_on` level ends the script (`StopRun`),
        the report file first brought up to date."""
        stopped = self.live.stopped
        if stopped is None or self._stopping or self._replaying:
            return
        self._stopping = True
        self._guarded(lambda: self.live.settle(now=True), "writing the report file")
        raise StopRun(stopped)

    def _guarded(self, do: Callable[[], None], doing: str = "checking the step") -> None:
        try:
            do()
        except Exception as exc:  # the observer never kills the job
            self._error(doing, exc)

    # -- the step --------------------------------------------------------------------------------
    def _read_unheld(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        """At an optimizer's first step: whether it holds tensors no forward used while the forward trains
        parameters it lacks; the parameters it holds are not missing from the optimizers read before."""
        for _, found in self._unheld.values():
            if found is not None:
                unheld.held_by(found, params)
        found = unheld.read(optimizer, params, [c.module for c in self._calls])
        if found is not None:
            found.files = [path for path, _, _ in user_frames(sys._getframe())]
            found.called = unheld.name_in(sys._getframe(), optimizer) or found.called
        self._unheld[id(optimizer)] = (optimizer, found)

    def _stale_cost(self, call: _Call) -> None:
        """The cast cache outlived a step (numerics/observe/autocast_cache.py): this step's last forward run
        again with the weights cast afresh, against the outputs the script got (where neither its inputs nor
        its outputs were written since)."""
        found = self._stale.found
        if found is None or any(t._version != v for t, v in call.versions):
            return
        if any(t._version != v for t, v in zip(call.kept.originals, call.output_versions, strict=False)):
            return  # the script wrote an output in place (a mask filled in): not what the forward returned
        device_type, dtype = next(((d, t) for d, t in call.autocast if d == found.device_type), call.autocast[0])
        self._replaying, saved = True, self._replaying
        try:
            # nested in the script's block: its cast cache is neither read nor added to
            cast = torch.autocast(device_type, dtype=dtype, cache_enabled=False)
            # a DDP model's forward without its buffers' broadcast: this rank alone
            with torch.no_grad(), distributed.local_replay(call.module), preserved(call.module), cast:
                call.rng.restore()
                output = call.module(*call.args, **call.kwargs)
        finally:
            self._replaying = saved
        fresh = autocast_cache.floats(pytree.tree_leaves(output))
        measured = autocast_cache.difference(call.kept.originals, fresh)
        if measured is not None and measured > autocast_cache.MOVED:  # else no weight has moved since the cast
            found.difference, found.measured_at = measured, self._event + 1

    def _rebuilt_scalers(self) -> list[Finding]:
        """TRN029 for each watched optimizer stepped by a new GradScaler on most of its steps."""
        out = []
        for run in self.runs.values():
            seen = self._scalers.get(id(run.optimizer))
            if seen is not None and seen.rebuilt:
                skipped = run.judge.amp.skipped
                out.append(scaler_rebuilt_finding(seen, skipped, type(run.optimizer).__name__, here=run.judge.here))
        return out

    def _unheld_findings(self, here: dict[str, Any]) -> list[Finding]:
        """TRN025 for each optimizer whose first step found parameters outside every optimizer that stepped."""
        out = []
        for _, found in self._unheld.values():
            if found is not None and found.decided:
                names = list(found.missing)
                line = unheld.assignment(unheld.owner(names), found.files)
                out.append(unheld_finding(found, line, here=here))
        return out

    def _run_of(self, optimizer: Any) -> _Run | None:
        run = self.runs.get(id(optimizer))
        if run is not None:
            return run
        params = _trainable(optimizer)
        if id(optimizer) not in self._unheld:
            self._guarded(lambda: self._read_unheld(optimizer, params), "reading which parameters the optimizer holds")
        if params and any(p is q for w in list(framework.ACTIVE) for q in w._params for p in params[:1]):
            return None  # a framework callback judges this optimizer's steps: one judge per step
        owned = {id(p) for p in params}
        modules: list[nn.Module] = []
        for call in self._calls:
            if call.module not in modules and any(id(p) in owned for p in call.module.parameters()):
                modules.append(call.module)
        if not modules:  # master weights of the script's own: fp32 copies of a model's fp16/bf16 parameters
            # of the module a backward reached this step (a target network run beside it, detached, is not)
            modules = _mastered(params, [c.module for c in self._calls if c.kept.filled_at is not None])
        if not modules:
            why = "its parameters were in no training forward of a module seen before its first step"
            self.unwatched.setdefault(f"optimizer {type(optimizer).__name__}", why)
            return None
        model = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        judge = StepJudge(
            model,
            hooked=model,
            optimizer=optimizer,
            replay=self.replay,
            with_scaler=False,
            views="FSDP, a communication hook of the script's own, or a DDP model built after the first step",
            gpu_health=self.gpu_health,
            live=self.live,
        )
        judge.reference_every = self.reference_every
        self._optimizers.append(optimizer)
        run = _Run(judge, params, modules, len(self.runs) + 1, groups=_groups(optimizer), optimizer=optimizer)
        # on a GPU by default where the optimizer skips by itself (found_inf, no cost); asked for,
        # any optimizer, its step undone on the device (a copy of its weights and state per step)
        run.fused = skips_on_device(optimizer)
        run.device_skip = self.device_skip is True or (
            self.device_skip is None and judge.device.type == "cuda" and run.fused
        )
        try:
            probe = UpdateProbe(model, optimizer)
            if probe.low_precision:
                run.probe = probe
                why_not = probe.why_not or (
                    "the optimizer is stepped on the device (device-side skipping)" if run.device_skip else None
                )
                judge.expects_updates = why_not is None  # the last finite window kept for the what-if
                if why_not is not None:  # said once; the check stays off for this optimizer
                    stats = UpdateStats(0, type(optimizer).__name__, why_not=why_not)
                    judge.updates(stats, every=probe.every)
                    run.probe = None
        except Exception as exc:
            judge.error("preparing the update check", exc)
        self.runs[id(optimizer)] = run
        return run

    def _step(self, optimizer: Any, *, scaler: Any, skipped_by_scaler: bool) -> None:
        run = self._run_of(optimizer)
        # A step's forwards are those whose backward ran since the last optimizer step (of any
        # optimizer): a GAN's generator forward waits for its own step past the discriminator's,
        # and a discriminator forward whose backward fed the generator's step is not the next one's.
        now = self._event
        current = [
            c for c in self._calls if c.kept.filled_at == now or (c.kept.filled_at is None and c.created_at == now)
        ]
        losses = self._losses
        self._losses = []
        hands, self._hand = self._hand, []
        if run is None:
            self._calls = current
            self._event += 1
            return
        groups = _groups(optimizer)
        if groups != run.groups:  # add_param_group, or a group's list replaced: the list is made again
            run.params, run.groups = _trainable(optimizer), groups
        judge = run.judge
        if judge.recipe is not None:  # the optimizer's recipe (numerics/training/recipe.py): a few floats a step
            try:
                judge.recipe.step(judge.steps, run.params, judge.model, sys._getframe())
            except Exception as exc:  # the observer never kills the job
                self._error("reading the optimizer's recipe", exc)
        judge.finish_update()  # what the weights kept of a reference step's update, before they change again
        mine = [c for c in current if c.kept.filled_at == now and any(c.module is m for m in run.modules)]
        self._calls = [c for c in current if not any(c is m for m in mine)]
        found = self._stale.found
        # what the stale casts cost the step's forward: at the step found, 10 and 100 steps later (no weight may
        # have moved yet: steps a GradScaler skipped, a warm-up from lr 0)
        due = found is not None and found.difference is None and judge.steps + 1 - found.step in (0, 10, 100)
        if due and mine and mine[-1].autocast:
            self._guarded(lambda: self._stale_cost(mine[-1]), _STALE)
        self._event += 1
        device = judge.device
        on_device = run.device_skip and not skipped_by_scaler
        flags: FlagRead | HostRead
        grads = grads_of(run.params)
        # what the optimizer received: under DDP, the reduction's (which no local replay recomputes); on one
        # process too, where a loss the script made 0 (a count that overflowed fp16 dividing it) hands the
        # model's outputs zero gradients, which the reference step, replayed from them, cannot tell apart
        if judge.steps + 1 in zero_grads.SAMPLED:
            named = {id(p): n for n, p in run.judge.model.named_parameters()}
            names = [named.get(id(p), "?") for p in run.params if p.grad is not None]
            self._guarded(lambda: run.zeros.sample(judge.steps + 1, grads, names), "reading the gradients")
            run.zeros.low_precision |= any(c.autocast for c in mine) or any(
                p.dtype in (torch.float16, torch.bfloat16) for p in run.params
            )
            if judge.distributed and run.zeros.zero and run.zeros.local is None and mine:  # what the hook did, once
                self._guarded(lambda: self._local_gradients(run, judge.steps + 1, mine), "replaying the step locally")
        with torch.no_grad():
            if device.type == "cpu" and not (judge.distributed or on_device):
                # the usual CPU step: flags read at once, no tensor made (each small op is a few us)
                scale_read = float(amp.scale_tensor(scaler, device)) if scaler is not None else math.nan
                flags = HostRead(nonfinite_now(grads), scale_read, losses)
            else:
                grad = nonfinite_flag(grads, device)
                scale = amp.scale_tensor(scaler, device) if scaler is not None else _nan(device)
                # [loss, gradients, scale, losses]: the losses come back anyway and are judged on the host,
                # unless the loss's flag is needed on the device, agreed across ranks or given to the optimizer
                if judge.distributed or on_device:
                    loss_t = torch.stack([t.to(device) for t in losses]) if losses else torch.zeros(0, device=device)
                    agreed = torch.stack([torch.isfinite(loss_t).all().logical_not().float(), grad])
                    if judge.distributed:  # every rank skips, or none: replicas stay equal
                        agreed = judge.corruption.exchange(agreed, judge.steps + 1)  # each rank's gradient norm too
                    # on its way to the host before the optimizer's kernels are queued
                    flags = FlagRead(torch.cat([agreed, scale.reshape(1), loss_t]))
                else:  # the usual GPU step: one stack on its way to the host
                    flags = FlagRead(torch.stack([grad, grad, scale, *(t.to(device) for t in losses)]))
        judge.steps += 1
        judge.micro_batches += len(mine)
        if self._clears.noted:  # a zero_grad() after the backward, confirmed at the step by its gradients
            at = user_location(sys._getframe(1))
            self._guarded(lambda: judge.cleared_step(judge.steps, self._clears.stepped(optimizer, at)), _CLEARS)
        else:
            self._clears.passed(optimizer)
            if mine and run.params and not grads:
                # a backward reached the model and left no gradient: code cleared them, where a statement between
                # the backward and the step says so (an expert no token reached, a head whose task the batch
                # lacked, a frozen backbone have no gradient either, and no such line)
                self._guarded(lambda: judge.cleared_step(judge.steps, _cleared_by_code(run.params)), _CLEARS)
        unscaled, self._unscaled = self._unscaled, None
        hand = loss_factors.of_step(hands, scaler=scaler is not None)
        self._scale_given.clear()
        if unscaled is not None and scaler is not None:  # its step divided gradients the loss never multiplied
            self._guarded(lambda: judge.unscaled_backward(judge.steps, *unscaled, scaler=scaler), _ORDER)
        mixed = self._mixed.pop(id(optimizer), None)
        if mixed is not None:  # the reference step measures what it cost (unscaled_twice.py)
            judge.mixed_step(judge.steps, mixed)
        pending = _Pending(run, judge.steps, flags, mine, scaler, skipped_by_scaler, on_device, hand=hand)
        pending.loss_agreed = judge.distributed or on_device
        if on_device:  # the optimizer skips a bad step by itself, or it is undone; the host looks a step later
            self._undo.pop(id(optimizer), lambda: None)()
            if run.fused:
                self._undo[id(optimizer)] = skip_on_device(optimizer, agreed[1])
            else:
                pending.undo = StepUndo(optimizer, agreed[1])
                self._undo[id(optimizer)] = pending.undo.undo
        if on_device:
            self._pending.append(pending)
        else:
            with self._traced.aside():
                self._decide(pending)

    def _decide_pending(self) -> None:
        pending, self._pending = self._pending, []
        with self._traced.aside():
            for one in pending:
                self._guarded(functools.partial(self._decide, one))

    def _decide(self, pending: _Pending) -> None:
        """The step's flags, read once, to the judge; then what its verdict asks of the optimizer."""
        run, mine, scaler, skipped_by_scaler = pending.run, pending.calls, pending.scaler, pending.skipped_by_scaler
        judge = run.judge
        step = pending.step
        values = pending.flags.values()
        mine_bad = not math.isfinite(sum(values[3:]))  # this rank's losses (a NaN or an Inf makes the sum one)
        bad_loss, bad_grad = values[0] > 0 if pending.loss_agreed else mine_bad, values[1] > 0
        if pending.undo is not None:  # before anything can fail: the next step starts from the right state
            pending.undo.settle(bad_grad)  # undone on the device where the gradients were bad
        scale_value = values[2] if scaler is not None else None
        curve = [v / scale_value if scale_value else v for v in values[3:]]
        finite_curve = [v for v in curve if math.isfinite(v)]
        loss_value = (
            (sum(curve) / len(curve) if curve else math.nan)
            if not finite_curve or mine_bad
            else sum(finite_curve) / len(finite_curve)
        )
        if skipped_by_scaler:
            bad_grad = True  # the scaler found the Inf itself: its found_inf decided
        if bad_loss or bad_grad:  # host reads, bad steps only, outside the replay's trace
            for c in mine:
                c.kept.read_finite()
                c.kept.loss_bad = c.kept.loss is not None and not bool(torch.isfinite(c.kept.loss))
        facts = StepFacts(
            step,
            bad_loss=bad_loss,
            bad_grad=bad_grad,
            penalty=bool(self._penalty is not None and self._penalty.calls),
            local_loss=mine_bad,
            loss_value=loss_value,
            window=[MicroBatch(c.rng, (c, *c.args), dict(c.kwargs)) for c in mine],
            step_fn=self._replay_call,
            contexts=lambda: [distributed.local_replay(judge.model), self._replaying_now()],
            scale=scale_value,
            next_scale=scale_value * float(scaler.get_backoff_factor())
            if scaler is not None and scale_value is not None and bad_grad and not bad_loss
            else None,
            micro=None,
            micro_batches=len(mine),
            stepped=pending.on_device,
            why_not=self._why_not(mine),
            what_if_fn=self._what_if_call,
            what_if_loss="the loss to first order (the step's loss plus the gradient at the model's outputs times how "
            "far they moved: the watch knows no loss function)",
            carried=run.carried,
        )
        run.carried = None
        outcome = judge.judge(facts)
        if not outcome.finite and self._traced.armed_by is None and not self._traced.done:
            # a replay (this step's, or one a run of scaler skips asked for) that named no checked cause
            named = [f for f in judge.findings if f.name == "deterministic-nonfinite"]
            last = named[-1] if named else None
            weights = last is not None and "parameters" in last.evidence  # the weights themselves are NaN/Inf
            if (
                last is not None
                and not weights
                and not last.where.get("op")
                and not (last.trial is not None and last.trial.tried)
            ):
                # the model alone named no op (the loss code made it): trace this optimizer's next step; not
                # from weights already NaN/Inf, where a trace finds them alone (the update that made them is named)
                self._traced.arm(step, {id(p) for p in run.params})
        if outcome.finite:  # the outputs' format: what the reference step's replay cannot see
            self._guarded(lambda: judge.outputs_read(step, [t for c in mine for t in c.kept.originals]),
                          "reading the training outputs")  # fmt: skip
            # and the inputs' (raw readings cast before the model), the last forward's tensor arguments
            inputs = [t for t in _tensors(mine[-1].args, mine[-1].kwargs) if t.is_floating_point()] if mine else []
            self._guarded(lambda: judge.inputs_read(step, inputs), "reading the training inputs")
        if self._penalty is not None and self._penalty.create_graph and judge.reference_off is None:
            judge.reference_off = (
                "the loss reads gradients (torch.autograd.grad with create_graph=True: a gradient penalty), which "
                "a replay from the gradients at the model's outputs cannot redo; `fpdoctor trace` runs the code"
            )
        if (
            outcome.finite
            and not pending.on_device  # the optimizer has stepped: the weights the step started from are gone
            and facts.why_not is None
            and judge.optimizer is not None
            and judge.reference_due(step)
        ):
            try:  # the model's backward from the gradients that reached its outputs, against an fp32 one
                judge.reference(step, optimizer=judge.optimizer, scaler=scaler, step_fn=self._replay_call,
                                window=facts.window, contexts=facts.contexts, backward_only=True,
                                scale_carried=True, final_gradients=True, hand=pending.hand)  # fmt: skip
            except Exception as exc:  # the observer's own failure: a finding, the step goes on
                judge.error("comparing the step with the reference step", exc, step)
        # a step that unscaled before its last backward and that no reference step measured: said untried
        why_not = (
            judge.reference_off
            or facts.why_not
            or (
                "the optimizer stepped on the device before the step could be replayed"
                if pending.on_device
                else "its loss or gradients were not finite"
            )
        )
        judge.mixed_step_said(step, why_not=why_not)
        if outcome.finite:
            run.left = None
        elif outcome.verdict == "amp-skip" and run.left is None:
            run.left = (step, scale_value)
        # a non-finite gradient is kept from the weights (a GradScaler's own step finds it itself); a
        # non-finite loss whose gradients are finite makes a finite update, applied as the script does
        # (with a scaler, here only where it stepped: a scale whose reciprocal is Inf lets NaN through)
        if bad_grad and not skipped_by_scaler and not pending.on_device:
            # kept from the weights: torch's optimizers skip a parameter without a gradient; given back after the
            # step, so that the script's own reads of them (a norm it logs) see what they were
            held = [(p, p.grad) for p in run.params if p.grad is not None]
            for p, _ in held:
                p.grad = None
            self._held[id(run.optimizer)] = held
        # the buffers as they are now: the next step's bad forward is undone to here (the first step
        # has no snapshot to undo to: its forward ran before the watch knew its model); a reference
        # step's weights are judged at the next optimizer step, once this one has stepped
        judge.begin_window(finish=False)
        self._tell(run, outcome)
        probe = run.probe
        if probe is not None and outcome.finite and not skipped_by_scaler and probe.due(step):
            try:  # the sample and the step's intended update in fp32, before the step applies it
                run.sample = probe.before(step)
            except Exception as exc:
                run.sample = None
                judge.error("measuring the optimizer's updates", exc)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._mine():
            return
        for p, grad in self._held.pop(id(optimizer), ()):  # a skipped step's gradients, as the backward left them
            if p.grad is None:
                p.grad = grad
        undo = self._undo.pop(id(optimizer), None)
        if undo is not None:  # the optimizer has taken the flag: nothing of ours stays on it
            self._guarded(undo, "putting the optimizer's step back")  # never raised into the user's step
        run = self.runs.get(id(optimizer))
        if run is not None:
            self._guarded(run.judge.watch_update_writes, "watching the writes after a reference step")
        if run is None or run.probe is None or run.sample is None:
            return
        sample, run.sample = run.sample, None
        try:
            run.probe.after(sample)
            run.judge.updates(run.probe.read(sample), every=run.probe.every)
        except Exception as exc:
            run.judge.error("measuring the optimizer's updates", exc)
        if self._scaler_now.get(id(optimizer)) is None:  # inside a GradScaler's step: at its end
            self._stop_here()

    def _why_not(self, calls: list[_Call]) -> str | None:
        if not calls:
            return "no training forward of the model was seen in this step"
        for call in calls:
            if any(t._version != v for t, v in call.versions):
                return "an input of the forward was written in place after it ran (a data loader reusing its buffers?)"
            if not call.kept.complete:
                return "the gradient of an output of the forward was not seen (a backward through torch.autograd.grad?)"
        return None

    def _local_gradients(self, run: _Run, step: int, calls: list[_Call]) -> None:
        """Every gradient the reduction handed over is 0 and the DDP model casts them in a communication hook:
        the step's forwards and backwards replayed on this rank without the reduction, and what the hook's
        cast makes of their gradients against bf16's (zero_grads.flushed). The step's own gradients are put
        back: the optimizer steps on what the reduction gave it."""
        hook = distributed.compressing_hook(run.judge.model)
        if hook is None or any(t._version != v for c in calls for t, v in c.versions):
            return
        saved = [(p, p.grad) for p in run.params]
        try:
            for p in run.params:
                p.grad = None
            with self._replaying_now(), distributed.local_replay(run.judge.model), preserved(run.judge.model):
                for call in calls:
                    call.rng.restore()
                    self._replay_call(call, *call.args, **call.kwargs)
            local = [p.grad.detach() for p in run.params if p.grad is not None and p.grad.is_floating_point()]
        finally:
            for p, g in saved:
                p.grad = g
        if not local:
            return
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        top = max(float(g.abs().max()) for g in local if g.numel())
        run.zeros.local = (
            step,
            top,
            zero_grads.flushed(local, hook[1], world),
            zero_grads.flushed(local, torch.bfloat16, world),
        )

    @contextlib.contextmanager
    def _replaying_now(self) -> Iterator[None]:
        self._replaying, saved = True, self._replaying
        try:
            with contextlib.ExitStack() as stack:
                # a step decided at the next training forward runs inside the script's autocast, if
                # any: the replay runs under its own step's (`_replay_call`), not the next one's
                for device, _ in _autocast_state():
                    stack.enter_context(torch.autocast(device, enabled=False))
                yield
        finally:
            self._replaying = saved

    @staticmethod
    def _replay_call(call: _Call, *args: Any, **kwargs: Any) -> OutputsOnly | None:
        """The forward as it ran (its autocast; `args`/`kwargs` are the call's own, or their fp32
        copies in a control) and its backward from the kept output gradients.

        The loss is not part of the model: where the gradients that arrived at the outputs are
        finite the backward runs and None is returned (the replay judges the gradients). Where
        they are not (the loss itself was NaN/Inf) no backward can say more, and the forward is
        judged alone (`OutputsOnly`)."""
        with contextlib.ExitStack() as stack:
            for device, dtype in call.autocast:
                # a control switches it off; no cast cache: inside a block of the script's that spans the
                # step, its cache holds the casts of the script's forward, which ours must neither read nor add to
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
            with called_from(sys._getframe(), call.site):
                output = call.module(*args, **kwargs)
        return backward_from(output, call.kept)

    @staticmethod
    def _what_if_call(call: _Call, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """A micro-batch of the what-if run: `_replay_call`'s forward and backward, and the loss to first
        order from the step's own: its loss plus, at each output, the kept gradient times how far the
        output moved (None where the step's loss or an output's gradient was not seen)."""
        with contextlib.ExitStack() as stack:
            for device, dtype in call.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))  # as `_replay_call`
            with called_from(sys._getframe(), call.site):
                output = call.module(*args, **kwargs)
        kept = call.kept
        hooked = [
            (i, t) for i, t in enumerate(pytree.tree_leaves(output)) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        estimate = None
        if kept.loss is not None and len(hooked) == len(kept.originals) and all(i in kept.grads for i, _ in hooked):
            with torch.no_grad():
                moved = [
                    ((t.detach().float() - was.float()) * kept.grads[i].float()).sum()
                    for (i, t), was in zip(hooked, kept.originals, strict=True)
                ]
                estimate = kept.loss.float() + torch.stack(moved).sum()
        backward_from(output, kept)
        return estimate

    def _finish_trace(self) -> None:
        """The traced step's findings, said as they are decided; the report puts them first."""
        try:
            for finding in self._traced.finish():
                self.live.added(finding)
        except Exception as exc:  # ours: the step goes on, the report says what failed
            self._error("tracing a step after a bad one", exc)

    def _tell(self, run: _Run, outcome: StepOutcome) -> None:
        """One line per bad step, until a cause repeats: then one line per 100 of its steps."""
        if self.notify is None or outcome.finite or outcome.verdict == "amp-skip":
            return
        judge = run.judge
        why = judge.not_replayed.get(outcome.step)
        verdict = outcome.verdict or "not replayed"
        if verdict == "not-replayed" and why:
            verdict = f"not replayed: {why}"
        self._told[verdict] = self._told.get(verdict, 0) + 1
        seen = self._told[verdict]
        if seen > 3 and seen % 100:
            return
        where = judge.here
        rank = f"rank {where['rank']} " if "rank" in where else ""
        opt = f" (optimizer {run.number})" if len(self.runs) > 1 else ""
        said = f"skipped{opt}" if outcome.skipped else f"applied{opt}"
        again = f" ({seen} steps so far; the next line after 100 more)" if seen >= 3 else ""
        self.notify(f"fpdoctor watch: {rank}step {outcome.step}: non-finite, {said}; {verdict}{again}")

    def _error(self, doing: str, exc: BaseException) -> None:
        """A failure of the watch's own, said once; this never raises (it runs in the user's step)."""
        try:
            runs = list(self.runs.values())
            if runs:
                runs[0].judge.error(doing, exc)
                return
            text = f"{type(exc).__name__}: {exc}"
            from fpdoctor.numerics.training import findings as sentinel_findings

            if not any(doing in f.message and text in f.message for f in self.errors):
                self.errors.append(sentinel_findings.error_finding(doing, text, 0, here={}))
        except Exception:  # the last resort of the observer that never kills the job
            pass

    # -- the report ------------------------------------------------------------------------------
    @property
    def stopped_by(self) -> Finding | None:
        """The finding that stopped the run at the `stop_on` level: the watch's own, or that of a
        callback it switched on (Lightning's, a Hugging Face Trainer's), which ended training."""
        if self.live.stopped is not None:
            return self.live.stopped
        before: set[int] = getattr(self, "_before", set())
        return next((c.stopped_by for c in framework.ACTIVE if id(c) not in before and c.stopped_by), None)

    def _never_stepped(self) -> bool:
        """Training forwards, none reached by a backward or an autograd.grad, and an optimizer held the
        model's parameters while they ran (a loop meant to train: MC-dropout inference makes none)."""
        grads = self._penalty is not None and self._penalty.grads
        return self._forwards >= NEVER_STEPPED and not self._reached and not grads and self._optimized

    def in_progress(self) -> Report:
        """The report so far, as its file holds it while the script goes on (status "in progress")."""
        return in_progress(self.report, sum(run.judge.steps for run in self.runs.values()))

    @property
    def report(self) -> Report:
        runs = list(self.runs.values())
        if not runs:
            report = Report(command="watch", findings=list(self.errors), data={"steps": 0, "summary": []})
        else:
            first = runs[0].judge
            report = first.report(scaled=first.amp.scale is not None)
            for run in runs[1:]:  # a second optimizer (a GAN's): its findings and counts beside
                other = run.judge.report(scaled=run.judge.amp.scale is not None)
                report.findings.extend(other.findings)
                counts = {k: other.data[k] for k in ("steps", "skipped_steps", "nonfinite_steps", "verdicts")}
                report.data.setdefault("optimizers", []).append(counts)
                # the summary's counts are the first optimizer's: each other one's beside them, so that
                # "non-finite steps 0" is not read as the run's (a student trained after its teacher)
                report.data["summary"].append(
                    (
                        f"optimizer {run.number}",
                        f"{counts['steps']} steps, {counts['nonfinite_steps']} non-finite, "
                        f"{counts['skipped_steps']} skipped",
                    )
                )
            if len(runs) > 1:
                report.data["summary"] = [
                    (f"{key} (optimizer 1)", value) if key in _PER_OPTIMIZER else (key, value)
                    for key, value in report.data["summary"]
                ]
            report = Report(
                command="watch",
                findings=[*self.errors, *scale_upstream(self._traced.lead(report.findings))],
                data=report.data,
            )
        before: set[int] = getattr(self, "_before", set())
        for callback in [c for c in framework.ACTIVE if id(c) not in before]:  # a callback's steps, judged by it
            made = callback.report("callback")  # its findings and the recipe's, read from its optimizer at the report
            report.findings.extend(made.findings)
            counts = {"steps": callback.steps, "skipped_steps": callback.skipped}
            report.data.setdefault("callbacks", []).append(counts)
            if made.data.get("judged"):  # an OK says what it judged: the callback's steps
                report.data.setdefault("summary", []).append(("judged by the callback", made.data["judged"]))
        report.findings.extend(self._unheld_findings(runs[0].judge.here if runs else {}))
        rebuilt = self._rebuilt_scalers()
        if rebuilt:  # the cause of the skips and the "collapse" the judge names: said first
            report.findings[:0] = rebuilt
        if self._stale.found is not None:  # no update reaches the forward: the flat loss and the rest follow from it
            optimizer = type(runs[0].optimizer).__name__ if runs else "the optimizer"
            here = runs[0].judge.here if runs else {}
            report.findings[:0] = [stale_casts_finding(self._stale.found, optimizer, here=here)]
        # on one process, where the reference step or a clearing call already says where the gradients part from
        # an fp32 step's (cleared between the backward and the step), that finding is the cause: the zeros are it
        parted = {"gradients-cleared", "gradients-depart-from-reference"} & {f.name for f in report.findings}
        zeros = [
            zero_grads_finding(run.zeros, distributed.compressing_hook(run.judge.model), _last_loss(run.judge),
                               type(run.optimizer).__name__, here=run.judge.here, distributed=run.judge.distributed)
            for run in runs
            if run.zeros.every_step_zero and (run.judge.distributed or (run.zeros.low_precision and not parted))
        ]  # fmt: skip
        # some layers' gradients zeros at every look, behind a hook that casts them: those layers never train
        zeros += [
            some_zero_grads_finding(run.zeros.some_always_zero, hook, type(run.optimizer).__name__,
                                    looked=run.zeros.looked, here=run.judge.here)
            for run in runs
            if run.zeros.some_always_zero and (hook := distributed.compressing_hook(run.judge.model)) is not None
        ]  # fmt: skip
        report.findings[:0] = zeros  # a reduction that hands over zeros: what every other figure follows from
        if not runs and not report.findings and self._never_stepped():
            report.findings.append(_never_stepped(self._forwards))
        grads = self._penalty is not None and self._penalty.grads  # torch.autograd.grad reached them instead
        # a step compiled into a graph calls no hook when it runs: where the script compiled, no step is certain
        compiled = _graphs_compiled() > self._graphs_at_start
        if (
            not self._optimizer_steps
            and not compiled
            and not report.findings
            and (self._reached or grads)
            and _changed(self._weights)
        ):
            report.findings.append(_updated_outside(self._forwards, self._reached))
        if self.unwatched:
            report.data.setdefault("not_checked", {}).update(self.unwatched)
        if any(k.startswith("training in thread") for k in self.unwatched) and "status" not in report.data:
            # another thread's training was not judged: nothing found in the one that was is no OK for the run
            report.data["status"] = "not checked"
        if self._traced.said is not None:  # the step traced after a bad one: which, and what it found
            report.data["traced_step"] = self._traced.said
        if self._pending:  # skipped or applied on the device, decided at the next training forward
            report.data["undecided_steps"] = [p.step for p in self._pending]
        return report


_STALE = "probing autocast's cast cache"


def _last_loss(judge: StepJudge) -> float | None:
    """The last loss the judge saw (this rank's), for the size the gradients are made from: the last
    finite one, or the last one where none was (a NaN loss over zero gradients is said as it was)."""
    finite = next((h.loss for h in reversed(judge.history) if h.finite and math.isfinite(h.loss)), None)
    return finite if finite is not None else next((h.loss for h in reversed(judge.history)), None)


def _optimized(module: nn.Module) -> bool:
    """Whether an optimizer holds a parameter of `module` (every live object looked at: once a run)."""
    params = {id(p) for p in module.parameters()}
    for o in gc.get_objects():
        # by its type, never isinstance: a live object of another library (a lazy proxy, a deprecated alias)
        # can answer isinstance by running code that warns or raises
        if not issubclass(type(o), torch.optim.Optimizer):
            continue
        try:
            if any(id(p) in params for g in o.param_groups for p in g["params"]):
                return True
        except Exception:  # an optimizer of the program's own kind whose groups are not torch's: not ours
            continue
    return False


WEIGHT_VALUES = 64  # values kept of each of the first weights (TRN033): an update changes nearly all of them


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (0 where the program never imported it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _first_values(module: nn.Module, most: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `most` trainable parameters of `module`, each with a copy of its first values."""
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p in module.parameters():
        if p.requires_grad and p.numel():
            found.append((p, p.detach().reshape(-1)[:WEIGHT_VALUES].clone()))
            if len(found) == most:
                break
    return found


def _changed(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether any parameter's first values differ from the copy `_first_values` kept."""
    for p, before in kept:
        now = p.detach().reshape(-1)[:WEIGHT_VALUES]
        if now.shape != before.shape or not torch.equal(now.to(before.dtype), before):
            return True
    return False


def _updated_outside(forwards: int, reached: int) -> Finding:
    """TRN033: the weights changed with no torch.optim step: an update of the script's own, not judged."""
    took = f"backwards reached {reached} of them" if reached else "torch.autograd.grad took their gradients"
    return catalog.make(
        "updates-outside-optimizer",
        message=(
            f"The script ran {forwards} training forwards, {took}, and the model's weights changed, but no "
            "torch.optim optimizer stepped: the update is code of the script's own (a hand-written optimizer, an "
            "in-place `p.data` update), which the watch does not see. No step was judged, so this report cannot "
            "say the run is fine."
        ),
        fix=(
            "Run `fpdoctor trace -- <your script>`: it follows the update op by op and names a running state (an "
            "optimizer's moments created with torch.zeros_like on a bf16 model) or an update that the format "
            "rounds away. Or write the optimizer as a torch.optim.Optimizer subclass, whose steps the watch judges"
        ),
        where={"module": None, "op": None, "phase": "optimizer"},
        evidence={"training_forwards": forwards, "reached_by_a_backward": reached, "optimizer_steps": 0},
        trial=Trial.untried("no optimizer step ran that the watch could re-run: `trace` follows the update op by op"),
    )


def _never_stepped(forwards: int) -> Finding:
    """TRN020: training forwards and not one backward or optimizer step after them."""
    return catalog.make(
        "training-never-stepped",
        message=(
            f"The script ran {forwards} training forwards (the model in training mode, gradients on) and no backward "
            "reached any of them, and no optimizer stepped: nothing trained and no step was judged. A loop that "
            "skips a batch whose loss is not finite (`if not torch.isfinite(loss): continue`) does this when every "
            "loss is; the loss is computed after the model, where the watch, which judges steps, sees none."
        ),
        fix=(
            "Run `fpdoctor trace -- <your script>`: it follows the loss op by op and names the op that makes it "
            "non-finite, with its fix checked there"
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={"training_forwards": forwards, "reached_by_a_backward": 0, "optimizer_steps": 0},
        trial=Trial.untried(
            "no backward ran: the watch holds no loss to re-run, and `trace` follows the loss op by op"
        ),
    )


def watch(
    *,
    report: str | None = None,
    replay: bool = True,
    device_skip: bool | None = None,
    reference_every: int = reference.EVERY,
) -> ScriptWatch:
    """Watch every optimizer step of this process from here on (no code change beyond this line):
    `fpdoctor.watch()` at the top of a script, or `with fpdoctor.watch() as w: ...` around a part
    of it. Called bare, the report is written when the process exits: to `report` (a file; its
    extension picks the format) or, without one, on stderr. `device_skip`, `reference_every`: as
    `ScriptWatch`'s (the model's backward at steps 1, 1 + N, ... against an fp32 step; 0: off)."""
    import atexit

    reference.check_every(reference_every)
    watcher = ScriptWatch(
        replay=replay,
        notify=stderr_line,
        device_skip=device_skip,
        reference_every=reference_every,
    )
    if report:  # rewritten as findings arrive: a process killed at any point leaves a readable report
        from fpdoctor.integrations import _report as live_report

        watcher.live.writer = lambda: live_report.write(watcher.in_progress(), report)
    watcher.__enter__()

    def at_exit() -> None:
        if watcher._stack is None:  # left already (a with block): its owner has the report
            return
        watcher.close()
        from fpdoctor.integrations import _report

        done = watcher.report
        if report:
            _report.write(done, report)
        else:
            from fpdoctor.report.render import render

            sys.stderr.write(render(done.to_dict(), "text", color=False))

    atexit.register(at_exit)
    return watcher


def stderr_line(line: str) -> None:
    """`line` on stderr in one write with its newline: print() writes the end apart, and under torchrun
    another rank's line could land between the two."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
