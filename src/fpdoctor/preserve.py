"""Running a user's model without changing it: what a forward can change besides its output.

A forward draws from the RNG (dropout) and may update buffers (BatchNorm's running statistics in
training mode, a module's own counters or caches). When fpdoctor runs the user's own model - a
replay, an audit - those changes must not reach the user's run.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor.torchprivate import buffers_of, foreach_copy_


@dataclass
class RngState:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None = None

    @classmethod
    def capture(cls) -> RngState:
        # never initialise CUDA just to save a state nobody has drawn from (initialised implies available:
        # is_available() alone costs more than the CPU state's copy, on every watched forward)
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda)

    def same(self, other: RngState) -> bool:
        cuda_same = (self.cuda is None) == (other.cuda is None) and all(
            torch.equal(a, b) for a, b in zip(self.cuda or [], other.cuda or [], strict=True)
        )
        return torch.equal(self.cpu, other.cpu) and cuda_same

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """On exit, put back the RNG states and every buffer of `model`: its values, and the tensor
    each module holds (a forward may rebind a buffer rather than update it in place); and each
    module's own attributes (`attributes_kept`): a step run again sets them as the first run did."""
    rng = RngState.capture()
    saved = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in buffers_of(module).items()
        if buffer is not None
    ]
    try:
        with attributes_kept(model):
            yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                buffer.copy_(value)
                buffers_of(module)[name] = buffer
        rng.restore()


KEPT_BYTES = 64 * 2**20  # the tensor attributes' values copied by attributes_kept, at most
# containers whose items a step adds to (a list of losses, a defaultdict(list), a deque of recent values)
_CONTAINERS = (list, dict, set, collections.deque)


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """On exit, each module of `model` holds the public attributes it held on entry: one set since is
    removed, one rebound is bound back (`self.loss_ema = ...` in a training_step run again, whose
    first value would set its dtype), a plain tensor attribute written in place gets its values back
    (up to KEPT_BYTES of them in all: a larger cache is only bound back; never an inference tensor,
    which keeps no version), and a container its items, one level down too (`self.outputs.append(loss)`,
    `self.history["loss"].append(loss)`). Names with a leading underscore are torch's and the
    framework's own (parameters, buffers, hooks): left to them."""
    kept = [(vars(m), {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in model.modules()]
    tensors = []
    room = KEPT_BYTES
    for _, before in kept:
        for t in before.values():
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not t.is_inference():
                size = t.numel() * t.element_size()
                if size <= room:
                    room -= size
                    tensors.append((t, t._version, t.detach().clone()))
    containers = [c for _, before in kept for c in before.values() if isinstance(c, _CONTAINERS)]
    inner = [v for c in containers for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, _CONTAINERS)]
    items = [(c, copy.copy(c)) for c in [*containers, *inner]]
    try:
        yield
    finally:
        for now, before in kept:
            for name in [n for n in now if not n.startswith("_") and n not in before]:
                del now[name]
            for name, value in before.items():
                if name not in now or now[name] is not value:
                    now[name] = value
        with torch.no_grad():
            for t, version, value in tensors:
                if t._version != version:
                    t.copy_(value)
        for container, saved in items:
            if _changed(container, saved):
                _refill(container, saved)


def _changed(container: Any, saved: Any) -> bool:
    """By identity: == on items that are tensors is elementwise (and raises in a list's !=)."""
    if len(container) != len(saved):
        return True
    if isinstance(container, dict):
        return container.keys() != saved.keys() or any(container[k] is not v for k, v in saved.items())
    if isinstance(container, set):
        return container != saved
    return any(a is not b for a, b in zip(container, saved, strict=True))


def _refill(container: Any, saved: Any) -> None:
    """`container` holds `saved`'s items again, the object itself kept (its default_factory, maxlen)."""
    container.clear()
    if isinstance(container, (dict, set)):
        container.update(saved)
    else:
        container.extend(saved)


class BufferSnapshot:
    """The buffers a forward changes, copied on the device before each step, put back on demand.

    A skipped training step must leave no trace, but its forward already ran: BatchNorm wrote the
    bad batch's statistics into `running_mean`/`running_var`. Which buffers a forward changes is
    learnt from their version counters (bumped by in-place writes, read without a device sync)
    and, once after the first step, from their values (native batch_norm writes its statistics
    without bumping their version). The first capture copies every buffer, later ones only those
    seen changing: a model whose forward changes no buffer pays nothing. The copies are one
    `_foreach_copy_` per device and dtype into storage allocated once, asynchronous on a GPU.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        # None until the first step has shown which buffers change; then the (module, name) pairs
        self._changing: list[tuple[nn.Module, str]] | None = None
        self._entries: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = []

    def capture(self) -> None:
        """Copy the watched buffers (before the step that may have to be undone)."""
        self._learn()
        if self._changing is None:
            watched = [(m, n) for m in self._model.modules() for n, b in buffers_of(m).items() if b is not None]
        else:
            watched = self._changing
        old = {(id(m), n): copy for m, n, _, copy, _ in self._entries}
        entries = []
        for module, name in watched:
            buffer = buffers_of(module).get(name)
            if buffer is None:
                continue
            copy = old.get((id(module), name))
            if copy is None or copy.shape != buffer.shape or copy.dtype != buffer.dtype or copy.device != buffer.device:
                copy = torch.empty_like(buffer)
            entries.append((module, name, buffer, copy, buffer._version))
        if entries:
            with torch.no_grad():
                _copy_grouped([e[3] for e in entries], [e[2] for e in entries])
        self._entries = entries

    def _learn(self) -> None:
        """After the first step: keep the buffers whose version moved or whose name was rebound."""
        if self._changing is not None and not self._entries:
            return
        changing = self._changing
        changed = [
            (module, name)
            for module, name, buffer, copy, version in self._entries
            if buffers_of(module).get(name) is not buffer
            or buffer._version != version
            or (changing is None and not torch.equal(copy, buffer))  # once: a host read
        ]
        if changing is None:
            if self._entries or not any(True for _ in self._model.buffers()):
                self._changing = changed
            return
        known = {(id(m), n) for m, n in changing}
        changing += [(m, n) for m, n in changed if (id(m), n) not in known]

    def restore(self) -> None:
        """Put back the values (and the tensor objects) captured last."""
        if not self._entries:
            return
        # learn first: once put back, a first step that changed buffers would look like one that did not
        self._learn()
        for module, name, buffer, _, _ in self._entries:
            buffers_of(module)[name] = buffer
        with torch.no_grad():
            _copy_grouped([e[2] for e in self._entries], [e[3] for e in self._entries])
        # the restoring write is ours, not a forward's: it must not count as a change
        self._entries = [(m, n, b, c, b._version) for m, n, b, c, _ in self._entries]


def _copy_grouped(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for all i, one fused call per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        group = groups.setdefault((d.device, d.dtype), ([], []))
        group[0].append(d)
        group[1].append(s)
    for ds, ss in groups.values():
        foreach_copy_(ds, ss)
