"""The Lightning callback while training runs: its report file written as findings arrive (a job
killed at any point leaves one), and `stop_on` ending `fit` at the step of the first finding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import run_fpdoctor
from tests.integrations.lit import FpDoctorCallback, Net, data, pl, trainer


class Reader(pl.Callback):
    """The report file as it stands after each optimizer step (listed after fpdoctor's callback)."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.seen: dict[int, dict[str, Any] | None] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen[trainer.global_step] = json.loads(self.path.read_text()) if self.path.exists() else None


def _fit(module: Net, path: Any, max_steps: int = 8, **kwargs: Any) -> tuple[Any, Reader, Any]:
    callback = FpDoctorCallback(report_path=str(path), **kwargs)
    reader = Reader(path)
    run = trainer([callback, reader], max_steps=max_steps)
    run.fit(module, data())
    return callback, reader, run


def test_the_report_file_holds_a_finding_while_training_goes_on(tmp_path):
    path = tmp_path / "fpdoctor.json"
    callback, reader, run = _fit(Net(nan_data=(3, 1)), path)
    # written when training starts: a job killed before its first finding leaves a readable report
    assert reader.seen[1] is not None and reader.seen[1]["data"]["status"] == "in progress"
    assert reader.seen[1]["findings"] == [] and reader.seen[1]["verdict"] != "ok"
    # step 3's finding is in the file right after step 3, while training goes on to step 8
    during = reader.seen[3]
    assert during is not None and during["data"]["status"] == "in progress" and during["verdict"] == "error"
    assert {f["name"] for f in during["findings"]} >= {"nonfinite-loss", "deterministic-nonfinite"}
    assert "written while the run went on" in dict(map(tuple, during["data"]["summary"]))["ended"]
    # the end replaces it with the finished report
    assert run.global_step == 8
    done = json.loads(path.read_text())
    assert "status" not in done["data"] and done["data"]["steps"] == 8
    assert [f["name"] for f in done["findings"]] == [f.name for f in callback.report.findings]


def test_stop_on_error_ends_training_at_the_step_of_the_first_error_and_says_why(tmp_path):
    path = tmp_path / "fpdoctor.json"
    callback, reader, run = _fit(Net(nan_data=(3, 1)), path, stop_on="error")
    assert run.global_step == 3 and max(reader.seen) == 3  # no step after the one that found it
    report = callback.report
    assert report.data["steps"] == 3 and report.data["status"] == "incomplete"
    ended = dict(report.data["summary"])["ended"]
    assert ended.startswith("stopped by TRN") and "at step 3" in ended and "stop_on='error'" in ended, ended
    written = json.loads(path.read_text())
    assert written["data"]["status"] == "incomplete" and written["verdict"] == "error"
    assert dict(map(tuple, written["data"]["summary"]))["ended"] == ended


def test_stop_on_a_clean_run_changes_nothing(tmp_path):
    callback, _, run = _fit(Net(), tmp_path / "fpdoctor.json", max_steps=4, stop_on="warning")
    assert run.global_step == 4 and callback.report.findings == []
    assert "status" not in callback.report.data


@pytest.mark.parametrize("value", ["fatal", "Error", 1])
def test_a_bad_stop_on_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"^stop_on must be one of error, warning or None, got .*$"):
        FpDoctorCallback(stop_on=value)


def test_watch_stop_on_stops_the_lightning_training_it_switched_the_callback_on_for(tmp_path):
    """`fpdoctor watch --stop-on error` passes the level to the callback it switches on
    (FPDOCTOR_STOP_ON): Lightning's training ends at the step of the first error, exit status 1."""
    import os
    from pathlib import Path

    script = tmp_path / "fit.py"
    script.write_text(
        "from tests.integrations.lit import Net, data, trainer\n"
        "run = trainer([], max_steps=8)\n"
        "run.fit(Net(nan_data=(3, 1)), data())\n"
        "print('global_step', run.global_step)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("FPDOCTOR_STOP_ON", None)
    out = tmp_path / "watch.json"
    proc = run_fpdoctor("watch", "--stop-on", "error", "-o", str(out), "--", str(script), env=env, cwd=tmp_path)
    assert proc.code == 1, proc.err[-3000:]
    assert "global_step 3" in proc.out  # not 8: training ended at the first error's step
    report = json.loads(out.read_text())
    assert report["data"]["status"] == "incomplete" and report["verdict"] == "error"
    ended = dict(map(tuple, report["data"]["summary"]))["ended"]
    assert ended.startswith("stopped by TRN") and "at step 3" in ended and "--stop-on error" in ended, ended


def test_a_stop_on_the_environment_cannot_parse_is_said_and_ignored(monkeypatch, caplog):
    from fpdoctor.integrations.entry_point import stop_on_from_environment

    monkeypatch.setenv("FPDOCTOR_STOP_ON", "Warning")
    assert stop_on_from_environment("t") == "warning"
    monkeypatch.setenv("FPDOCTOR_STOP_ON", "errors")
    assert stop_on_from_environment("t") is None
    assert "FPDOCTOR_STOP_ON='errors' is neither error nor warning" in caplog.text


def test_a_report_file_that_cannot_be_written_is_said_and_stops_nothing(tmp_path):
    """The file is not a step: no sentinel-error finding, so stop_on="warning" does not end training."""
    path = "/sys/fpdoctor-report.json"  # sysfs takes no new file, even from root
    try:
        open(path, "w").close()
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    callback = FpDoctorCallback(report_path=path, stop_on="warning")
    run = trainer([callback], max_steps=8)
    run.fit(Net(), data())
    assert run.global_step == 8
    report = callback.report
    assert report.findings == [] and "sentinel-error" not in {f.name for f in report.findings}
    assert "could not be written" in report.data["not_checked"]["report file"]


def test_watch_around_a_lightning_script_says_what_the_callbacks_recipe_checks_found(tmp_path):
    """`fpdoctor watch` hands Lightning's steps to the callback it switches on and adds its findings: those
    the recipe checks read from the optimizer at the report (an AdamW eps typed 10.0 for 1e-8) were left out, and
    the run was OK with no word of what was judged."""
    import os
    from pathlib import Path

    script = tmp_path / "fit.py"
    script.write_text(
        "import torch\n"
        "from tests.integrations.lit import Net, data, trainer\n"
        "class Typo(Net):\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=10.0)\n"
        "trainer([], max_steps=24).fit(Typo(), data())\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "watch.json"
    proc = run_fpdoctor("watch", "-o", str(out), "--", str(script), env=env, cwd=tmp_path)
    assert proc.code == 0, proc.err[-3000:]
    report = json.loads(out.read_text())
    assert [f["name"] for f in report["findings"]] == ["optimizer-eps-too-large"], report["findings"]
    judged = dict(map(tuple, report["data"]["summary"]))["judged by the callback"]
    assert judged.startswith("24 optimizer step(s)"), judged
