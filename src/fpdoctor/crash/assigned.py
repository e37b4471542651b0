"""Where a module, parameter or buffer of another dtype or device than its new owner was assigned.

"mat1 and mat2 must have the same dtype" names the line that crashed; the cause is usually a line
long before it: a submodule replaced after `model.half()` (`model.head = nn.Linear(...)`, fp32),
a parameter swapped for a new one, a module attached after `model.to("cuda")`. torch calls the
global registration hooks from `nn.Module.__setattr__` / `register_module` / `register_parameter`
/ `register_buffer` before it stores the value; there the new value's first floating tensor is
compared with its owner's, and only a difference costs anything: the user's line, kept in a
short ring. Building a model of one dtype and device records nothing, and no op is slowed (the
hooks run on assignment only). `fpdoctor run --breadcrumbs` arms this with the op ring.

At a crash, `assignment_of(root, path)` names the record that made `path` (or a module above it)
what it is, while that object is still the one in the model.
"""

from __future__ import annotations

import collections
import sys
import weakref
from typing import Any

from fpdoctor.userframes import user_location

KEPT = 256  # the latest assignments of an odd dtype or device: a model is built once, not per step

_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEPT)
_handles: list[Any] = []


def arm() -> None:
    """Register the hooks (torch is imported); once per process, never raises."""
    if _handles:
        return
    try:
        from torch.nn.modules import module as module_mod

        _handles.append(module_mod.register_module_module_registration_hook(_on_module))
        _handles.append(module_mod.register_module_parameter_registration_hook(_on_tensor))
        _handles.append(module_mod.register_module_buffer_registration_hook(_on_tensor))
    except Exception:  # an older torch without the hooks: crashes are explained without the line
        disarm()


def disarm() -> None:
    while _handles:
        _handles.pop().remove()


def clear() -> None:
    _records.clear()


def _first(module: Any) -> Any:
    """The module's first floating parameter, else buffer: what it computes in, where."""
    for tensors in (module.parameters(), module.buffers()):
        for t in tensors:
            if t.is_floating_point():
                return t
    return None


def _on_module(owner: Any, name: str, value: Any) -> None:
    try:
        if value is not None:
            theirs = _first(value)
            if theirs is not None:
                _compare(owner, name, value, theirs, "module")
    except Exception:  # the observer never raises into the user's code
        pass


def _on_tensor(owner: Any, name: str, value: Any) -> None:
    try:
        if value is not None and value.is_floating_point():
            _compare(owner, name, value, value, "tensor")
    except Exception:
        pass


def _compare(owner: Any, name: str, value: Any, theirs: Any, kind: str) -> None:
    ours = _first(owner)  # before the assignment: what is being replaced counts as the owner's
    if ours is None or ours is theirs or (ours.dtype == theirs.dtype and ours.device == theirs.device):
        return
    if kind != "module":
        kind = "parameter" if type(value).__name__ == "Parameter" else "buffer"
    location = user_location(sys._getframe(2))
    _records.append(
        {
            "owner": weakref.ref(owner),
            "name": name,
            "value": weakref.ref(value),
            "kind": kind,
            "type": type(value).__name__,
            "dtype": str(theirs.dtype),
            "device": str(theirs.device),
            "owner_dtype": str(ours.dtype),
            "owner_device": str(ours.device),
            "location": (location[0], location[1]) if location is not None else None,
        }
    )


def assignment_of(root: Any, path: str) -> dict[str, Any] | None:
    """The latest recorded assignment that put `path` (a parameter, buffer or module of `root`)
    or a module above it into `root`, while what it assigned is still there: {"path", "kind",
    "type", "dtype", "device", "owner", "owner_dtype", "owner_device", "location"}; else None."""
    if not _records:
        return None
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    for record in reversed(_records):
        owner, value = record["owner"](), record["value"]()
        if owner is None or value is None or id(owner) not in paths:
            continue
        here = getattr(owner, record["name"], None)
        if here is not value:
            continue  # replaced again since
        owner_path = paths[id(owner)]
        assigned = f"{owner_path}.{record['name']}" if owner_path else record["name"]
        if path == assigned or path.startswith(assigned + "."):
            found = {k: v for k, v in record.items() if k not in ("owner", "value", "name")}
            return found | {"path": assigned, "owner": owner_path}
    return None
