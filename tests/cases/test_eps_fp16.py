"""An epsilon that is 0 in fp16 (tests/fixtures/cases/eps_fp16/), run as its README says:
`fpdoctor trace -- train.py --amp fp16` says first that the optimizer never ran (the GradScaler skipped
every step), names the `1e-12` in `sqrt(d2 + 1e-12)` that is 0 in fp16 and a replacement value; that
value, put in place of 1e-12 as printed, trains: no step skipped but the scale's calibration, and the
recall the run prints goes from chance to that of the run without AMP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.cases.case_runs import copy_case, edit, fpdoctor, line_of, python, read_report

FIX = re.compile(r"Replace the constant (\S+) at (\S+:\d+) \(it is 0 in float16\) with ([0-9.e+-]+),")


def _recall(stdout: str) -> float:
    match = re.search(r"recall@1 after training: ([0-9.]+)", stdout)
    assert match, stdout
    return float(match[1])


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:
    folder = copy_case("eps_fp16", tmp_path_factory.mktemp("case"))
    proc, report = fpdoctor(folder, "trace", "--", "train.py", "--amp", "fp16")
    assert proc.returncode == 1, proc.stderr[-3000:]  # an error-level finding
    return folder, report, _recall(proc.stdout)


def test_the_optimizer_never_ran_then_the_eps(case: tuple[Path, dict, float]):
    _, report, recall = case
    first = report["findings"][0]
    assert first["code"] == "NUM015" and first["name"] == "grad-scaler-stalled", first["title"]
    assert "the optimizer never ran" in first["title"]
    assert first["evidence"]["skipped"] == first["evidence"]["steps"] == 150
    assert first["where"]["forward_op"] == "aten.sqrt.default" and first["where"]["phase"] == "backward"
    fix = FIX.search(first["fix"])
    assert fix, first["fix"]
    constant, location, replacement = fix.groups()
    assert float(constant) == 1e-12 and line_of(location) == ("train.py", 17)
    # the user's eps is 0 in fp16; the replacement is not
    assert torch.tensor(float(constant), dtype=torch.float16) == 0
    assert torch.tensor(float(replacement), dtype=torch.float16) > 0
    assert first["fix_trial"]["status"] == "checked", first["fix_trial"]
    # the evidence says what the op was handed: an input it lists as holding an Inf is not "finite"
    handed = [i for i in first["evidence"]["origin"]["inputs"] if i.get("nonfinite")]
    assert ("from finite inputs" in first["message"]) == (not handed), first["message"]
    assert recall < 0.2  # the untrained model's recall@1 (0.14 before training)


def test_the_printed_eps_trains(case: tuple[Path, dict, float]):
    folder, report, recall_before = case
    constant, location, replacement = FIX.search(report["findings"][0]["fix"]).groups()  # type: ignore[union-attr]
    _, line = line_of(location)
    edit(folder / "train.py", folder / "train_fixed.py", {line: [(constant, replacement)]})
    proc, after = fpdoctor(folder, "trace", "--", "train_fixed.py", "--amp", "fp16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the trial's metric, aten.div.Tensor's output in sqrt's backward, is free of NaN: the scaler skips no
    # step past its calibration (65536 -> 32768, one step) and nothing is left at warning or error level
    assert after["verdict"] == "ok", [(f["code"], f["title"]) for f in after["findings"]]
    assert [f["name"] for f in after["findings"]] == ["grad-scaler-calibrated"]
    assert after["findings"][0]["evidence"]["skipped"] <= 2
    # and it trains: recall@1 0.12 -> 1.00 measured (1.00 without AMP)
    assert _recall(proc.stdout) >= 0.9 > recall_before


def test_watch_reaches_the_same_fix_by_tracing_a_step_after_the_replay(case: tuple[Path, dict, float]):
    """`fpdoctor watch` replays the model alone, which cannot see the loss code that makes the NaN; it
    traces the next training step, and leads with the fix `trace` prints, checked the same way."""
    folder, report, _ = case
    # watch shows no progress display, so no -q
    proc = python(
        folder, "-m", "fpdoctor", "watch", "-o", str(folder / "watch.json"), "--", "train.py", "--amp", "fp16"
    )
    watched = read_report(folder / "watch.json")
    assert proc.returncode == 0, proc.stderr[-3000:]  # the script's own status
    first = watched["findings"][0]
    assert (
        FIX.search(first["fix"])
        and FIX.search(first["fix"]).groups() == FIX.search(report["findings"][0]["fix"]).groups()
    )  # type: ignore[union-attr]
    assert first["fix_trial"]["status"] == "checked" and first["evidence"]["traced_step"] > 1
    traced = watched["data"]["traced_step"]
    assert traced["armed_by"] < traced["step"] and traced["findings"][0] == first["code"]
    # the replay's own findings of the recurring step print the traced fix, not a guess at the loss code
    for f in watched["findings"]:
        if f["name"] in ("deterministic-nonfinite", "training-stalled"):
            assert FIX.search(f["fix"]), f["fix"]
