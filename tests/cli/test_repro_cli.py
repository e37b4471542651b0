"""`--repro DIR` end to end: `fpdoctor trace` at the op of origin, `fpdoctor run --breadcrumbs` at a fatal signal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import run_fpdoctor

NAN_SCRIPT = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    y = torch.randn(4, 8) @ torch.randn(8, 8)
    print(torch.log(y).sum())
""")

# SIGFPE right after a Linear ran: the breadcrumbs' last op is its addmm
FPE_SCRIPT = textwrap.dedent("""
    import os, signal
    import torch
    lin = torch.nn.Linear(16, 8)
    lin.register_forward_hook(lambda module, args, out: os.kill(os.getpid(), signal.SIGFPE))
    lin(torch.randn(4, 16))
""")


def test_trace_writes_a_reproducer_that_a_fresh_python_runs(tmp_path: Path) -> None:
    script = tmp_path / "nan.py"
    script.write_text(NAN_SCRIPT, encoding="utf-8")
    out, report = tmp_path / "repro", tmp_path / "report.json"
    result = run_fpdoctor("trace", "--repro", str(out), "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    finding = next(f for f in json.loads(report.read_text(encoding="utf-8"))["findings"])
    assert finding["name"] == "nonfinite-produced"
    assert finding["evidence"]["reproducer"]["reproduced"] is True
    assert f"Reproducer: python {out / 'repro.py'}" in finding["message"]
    done = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and '"fpdoctor_imported": false' in done.stdout


def test_a_repro_directory_that_is_not_fpdoctors_is_one_line_and_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "nan.py"
    script.write_text(NAN_SCRIPT, encoding="utf-8")
    for command in (["trace", "--repro", str(tmp_path), "--", str(script)],
                    ["run", "--breadcrumbs", "--repro", str(tmp_path), "--", sys.executable, str(script)],
                    ["run", "--breadcrumbs", "--repro", str(script / "sub"), "--", sys.executable, str(script)],
                    ["run", "--repro", str(tmp_path / "new"), "--", sys.executable, str(script)]):  # fmt: skip
        result = run_fpdoctor(*command)
        assert result.code == 2, (command, result.err)
        assert len(result.err.strip().splitlines()) == 1 and "--repro" in result.err
        assert not result.out  # nothing ran


def test_run_breadcrumbs_writes_the_op_in_flight_with_its_recorded_shapes(tmp_path: Path) -> None:
    script = tmp_path / "fpe.py"
    script.write_text(FPE_SCRIPT, encoding="utf-8")
    out, report = tmp_path / "repro", tmp_path / "report.json"
    result = run_fpdoctor(
        "run", "--breadcrumbs", "--repro", str(out), "-o", str(report), "--", sys.executable, str(script)
    )
    assert result.code == -8, result.err  # died of SIGFPE, as the script did
    spec = json.loads((out / "repro.json").read_text(encoding="utf-8"))
    assert spec["op"] == "aten.addmm.default" and spec["crash"] == "SIGFPE" and spec["device"] == "cpu"
    assert [t["shape"] for t in spec["tensors"]] == [[8], [4, 16], [16, 8]]
    finding = next(f for f in json.loads(report.read_text(encoding="utf-8"))["findings"] if f["name"] == "fatal-signal")
    info = finding["evidence"]["reproducer"]
    assert info["scripted"] is True and info["reproduced"] is False  # the kill came from the hook, not addmm
    assert any(c.startswith("compute-sanitizer --tool memcheck ") for c in info["rerun"])
    assert any("CUBLASLT_LOG_LEVEL=5 " in c for c in info["rerun"])
    assert "compute-sanitizer" in finding["fix"]
    done = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "calling aten.addmm.default(torch.float32[8], torch.float32[4, 16], torch.float32[16, 8])" in done.stdout
