"""A dtype or device mismatch that killed a process, explained from the live model as it dies.

Called by the `fpdoctor run` sitecustomize from the excepthook, while the traceback's frames
still hold the model: the op that raised, its operands by name (`fc.weight`, float32) and where
each entered, in the words `trace` and `audit` use (numerics.mismatch); and, where the run
recorded it (crash/assigned.py), the line that assigned the odd-dtype module or parameter, the
cause, rather than only the line that crashed. The result is plain JSON for the exception record.
"""

from __future__ import annotations

import json
from collections import Counter
from types import TracebackType
from typing import Any

from fpdoctor.crash.assigned import assignment_of
from fpdoctor.userframes import is_user_file, user_location


def explain(exc: BaseException) -> dict[str, Any] | None:
    """{"name", "message", "fix", "where", "evidence"} of the dtype-mismatch / device-mismatch
    finding for `exc`, else None (not a mismatch, or its operands cannot be read)."""
    from torch import nn

    from fpdoctor.numerics.trace.mismatch import explain_mismatch, failure_from_traceback

    root = _root(exc.__traceback__, nn.Module)
    names: dict[int, tuple[str, str]] = {}
    modules: dict[int, str] = {}
    if root is not None:
        modules = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        names = {id(t): (n, "buffer") for n, t in root.named_buffers(remove_duplicate=False)}
        names |= {id(t): (n, "parameter") for n, t in root.named_parameters(remove_duplicate=False)}

    def origin(t: Any) -> dict[str, Any]:
        found = names.get(id(t)) or (names.get(id(t._base)) if t._base is not None else None)
        if found is not None:
            return {"kind": found[1], "name": found[0], "dtype": str(t.dtype)}
        return {"kind": "tensor", "name": "a tensor that is no parameter or buffer of the model", "dtype": str(t.dtype)}

    def name_of(module: Any) -> str:
        return modules.get(id(module), type(module).__name__)

    def location(frame: Any) -> tuple[str, int] | None:
        found = user_location(frame)
        return (found[0], found[1]) if found is not None else None

    original = exc.__traceback__
    try:  # read from the op's caller: what torch's own Python checks hold are its copies, unnamed
        exc.__traceback__ = _up_to_the_caller(original, nn.Module)
        failure = failure_from_traceback(exc, name_of=name_of, origin=origin, location=location)
    finally:
        exc.__traceback__ = original
    if failure is None:
        return None
    record = None
    if root is not None:
        for o in failure["operands"]:
            if o.get("kind") in ("parameter", "buffer"):
                record = assignment_of(root, o["name"])
                if record is not None:
                    break
    main = record["owner_dtype"] if record is not None else _main_dtype(root)
    finding = explain_mismatch(failure, main, root)
    message, fix, evidence = finding.message, finding.fix, dict(finding.evidence)
    if record is not None and record["location"] is not None:
        message, fix = _with_assignment(message, fix, record, device=failure["device"])
        evidence["assigned"] = record["path"]
        evidence["assigned_at"] = "{}:{}".format(*record["location"])
    where = {k: v for k, v in finding.where.items() if v is not None}
    out = {"name": finding.name, "message": message, "fix": fix, "where": where, "evidence": evidence}
    return dict(json.loads(json.dumps(out, default=str)))


def _root(tb: TracebackType | None, module_type: type) -> Any:
    """The outermost module whose call is on the traceback: the model the user called."""
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, module_type):
            return owner
        tb = tb.tb_next
    return None


def _up_to_the_caller(tb: TracebackType | None, module_type: type) -> TracebackType | None:
    """The traceback cut after its deepest frame of the user's code or of a module's own method
    (Linear.forward calling F.linear): the frames below it are torch's checks (a meta or
    fake-tensor kernel written in Python), whose locals are torch's, not the model's tensors."""
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    keep = len(entries) - 1
    for index in range(len(entries) - 1, -1, -1):
        frame = entries[index].tb_frame
        owner = frame.f_locals.get("self")
        wrapper = frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl")
        if is_user_file(frame.f_code.co_filename) or (isinstance(owner, module_type) and not wrapper):
            keep = index
            break
    cut: TracebackType | None = None
    for entry in reversed(entries[: keep + 1]):
        cut = TracebackType(cut, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return cut


def _main_dtype(root: Any) -> str | None:
    """The dtype most of the model's floating elements have."""
    if root is None:
        return None
    sizes: Counter[str] = Counter()
    for t in [*root.parameters(), *root.buffers()]:
        if t.is_floating_point():
            sizes[str(t.dtype)] += t.numel()
    return sizes.most_common(1)[0][0] if sizes else None


def _with_assignment(message: str, fix: str | None, record: dict[str, Any], *, device: bool) -> tuple[str, str]:
    at = "{}:{}".format(*record["location"])
    owner = f"`{record['owner']}`" if record["owner"] else "the model"
    what = f"a {record['type']}" if record["kind"] == "module" else f"a {record['kind']}"
    odd, usual = (record["device"], record["owner_device"]) if device else (record["dtype"], record["owner_dtype"])
    message += (
        f" The odd {'device' if device else 'dtype'} entered at {at}: `{record['path']}` was assigned {what} "
        f"in {odd} there, into {owner} whose tensors were {usual}."
    )
    target = f"'{usual}'" if device else usual
    lead = f"at {at}, make the new {record['type']} {usual} before it is assigned: `.to({target})`" + (
        " (or assign it before the model is moved)" if device else " (or assign it before the model is cast)"
    )
    if device:
        return message, lead + "\n# or: model.to(device) after every module is attached"
    return message, lead + ("\n# or: " + fix if fix else "")
