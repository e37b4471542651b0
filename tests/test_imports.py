"""fpdoctor.imports: a function runs once the program imports a module, and the import is as usual."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from fpdoctor.imports import AfterImport, after_import


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    (tmp_path / "fpd_waited.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("fpd_waited", None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AfterImport)]


def test_runs_once_after_the_import_and_leaves_the_module_as_it_would_be(module_dir):
    calls: list[int] = []
    finder = after_import("fpd_waited", lambda: calls.append(sys.modules["fpd_waited"].VALUE))
    assert sys.meta_path[0] is finder
    assert importlib.util.find_spec("fpd_waited") is not None  # a look-up only: still waiting
    assert calls == [] and finder in sys.meta_path
    module = importlib.import_module("fpd_waited")
    assert calls == [42]  # after the module's code ran
    assert finder not in sys.meta_path
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__
    importlib.reload(module)
    assert calls == [42]


def test_what_the_function_raises_never_reaches_the_import(module_dir):
    def boom() -> None:
        raise RuntimeError("observer bug")

    after_import("fpd_waited", boom)
    assert importlib.import_module("fpd_waited").VALUE == 42


def test_other_modules_pass_by(module_dir):
    calls: list[str] = []
    after_import("fpd_not_this_one", lambda: calls.append("x"))
    importlib.import_module("fpd_waited")
    assert calls == []
