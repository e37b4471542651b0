"""op-overridden-at-startup: a kernel of torch's own op registered by code outside torch before
the program's first line (a sitecustomize, a .pth file's import, a plug-in torch loads)."""

from __future__ import annotations

from collections.abc import Iterable

from fpdoctor import catalog
from fpdoctor.env.rules import Context
from fpdoctor.env.startup import by_whom, torch_ops_changed
from fpdoctor.report.model import Finding


def op_overridden_at_startup(ctx: Context) -> Iterable[Finding]:
    by_op: dict[str, list[dict[str, object]]] = {}
    for entry in torch_ops_changed(ctx.facts):
        by_op.setdefault(str(entry["op"]), []).append(entry)
    for op, entries in by_op.items():
        keys = ", ".join(str(e["key"]) for e in entries)
        who = "; ".join(dict.fromkeys(by_whom(e) for e in entries))
        replaced = any(e.get("kind") == "overrides" for e in entries)
        yield catalog.make(
            "op-overridden-at-startup",
            message=f"{op}: its {keys} kernel {'was replaced' if replaced else 'was added'} by {who}, before "
            "the program's first line. Every call of the op in every Python process on this machine runs that "
            "code instead of torch's kernel, whatever the program says.",
            evidence={
                "op": op,
                "keys": [e["key"] for e in entries],
                "kind": sorted({str(e["kind"]) for e in entries}),
                "registered_by": who,
            },
            fix=f"# the registration: {who}\n"
            "# remove it, or move it into the program that wants it, so a run says what it computes;\n"
            "# then `fpdoctor env` lists no start-up registrations (ops registered at start-up: none)",
        )
