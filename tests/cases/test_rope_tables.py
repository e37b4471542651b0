"""The rotary tables built in the model's dtype (tests/fixtures/cases/rope_tables/), run as its README says:
`fpdoctor compare factory.py:make --candidate bf16` leads with the lines that build the angles in bf16
(the frequency table and the cast of the positions, before `cos`), and its fix, applied as printed to
run.py, brings every window of `python run.py --dtype bf16` to about 0.008 relative error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cases.case_runs import copy_case, edit, fpdoctor, line_of, python, relative_errors


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = copy_case("rope_tables", tmp_path_factory.mktemp("case"))
    proc, report = fpdoctor(folder, "compare", "factory.py:make", "--candidate", "bf16")
    assert proc.returncode == 1, proc.stderr[-3000:]  # an error-level divergence
    return folder, report


def test_the_first_finding_is_the_bf16_angles(case: tuple[Path, dict]):
    _, report = case
    first = report["findings"][0]
    assert first["code"] == "NUM006", first["title"]
    ev = first["evidence"]
    # the op that shows the error (sin or cos) is not the cause: what it reads is, made on the lines before it
    assert ev["own_op"] in ("aten.sin.default", "aten.cos.default"), ev
    op_file, op_line = line_of(ev["own_op_location"])
    feeding = [line_of(loc) for loc in ev["feeding_lines"]]
    # run.py:17 builds inv_freq in bf16, run.py:18 rounds the positions to bf16
    assert ("run.py", 17) in feeding and ("run.py", 18) in feeding, feeding
    assert (op_file, op_line) == ("run.py", 20)
    assert "lines 17-20" in first["fix"] and "fp32" in first["fix"], first["fix"]
    assert "``" not in first["fix"]  # the root module has no name to quote ("``'s output error" before)
    trial = first["fix_trial"]
    assert trial["status"] == "checked", trial
    assert trial["after"] < 0.01 and trial["before"] > 10 * trial["after"], trial


def test_the_decisions_finding_leads_with_the_checked_line_fix(case: tuple[Path, dict]):
    """NUM018 prints the fix that gives the decisions back, the lines' fix, with its top-1 measured on
    the run that checked it (no module set was tried in its place: each left top-1 at 50.7%, and the
    report printed "run `fpdoctor plan` for a larger set" as the fix)."""
    _, report = case
    first, decisions = report["findings"][0], report["findings"][1]
    assert decisions["code"] == "NUM018", decisions["title"]
    lines_fix = first["fix"].partition("; checked:")[0]
    assert decisions["fix"].startswith(lines_fix), decisions["fix"]
    assert "fpdoctor plan" not in decisions["fix"], decisions["fix"]
    trial = decisions["fix_trial"]
    assert trial["status"] == "checked" and trial["changed"] == first["fix_trial"]["changed"], trial
    before, after = (float(trial[k].rstrip("%")) / 100 for k in ("before", "after"))
    assert f"checked: top-1 {trial['before']} -> {trial['after']}" in decisions["fix"], decisions["fix"]
    assert before < 0.6 and after > 0.95, trial  # 50.8% -> 98.5%
    assert decisions["evidence"]["kept_in_fp32_tried"] == []  # the checked run's output was judged: no forward more
    assert decisions["evidence"]["lines_in_fp32"]["top1"] == pytest.approx(after, abs=0.001)


def test_the_printed_fix_brings_every_window_to_its_checked_error(case: tuple[Path, dict]):
    folder, report = case
    first, decisions = report["findings"][0], report["findings"][1]
    feeding = sorted(line_of(loc)[1] for loc in first["evidence"]["feeding_lines"])
    assert feeding == [17, 18, 19, 20]
    # As printed: "compute lines 17-20 in fp32 (a cast .to(torch.bfloat16) or a dtype=torch.bfloat16 there
    # becomes torch.float32), then .to(torch.bfloat16) on each value they make that a later line reads (or
    # .to(p.dtype), p one of the model's parameters)". That is run.py's `dtype` argument (the model's
    # dtype): cos as well as sin, both being line 20's results (an fp32 cos beside a bf16 sin would make
    # q and k fp32 and v bf16).
    patched = edit(
        folder / "run.py",
        folder / "run_fixed.py",
        {
            17: [("dtype=dtype", "dtype=torch.float32")],
            18: [("positions.to(dtype)", "positions.to(torch.float32)")],
            20: [("angles.cos()", "angles.cos().to(dtype)"), ("angles.sin()", "angles.sin().to(dtype)")],
        },
    )
    before = python(folder, "run.py", "--dtype", "bf16")
    after = python(folder, patched.name, "--dtype", "bf16")
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    was, now = relative_errors(before.stdout, "positions"), relative_errors(after.stdout, "positions")
    assert sorted(now) == [0, 1024, 4096, 16384]
    checked = first["fix_trial"]["after"]  # 0.008: the end-to-end error the trial measured, against fp64
    # every window within 2x of the checked figure (run.py judges each window against fp32); before the
    # fix the windows past position 1024 were 0.38-0.52
    assert all(err <= 2 * checked for err, _ in now.values()), (checked, now)
    assert max(err for err, _ in was.values()) > 10 * checked, was
    # the decisions come back as the decisions finding's trial says (98.5%), every window within 3 points
    # (run.py judges each window against fp32; the trial, the four windows against fp64)
    top1 = float(decisions["fix_trial"]["after"].rstrip("%")) / 100
    assert min(agree for _, agree in was.values()) < top1 - 0.2, was
    assert all(agree >= top1 - 0.03 for _, agree in now.values()), (top1, now)


def test_plan_prints_the_same_checked_fix(case: tuple[Path, dict]):
    """No set of modules kept in fp32 can fix tables built in the model's own forward: `plan` says so
    and prints compare's checked line fix, never a guess beside it (the same engine, one verdict)."""
    folder, compared = case
    _, planned = fpdoctor(folder, "plan", "factory.py:make", "--candidate", "bf16")
    fix, trial = compared["findings"][0]["fix"], compared["findings"][0]["fix_trial"]
    assert planned["findings"][0]["fix"] == fix and planned["findings"][0]["fix_trial"] == trial
    for f in planned["findings"]:
        if f["name"] == "precision-divergence":
            assert f["fix"].startswith(fix) and f["fix_trial"] == trial, (f["title"], f["fix"])
    # the decisions: compare's finding as it is, the same fix checked by top-1
    (decided,) = [f for f in planned["findings"] if f["name"] == "decisions-changed"]
    (compared_decisions,) = [f for f in compared["findings"] if f["name"] == "decisions-changed"]
    assert decided["fix"] == compared_decisions["fix"] and decided["fix_trial"] == compared_decisions["fix_trial"]
