"""The sentinel's always-on check: is anything in the loss or the gradients NaN or Inf?

Finiteness is checked the way `torch.amp.GradScaler` does it, with
`torch._amp_foreach_non_finite_check_and_unscale_` at scale 1.0: one fused pass per device and
dtype that sets a float32 `found_inf` flag on the device. It is exact for every dtype - a norm in
the gradient's own dtype is not: finite fp16 gradients whose norm passes 65504 have an Inf norm.
Multiplying by 1.0 leaves every finite value, and every infinity, bit for bit as it was.
The flag is the `found_inf` that fused optimizers take to skip a step on the device.

Reading a flag back to the host is the only synchronisation; `FlagRead` makes it asynchronous
on a GPU (a non-blocking copy into pinned memory and an event, looked at one step later).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from fpdoctor.numerics.observe import records
from fpdoctor.torchprivate import foreach_norm, steps_with_scaler, unscale_check_


def grads_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients there are, as they are: a sparse one (nn.Embedding(sparse=True)) is read by its
    stored values where it is checked (`dense_values`), not looked for on every step."""
    return [g for p in params if (g := p.grad) is not None]


def dense_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's values as a dense tensor: a sparse one's stored values."""
    return [g._values() if g.is_sparse else g for g in grads]


_ONES: dict[torch.device, torch.Tensor] = {}  # the check's scale 1.0 per device, made once: the kernel only reads it


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float32 0-d tensor on `device`: 1.0 when any value of `grads` is NaN or Inf, else 0.0.

    On the CPU one kernel call for all of them first: the usual case, every gradient there, then
    costs no Python per gradient (the CPU kernel takes mixed dtypes). A gradient on another device
    makes it raise (the kernels refuse a tensor on another device than the first's), and so does a
    sparse one or a torch without the kernel: then one call per device and dtype, as on a GPU, whose
    kernel steps a list of one dtype in one launch and any other dtype one tensor at a time. The
    flag is only ever set by a value that is not finite: what the first call set stays true."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return found
    if device.type == "cpu" and grads[0].device == device:
        with torch.no_grad():
            try:
                unscale_check_(grads, found, _one(device))
                return found
            except (NotImplementedError, RuntimeError):
                pass
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in dense_values(grads):
        groups.setdefault((g.device, g.dtype), []).append(g)
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for (dev, _), group in groups.items():
            if dev not in per_device:
                flag = found if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
                per_device[dev] = (flag, _one(dev))
            flag, one = per_device[dev]
            try:
                unscale_check_(group, flag, one)
            except (NotImplementedError, RuntimeError):  # no kernel for this device or dtype here
                bad = torch.stack([g.isfinite().all() for g in group]).logical_not().any()
                torch.maximum(flag, bad.to(torch.float32), out=flag)
        for dev, (flag, _) in per_device.items():
            if dev != device:
                found = torch.maximum(found, flag.to(device, non_blocking=True))
    return found


_HELD = threading.local()  # per thread: a CPU flag the host reads at once (`nonfinite_now`)


def nonfinite_now(grads: list[torch.Tensor]) -> bool:
    """`nonfinite_flag` on the CPU read at once: one kernel call, no tensor made. The flag is kept
    per thread and made zero again only after it was set (the kernel only ever sets it), so a
    finite step costs the check's kernel and one read; on a GPU it would make the host wait."""
    if not grads:
        return False
    device = grads[0].device
    found: torch.Tensor | None = getattr(_HELD, "found", None)
    if found is None:
        found = _HELD.found = torch.zeros((), dtype=torch.float32)
    if device.type == "cpu":
        with torch.no_grad():
            try:
                unscale_check_(grads, found, _one(device))
                if not found:
                    return False
                found.zero_()
                return True
            except (NotImplementedError, RuntimeError):  # another device, a sparse gradient, no kernel
                found.zero_()
    return bool(nonfinite_flag(grads, torch.device("cpu")))


def grad_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float32 0-d tensor on `device`: the L2 norm of all of `grads` (as clip_grad_norm_ gives it),
    reduced in float32 so that finite fp16/bf16 gradients never make an Inf norm. No host read."""
    with torch.no_grad():
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = foreach_norm(dense_values(grads), torch.float32)  # one call, not one per gradient
        try:
            stacked = torch.stack(norms)
        except RuntimeError:  # gradients on several devices
            stacked = torch.stack([n.to(device, non_blocking=True) for n in norms])
        return torch.linalg.vector_norm(stacked.to(device, non_blocking=True))


def loss_flag(loss: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 0-d tensor on `device`: 1.0 when the loss holds a NaN or Inf."""
    with torch.no_grad():
        return torch.isfinite(loss.detach()).all().logical_not().to(device=device, dtype=torch.float32)


def kind_of(value: float) -> str:
    return "nan" if math.isnan(value) else "+inf" if value > 0 else "-inf"


