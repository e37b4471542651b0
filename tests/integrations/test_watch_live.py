"""`fpdoctor watch` while the script runs: a finding on stderr when it is decided, a report file that
a SIGKILL leaves readable, and `--stop-on` for CI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from tests.integrations.test_watch import _env, _write

# a NaN loss on step 3 of a long run (every run of step 3: the replay sees it too), then healthy steps
LONG = """
import sys, time, torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, int(sys.argv[1]) + 1):
    opt.zero_grad()
    out = model(torch.randn(8, 4))
    loss = out.pow(2).mean() * (float("nan") if step == 3 else 1.0)
    loss.backward()
    opt.step()
    print(f"step {step}", flush=True)
    time.sleep(0.005)
print("done", flush=True)
"""


def _popen(tmp_path, *options: str, steps: int = 100_000) -> subprocess.Popen[str]:
    script = _write(tmp_path, "long.py", LONG)
    command = [sys.executable, "-m", "fpdoctor", "watch", *options, "--", str(script), str(steps)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env()
    )


def test_a_finding_is_on_stderr_when_decided_and_a_sigkill_leaves_a_readable_report_holding_it(tmp_path):
    report = tmp_path / "report.json"
    proc = _popen(tmp_path, "-o", str(report))
    guard = threading.Timer(180, proc.kill)  # a line that never comes fails the test, never hangs it
    guard.start()
    try:
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:
            said.append(line)
            if line.startswith("fpdoctor: step 3: "):
                break
        assert said and said[-1].startswith("fpdoctor: step 3: "), said
        code, name = said[-1].split(": ", 2)[2].split()[:2]
        assert proc.poll() is None  # decided and said while the script runs
        # the file is written before the line is said: killed now, the report holds the finding
        proc.kill()
        proc.wait(timeout=60)
    finally:
        guard.cancel()
        proc.kill()
    doc = json.loads(report.read_text())
    assert doc["data"]["status"] == "in progress" and doc["verdict"] == "error"
    assert [f["name"] for f in doc["findings"] if f["code"] == code] == [name]
    assert doc["data"]["summary"][0] == ["script", f"{tmp_path / 'long.py'} 100000"]
    assert doc["data"]["summary"][1][0] == "ended" and "written while the run went on" in doc["data"]["summary"][1][1]


def test_stop_on_error_ends_a_long_script_early_with_exit_1_and_a_report(tmp_path):
    report = tmp_path / "report.json"
    proc = _popen(tmp_path, "--stop-on", "error", "-o", str(report))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    assert steps[-1] < 10 and "done" not in out, out  # stopped at the optimizer step after step 3's finding
    assert "Traceback" not in err and any(line.startswith("fpdoctor: step 3: ") for line in err.splitlines()), err
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "error" and doc["data"]["status"] == "incomplete"
    ended = dict(map(tuple, doc["data"]["summary"]))["ended"]
    assert ended.startswith("stopped by ") and "--stop-on error" in ended, ended
    assert "stopped by --stop-on error" in doc["data"]["not_checked"]["script"]


def test_stop_on_warning_is_a_choice_and_a_bad_level_is_exit_2(tmp_path):
    proc = _popen(tmp_path, "--stop-on", "fatal", steps=3)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'fatal'" in err, err
