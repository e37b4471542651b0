"""Which rank held the bad gradient: the sentinel under torch.distributed.

Once DDP has all-reduced the gradients every rank holds the same NaN, so a check after the
backward cannot say whose it was. `BucketWatch` is a DDP communication hook that wraps the
default all-reduce (or the hook it is given): before each bucket is reduced it takes the bucket's
local `aminmax` on the device (NaN propagates into both, +Inf shows as the max, -Inf as the
min) and keeps the two numbers; nothing is read back while the step is healthy. On a bad step
every rank sends what it saw in one `all_gather_object`, so all ranks agree on who held the
non-finite local gradient, which buckets and parameters, NaN or Inf.

FSDP (and a DDP model whose communication hook was registered before the sentinel's) gets the
per-rank loss check and the gradient check after the reduction, agreed across ranks the same
way, but no attribution of a gradient to the rank that produced it before the reduction.
"""

from __future__ import annotations

import contextlib
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe import records
from fpdoctor.torchprivate import comm_hooks, has_comm_hook, without_backward_context


def active() -> bool:
    """True under an initialised process group with more than one rank."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def describe(device: torch.device) -> dict[str, Any]:
    """rank (under torch.distributed), host, device, GPU name and UUID; unknown keys left out."""
    info: dict[str, Any] = {"host": socket.gethostname(), "device": str(device)}
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        info["rank"] = dist.get_rank()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        uuid = str(getattr(props, "uuid", "") or "")
        if uuid:
            info["uuid"] = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return info


def where_text(info: dict[str, Any]) -> str:
    text = f"{info.get('device', '?')} on host {info.get('host', '?')}"
    if "rank" in info:
        text = f"rank {info['rank']} ({text})"
    if info.get("gpu"):
        text += f", {info['gpu']} {info.get('uuid', '')}".rstrip()
    return text


def all_max(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks (one tiny all-reduce, asynchronous on NCCL)."""
    out = flags.detach().clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out


