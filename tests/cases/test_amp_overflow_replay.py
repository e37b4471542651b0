"""Every fp16 step skipped under the Sentinel and a GradScaler (tests/fixtures/cases/amp_overflow_replay/),
run as its README says: `python train.py report.json`. The overflow is deterministic and the code's,
never `transient-fault-suspected`: the replay runs the step as it ran. What makes every step skip is
that the step never zeroes the gradients: step 1's overflow (the loss scale, 65536, is past fp16's
65504 in the loss's own backward; q·kᵀ peaks at 18352 here, inside fp16) stays in .grad. The fix,
applied as printed, leaves one skip, the scaler's calibration, and the loss moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cases.case_runs import copy_case, edit, python, read_report


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = copy_case("amp_overflow_replay", tmp_path_factory.mktemp("case"))
    proc = python(folder, "train.py", "report.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, read_report(folder / "report.json")


def test_a_deterministic_overflow_named_as_the_codes(case: tuple[Path, dict]):
    _, report = case
    names = [f["name"] for f in report["findings"]]
    assert "transient-fault-suspected" not in names, names
    first = report["findings"][0]
    assert first["code"] == "TRN005" and first["name"] == "deterministic-nonfinite", first["title"]
    assert "Replayed as it ran" in first["message"], first["message"]
    assert first["evidence"]["carried_from_step"] == 1 and first["evidence"]["carried_from_scale"] == 65536
    assert "zero_grad" in first["fix"], first["fix"]
    assert first["fix_trial"]["status"] == "checked", first["fix_trial"]
    assert report["data"]["amp"]["skipped_steps"] == report["data"]["steps"] == 30


def test_the_printed_fix_lets_it_train(case: tuple[Path, dict]):
    folder, report = case
    first = report["findings"][0]
    # As printed: "Zero the gradients at the start of every step, before the forward:
    # optimizer.zero_grad(set_to_none=True)"; the script's optimizer is `opt`, its step is `step(x)`
    assert "optimizer.zero_grad(set_to_none=True)" in first["fix"], first["fix"]
    source = (folder / "train.py").read_text().splitlines()
    start = source.index("def step(x):") + 2  # 1-based: the first line of its body, the autocast
    patched = edit(
        folder / "train.py",
        folder / "train_fixed.py",
        {start: [("    with torch.autocast", "    opt.zero_grad(set_to_none=True)\n    with torch.autocast")]},
    )
    proc = python(folder, patched.name, "fixed.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = read_report(folder / "fixed.json")
    names = [f["name"] for f in after["findings"]]
    # the trial's metric, the step's gradients, is finite from the second step on: one skip (65536 -> 32768)
    assert after["data"]["amp"]["skipped_steps"] <= 2, after["data"]["amp"]
    assert not {"deterministic-nonfinite", "training-stalled", "transient-fault-suspected"} & set(names), names
    losses = after["data"]["timeline"]["loss"]
    assert losses[-1] < 0.9 * losses[0], losses  # 0.237 -> 0.177 measured; it never moved before
    assert len(set(report["data"]["timeline"]["loss"])) == 1
