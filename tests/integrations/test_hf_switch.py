"""integrations.hf_switch: the Trainer wrap waits for the script's own import of its module, leaves
that module as the import made it, and never raises into the import; nothing waits after the watch."""

from __future__ import annotations

import importlib
import sys

import pytest

from fpdoctor.integrations import hf_switch

TRAINER = "fpd_fake_trainer"


@pytest.fixture
def trainer_module(tmp_path, monkeypatch):
    (tmp_path / f"{TRAINER}.py").write_text("class Trainer:\n    def __init__(self):\n        self.made = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hf_switch, "_TRAINER", TRAINER)
    meta_path = list(sys.meta_path)
    yield
    sys.modules.pop(TRAINER, None)
    sys.meta_path[:] = meta_path


def test_the_module_imported_inside_the_watch_is_wrapped_and_left_as_the_import_made_it(trainer_module):
    with hf_switch.callback_in_trainers():
        module = importlib.import_module(TRAINER)
        assert hasattr(module.Trainer.__init__, "__wrapped__")
        assert module.Trainer().made  # a Trainer with no callback handler is made as without the watch
        assert type(module.__loader__).__name__ == "SourceFileLoader"
        assert module.__spec__.loader is module.__loader__
    assert not hasattr(module.Trainer.__init__, "__wrapped__")


def test_a_module_never_imported_leaves_nothing_waiting_after_the_watch(trainer_module):
    before = list(sys.meta_path)
    with hf_switch.callback_in_trainers():
        assert len(sys.meta_path) == len(before) + 1
    assert sys.meta_path == before


def test_a_wrap_that_fails_is_noted_and_never_reaches_the_import(trainer_module, monkeypatch):
    def broken(trainer):
        raise RuntimeError("observer bug")

    monkeypatch.setattr(hf_switch, "_wrapped", broken)
    noted: list[tuple[str, str]] = []
    with hf_switch.callback_in_trainers(lambda doing, exc: noted.append((doing, str(exc)))):
        assert importlib.import_module(TRAINER).Trainer().made
    assert noted == [("switching the fpdoctor callback on in the Hugging Face Trainer", "observer bug")]
