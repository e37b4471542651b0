"""The Hugging Face callback while training runs: its report file written as findings arrive (a job
killed at any point leaves one), and `stop_on` ending `train()` at the step of the first finding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integrations.hf import FpDoctorCallback, Tokens, arguments, poison_activation, tiny_gpt2, transformers


class Reader(transformers.TrainerCallback):
    """The report file as it stands after each optimizer step (listed after fpdoctor's callback)."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.seen: dict[int, dict[str, Any] | None] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen[state.global_step] = json.loads(self.path.read_text()) if self.path.exists() else None


def _train(tmp_path: Any, nan_at: int | None, **kwargs: Any) -> tuple[Any, Reader, Any]:
    path = tmp_path / "fpdoctor.json"
    model = tiny_gpt2()
    # a fault comes at a count of forwards, which the reference step's two extra ones would move
    callback = FpDoctorCallback(report_path=str(path), reference_every=0, **kwargs)
    reader = Reader(path)
    box: list[Any] = []
    if nan_at is not None:
        poison_activation(model, lambda: box[0].state.global_step + 1 == nan_at)
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp_path), train_dataset=Tokens(), callbacks=[callback, reader]
    )
    box.append(trainer)
    trainer.train()
    return callback, reader, trainer


def test_the_report_file_holds_a_finding_while_training_goes_on(tmp_path):
    callback, reader, trainer = _train(tmp_path, nan_at=3)
    # written when training starts: a job killed before its first finding leaves a readable report
    assert reader.seen[1] is not None and reader.seen[1]["data"]["status"] == "in progress"
    assert reader.seen[1]["findings"] == [] and reader.seen[1]["verdict"] != "ok"
    # step 3's finding is in the file right after step 3, while training goes on to step 6
    during = reader.seen[3]
    assert during is not None and during["data"]["status"] == "in progress" and during["verdict"] == "error"
    assert {f["name"] for f in during["findings"]} >= {"nonfinite-loss", "deterministic-nonfinite"}
    assert "written while the run went on" in dict(map(tuple, during["data"]["summary"]))["ended"]
    # the end replaces it with the finished report
    assert trainer.state.global_step == 6
    done = json.loads((tmp_path / "fpdoctor.json").read_text())
    assert "status" not in done["data"] and done["data"]["steps"] == 6
    assert [f["name"] for f in done["findings"]] == [f.name for f in callback.report.findings]


def test_stop_on_error_ends_training_at_the_step_of_the_first_error_and_says_why(tmp_path):
    callback, reader, trainer = _train(tmp_path, nan_at=3, stop_on="error")
    assert trainer.state.global_step == 3 and max(reader.seen) == 3  # no step after the one that found it
    report = callback.report
    assert report.data["steps"] == 3 and report.data["status"] == "incomplete"
    ended = dict(report.data["summary"])["ended"]
    assert ended.startswith("stopped by TRN") and "at step 3" in ended and "stop_on='error'" in ended, ended
    written = json.loads((tmp_path / "fpdoctor.json").read_text())
    assert written["data"]["status"] == "incomplete" and written["verdict"] == "error"
    assert dict(map(tuple, written["data"]["summary"]))["ended"] == ended


@pytest.mark.parametrize("value", ["fatal", "Error", 1])
def test_a_bad_stop_on_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"^stop_on must be one of error, warning or None, got .*$"):
        FpDoctorCallback(stop_on=value)
