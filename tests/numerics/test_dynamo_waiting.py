"""numerics.dynamo: what waits for the program's import of torch._dynamo waits once, however often asked."""

from __future__ import annotations

import sys

from fpdoctor.imports import AfterImport
from fpdoctor.numerics.observe import dynamo


def test_a_call_asked_for_again_before_the_import_runs_once(monkeypatch):
    monkeypatch.setattr(dynamo, "_DYNAMO", "fpd_never_imported_dynamo")
    monkeypatch.setattr(dynamo, "_then", [])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    calls: list[int] = []

    def install() -> None:
        calls.append(1)

    for _ in range(5):  # one watch after another, the program never importing it
        dynamo.when_imported(install)
    assert dynamo._then == [install]
    assert len([f for f in sys.meta_path if isinstance(f, AfterImport)]) == 1
    dynamo._skip_waiting()
    assert calls == [1]