def agree(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's payload, in rank order, on every rank (only called on bad steps)."""
    dist = torch.distributed
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    return [g if isinstance(g, dict) else {} for g in gathered]


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


# torch's gradient-compression hooks (ddp_comm_hooks.default_hooks: the hooks and their wrappers), by
# the start of the function's name: each bucket is cast to this dtype before the all-reduce
COMPRESSING = {"fp16_compress": torch.float16, "bf16_compress": torch.bfloat16}


def compressing_hook(model: nn.Module) -> tuple[str, torch.dtype] | None:
    """The DDP model's communication hook that casts the gradients to a narrower dtype before the
    all-reduce (torch's fp16/bf16 compression): its name and that dtype. A replay runs without the
    reduction (`local_replay`), so what the cast does is the one thing it cannot show."""
    if not is_ddp(model):
        return None
    for hook, _ in comm_hooks(model):
        fn = getattr(hook, "func", hook)  # a functools.partial of one
        name = str(getattr(fn, "__qualname__", "") or getattr(fn, "__name__", ""))
        for prefix, dtype in COMPRESSING.items():
            if name.startswith(prefix):
                return str(getattr(fn, "__name__", prefix)), dtype
    return None


class LocalPeak:
    """The largest finite |gradient| of this rank's replay, before any reduction, and its parameter:
    `replay`'s observer, on a bad step's replay only (one host read per parameter)."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
        self.value = 0.0
        self.name: str | None = None

    def __call__(self, index: int, loss: Any, params: list[torch.Tensor]) -> None:
        for p in params:
            g = p.grad
            if g is None or not g.is_floating_point() or not g.numel():
                continue
            values = g.detach().abs()
            top = float(values[torch.isfinite(values)].max()) if bool(torch.isfinite(values).any()) else 0.0
            if top > self.value:
                self.value, self.name = top, self._names.get(id(p))


@contextlib.contextmanager
def local_replay(model: nn.Module) -> Iterator[None]:
    """Run a DDP model's forward and backward without any collective, on this rank alone.

    `no_sync()` keeps the backward from all-reducing; the forward still broadcasts buffers from
    rank 0 while `require_forward_param_sync` is set, so it is cleared for the replay and put back.
    """
    if not is_ddp(model):
        yield
        return
    ddp: Any = model
    saved = ddp.require_forward_param_sync
    ddp.require_forward_param_sync = False
    try:
        with ddp.no_sync():
            yield
    finally:
        ddp.require_forward_param_sync = saved


class BucketWatch:
    """A DDP communication hook that notes each bucket's local extremes before the all-reduce.

    The hook registered on the model holds the watch only weakly: once the sentinel (which holds
    the watch) is gone, the hook just does DDP's plain all-reduce and keeps nothing. The records
    of one backward are dropped by the hook itself at the first bucket after a last bucket, so a
    model trained on without its sentinel never accumulates them.
    """

    def __init__(self, model: nn.Module) -> None:
        self._records: list[tuple[int, list[torch.Tensor], torch.Tensor, torch.Tensor]] = []
        # each bucket's local gradient norm before the reduction (fp32, on the device), for the
        # corruption sentinel's per-rank statistic (corruption.py); set where it reads them
        self.norms = False
        self._norms: list[torch.Tensor] = []
        self._after_last = False  # the previous bucket was a backward's last: the next one starts anew
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.errors: list[str] = []

    @classmethod
    def install(cls, model: nn.Module) -> BucketWatch | None:
        """Register on a DDP model that has no communication hook yet; None when it cannot."""
        if not is_ddp(model):
            return None
        ddp: Any = model
        if has_comm_hook(ddp):
            return None  # a hook of the user's (or the python reducer): theirs stays, no attribution
        watch = cls(model)
        ref = weakref.ref(watch)

        def fpdoctor_bucket_watch(state: Any, bucket: Any) -> Any:
            live = ref()
            if live is None:  # the sentinel is gone: DDP's own all-reduce, nothing kept
                return _allreduce_as_ddp_does(state, bucket.buffer())
            return live(state, bucket)

        # DDP accepts a bucket annotated dist.GradBucket or not at all (postponed annotations are strings)
        fpdoctor_bucket_watch.__annotations__ = {}
        ddp.register_comm_hook(ddp.process_group, fpdoctor_bucket_watch)
        return watch

    def begin(self) -> None:
        """Forget the last step's buckets (called before each step's backward)."""
        self._records = []
        self._norms = []
        self._after_last = False

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        try:
            if self._after_last:
                self._records = []
                self._norms = []
            self._after_last = bool(bucket.is_last())
            buffer = bucket.buffer()
            low, high = torch.aminmax(buffer.detach())
            self._records.append((bucket.index(), list(bucket.parameters()), low, high))
            if self.norms:  # before the reduction scales the buffer in place: this rank's own gradient
                self._norms.append(torch.linalg.vector_norm(buffer.detach(), dtype=torch.float32))
        except Exception as exc:  # the observer never breaks the all-reduce
            text = f"{type(exc).__name__}: {exc}"
            if len(self.errors) < 5 and text not in self.errors:
                self.errors.append(text)
        return _allreduce_as_ddp_does(state, bucket.buffer())

    def local_norm(self) -> torch.Tensor | None:
        """This rank's gradient norm over the last backward's buckets, before the reduction (on the
        device, nothing read back); None where no bucket was reduced since `begin`."""
        if not self._norms:
            return None
        return self._norms[0] if len(self._norms) == 1 else torch.linalg.vector_norm(torch.stack(self._norms))

    def local_faults(self) -> list[dict[str, Any]]:
        """The buckets whose local gradient held NaN or Inf before the reduction (reads back)."""
        if not self._records:
            return []
        values = torch.stack([torch.stack([lo.float(), hi.float()]) for _, _, lo, hi in self._records]).tolist()
        faults = []
        for (index, params, _, _), (lo, hi) in zip(self._records, values, strict=True):
            kind = records.kind_of(lo, hi)
            if kind is None:
                continue
            names = [self._names.get(id(p), "?") for p in params]
            faults.append({"bucket": index, "kind": kind, "parameters": names})
        return faults


def _allreduce_as_ddp_does(group: Any, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The average DDP computes when no hook is registered, bit for bit: each gradient times
    1/world_size (DDP's reducer multiplies while copying into the bucket; torch's python
    `allreduce_hook` divides instead, which differs in the last bit for 3 ranks), then a sum."""
    dist = torch.distributed
    group = group if group is not None else dist.group.WORLD
    buffer.mul_(1.0 / dist.get_world_size(group))
    with without_backward_context():  # else gloo's thread may free it at shutdown, and abort
        work = dist.all_reduce(buffer, group=group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])