def tensor_kind(t: torch.Tensor) -> str | None:
    """'nan', '+inf', '-inf' for a tensor holding one (NaN first), None when all finite.

    `aminmax` propagates NaN, and gives +Inf / -Inf as its max / min: one read-only pass."""
    if t.numel() == 0:
        return None
    with torch.no_grad():
        low, high = torch.aminmax(t.detach())
    lo, hi = torch.stack([low.float(), high.float()]).tolist()
    return records.kind_of(lo, hi)


class FlagRead:
    """A small device tensor on its way to the host.

    On a GPU the copy goes into pinned memory without blocking and an event marks its end;
    `values()` waits only for the rest of that copy. On the CPU
    the values are there at once.
    """

    def __init__(self, flags: torch.Tensor, *, exact: bool = False) -> None:
        # exact: in the tensor's own dtype (int64 sums read back bit for bit), else as float32
        flags = flags.detach().reshape(-1) if exact else flags.detach().float().reshape(-1)
        self._event: torch.cuda.Event | None = None
        if flags.device.type == "cuda":
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flags.cpu()

    def values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return [float(v) for v in self._host.tolist()]

    def ints(self) -> list[int]:
        """The values of an exact read of an integer tensor, as Python ints."""
        if self._event is not None:
            self._event.synchronize()
        return [int(v) for v in self._host.tolist()]


class HostRead:
    """`FlagRead`'s values read at once on the host (a CPU step): the gradients' flag twice (the
    loss's flag slot is judged on the host from the losses), the scale (float32), each loss as the
    float32 value `FlagRead` gives, without the stack, copy and list a tensor read costs."""

    def __init__(self, bad_grad: bool, scale: float, losses: list[torch.Tensor]) -> None:
        flag = float(bad_grad)
        self._values = [flag, flag, scale, *(float(t.float()) for t in losses)]

    def values(self) -> list[float]:
        return self._values


def skips_on_device(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for optimizers that take `found_inf` and skip on the device (fused Adam, AdamW, SGD)."""
    if optimizer is None or not steps_with_scaler(optimizer):
        return False
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        return False  # the older protocol: the optimizer expects the scaler itself
    return all(group.get("fused") for group in optimizer.param_groups)


def skip_on_device(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> Callable[[], None]:
    """Give a fused optimizer `flag` (float32, 0-d, on its device) as its `found_inf`, the GradScaler
    protocol: its next `step()` leaves weights and state untouched where the flag is nonzero, decided
    on the device, with no host read. A `found_inf` already set (a GradScaler's step in progress) is
    kept: either flag skips. Returns the undo, to call once the step has run."""
    opt: Any = optimizer
    had = "found_inf" in vars(opt)
    before = getattr(opt, "found_inf", None) if had else None
    opt.found_inf = flag if before is None else torch.maximum(before.float(), flag.to(before.device))

    def undo() -> None:
        if had:
            opt.found_inf = before
        else:
            vars(opt).pop("found_inf", None)

    return undo


class StepUndo:
    """A step of an optimizer that takes no `found_inf` (foreach or for-loop) undone on the device
    where `flag` (float32, 0-d) is set, so that the host need not read it before the step.

    Before the step every tensor the step may write is copied: the weights that have gradients and
    their optimizer state. After it, `undo()` puts the copies back where the flag is set, with
    `torch.where` on the device: a healthy step's values are kept bit for bit. State held on another
    device than the flag (Adam's `step` count on the CPU) and state the step created are put right by
    `settle(bad)` once the flag has been read, before the next step. The cost: one copy of those
    weights and their state, on their devices, for the step's duration."""

    def __init__(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        self._optimizer = optimizer
        self._flag = flag
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._fresh = [p for p in params if not optimizer.state.get(p)]  # no state yet: the step makes it
        self._device: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for p in params:
                self._device.append((p, p.detach().clone()))
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        kept = (value, value.detach().clone())
                        (self._device if value.device == flag.device else self._host).append(kept)

    def undo(self) -> None:
        """After the step: the device's tensors put back where the flag is set (no host read)."""
        with torch.no_grad():
            bad = self._flag.to(torch.bool)
            for tensor, kept in self._device:
                torch.where(bad.to(tensor.device, non_blocking=True), kept, tensor, out=tensor)
        self._device = []

    def settle(self, bad: bool) -> None:
        """The flag read: a bad step's other state put back and the state it created dropped."""
        if bad:
            with torch.no_grad():
                for tensor, kept in self._host:
                    tensor.copy_(kept)
            for p in self._fresh:
                self._optimizer.state.pop(p, None)
        self._host, self._fresh = [], []


def bad_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, kind) of every parameter whose gradient is not finite (host reads: bad steps only)."""
    bad = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            kind = tensor_kind(p.grad._values() if p.grad.is_sparse else p.grad)
            if kind:
                bad.append((name, kind))
    return bad
