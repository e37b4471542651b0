"""Lightning's entry point: FPDOCTOR_LIGHTNING=1 adds the callback to every Trainer with no code
change; installed but not switched on, it adds nothing and imports nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tests.integrations.lit import FpDoctorCallback, Net, _Hooks, data, logged, trainer


def _ours(run) -> list:
    return [cb for cb in run.callbacks if isinstance(cb, _Hooks)]


def test_the_package_declares_both_factories():
    for group, name in [
        ("lightning.pytorch.callbacks_factory", "lightning_callbacks"),
        ("pytorch_lightning.callbacks_factory", "pytorch_lightning_callbacks"),
    ]:
        (point,) = [p for p in entry_points(group=group) if p.name == "fpdoctor"]
        assert point.value == f"fpdoctor.integrations.entry_point:{name}"


@pytest.mark.parametrize("value", [None, "0", "", "off"])
def test_switched_off_no_trainer_gets_a_callback(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("FPDOCTOR_LIGHTNING", raising=False)
    else:
        monkeypatch.setenv("FPDOCTOR_LIGHTNING", value)
    assert _ours(trainer([])) == []


def test_switched_on_every_trainer_gets_one_and_it_writes_its_report(monkeypatch, tmp_path):
    path = tmp_path / "fpdoctor.json"
    monkeypatch.setenv("FPDOCTOR_LIGHTNING", "1")
    monkeypatch.setenv("FPDOCTOR_REPORT", str(path))
    run = trainer([], max_steps=4)
    (callback,) = _ours(run)
    run.fit(Net(nan_data=(2, 1)), data())
    assert [f.evidence["step"] for f in callback.report.by_name("nonfinite-loss")] == [2]
    written = json.loads(path.read_text())
    assert written["data"]["verdicts"] == {"2": "deterministic-nonfinite"}


def test_a_callback_the_user_gives_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("FPDOCTOR_LIGHTNING", "yes")
    mine = FpDoctorCallback()
    run = trainer([mine], max_steps=3)
    ours = _ours(run)
    assert len(ours) == 2
    run.fit(Net(nan_data=(2, 1)), data())
    (other,) = [cb for cb in ours if cb is not mine]
    assert mine.report.data["steps"] == 3 and len(mine.report.by_name("nonfinite-loss")) == 1
    assert other.report.data["steps"] == 0  # it stood down: one sentinel per Trainer


def test_a_value_that_is_neither_on_nor_off_is_said_and_means_off(monkeypatch):
    monkeypatch.setenv("FPDOCTOR_LIGHTNING", "maybe")
    with logged("lightning.pytorch.fpdoctor") as lines:
        assert _ours(trainer([])) == []
    assert lines and "FPDOCTOR_LIGHTNING='maybe' is neither on nor off" in lines[0]


def test_a_report_path_that_cannot_be_written_is_said_and_the_run_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("FPDOCTOR_LIGHTNING", "1")
    monkeypatch.setenv("FPDOCTOR_REPORT", str(tmp_path / "missing" / "r.json"))
    with logged("lightning.pytorch.fpdoctor") as lines:
        run = trainer([], max_steps=2)
    (callback,) = _ours(run)
    assert callback.report_path is None
    assert any("FPDOCTOR_REPORT" in line and "does not exist" in line for line in lines)
    run.fit(Net(), data())
    assert callback.report.data["steps"] == 2


def test_pytorch_lightning_gets_a_callback_of_its_own_kind(monkeypatch):
    pl_legacy = pytest.importorskip("pytorch_lightning")
    monkeypatch.setenv("FPDOCTOR_LIGHTNING", "1")
    run = pl_legacy.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    (callback,) = [cb for cb in run.callbacks if isinstance(cb, _Hooks)]
    assert isinstance(callback, pl_legacy.Callback)


def test_switched_off_the_factory_imports_nothing():
    code = (
        "import sys\n"
        "from fpdoctor.integrations.entry_point import lightning_callbacks, pytorch_lightning_callbacks\n"
        "assert lightning_callbacks() == [] and pytorch_lightning_callbacks() == []\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning')"
        " or m.startswith('fpdoctor.integrations.')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FPDOCTOR_LIGHTNING"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.strip() == "['fpdoctor.integrations.entry_point']"
