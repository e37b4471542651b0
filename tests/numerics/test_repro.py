"""`fpdoctor.trace(repro=DIR)`: the op of origin written as a standalone reproducer and run once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fpdoctor
from fpdoctor.errors import InputError
from fpdoctor.numerics.trace import repro


def _produced(report) -> dict:
    finding = next(f for f in report.findings if f.name == "nonfinite-produced")
    return dict(finding.evidence["reproducer"])


def _fresh(directory: Path) -> tuple[int, dict]:
    """repro.py in a fresh interpreter, its RESULT line read back."""
    done = subprocess.run(
        [sys.executable, str(directory / "repro.py")], capture_output=True, text=True, timeout=120, check=False
    )
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT "))
    return done.returncode, json.loads(line.removeprefix("RESULT "))


def test_the_reproducer_makes_the_nan_again_in_a_process_without_fpdoctor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = tmp_path / "repro"
    with fpdoctor.trace(repro=out) as t:
        y = x @ w
        z = torch.log(y)  # NaN where y < 0
    assert torch.isnan(z).any()
    info = _produced(t.report)
    assert info["reproduced"] is True and info["values_saved"] is True
    spec = json.loads((out / "repro.json").read_text(encoding="utf-8"))
    assert spec["op"] == "aten.log.default" and spec["format"] == "safetensors"
    assert spec["tensors"][0]["shape"] == [4, 8] and spec["device"] == "cpu"
    assert spec["expected"] == [{"nan": int(torch.isnan(z).sum()), "+inf": 0, "-inf": 0}]
    assert spec["facts"]["torch"] == torch.__version__
    code, result = _fresh(out)
    assert code == 1 and result["reproduced"] is True
    assert result["fpdoctor_imported"] is False  # the child's own check: it needs torch only


def test_values_that_matter_are_said_to_matter(tmp_path: Path) -> None:
    a, b = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 0.0, 3.0])
    with fpdoctor.trace(repro=tmp_path / "r") as t:
        torch.div(a, b)  # 0/0: seeded values in [0, 3] never hold that zero
    info = _produced(t.report)
    assert info["reproduced"] is True and info["values_matter"] is True
    code, result = _fresh(tmp_path / "r")
    assert code == 1 and result["values_matter"] is True


def test_inputs_above_the_limit_are_described_and_seeded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = tmp_path / "r"
    with fpdoctor.Trace(repro=out, repro_limit=0) as t:
        torch.log(x @ w)
    info = _produced(t.report)
    assert info["values_saved"] is False and info["reproduced"] is True and info["values_matter"] is False
    spec = json.loads((out / "repro.json").read_text(encoding="utf-8"))
    meta = spec["tensors"][0]
    assert meta["saved"] is False and meta["min"] < 0 < meta["max"] and meta["stride"] == [8, 1]
    assert not (out / "inputs.safetensors").exists() and "format" not in spec


def test_without_safetensors_the_values_are_raw_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # `import safetensors.torch` fails
    x = torch.tensor([[1.0, -2.0], [3.0, -4.0]], dtype=torch.bfloat16).t()  # strided, a dtype numpy lacks
    out = tmp_path / "r"
    with fpdoctor.trace(repro=out) as t:
        torch.sqrt(x)
    assert _produced(t.report)["reproduced"] is True
    spec = json.loads((out / "repro.json").read_text(encoding="utf-8"))
    assert spec["format"] == "raw" and spec["tensors"][0]["stride"] == [1, 2]
    assert (out / "input0.bin").stat().st_size == 4 * 2
    assert not list(out.glob("*.safetensors")) and not list(out.glob("*.pt"))
    code, result = _fresh(out)
    assert code == 1 and result["found"] == [{"nan": 2, "+inf": 0, "-inf": 0}]


def test_a_trace_that_finds_nothing_writes_nothing(tmp_path: Path) -> None:
    with fpdoctor.trace(repro=tmp_path / "r") as t:
        torch.exp(torch.ones(3))
    assert not t.report.findings
    assert not (tmp_path / "r").exists()


def test_an_op_defined_by_the_script_is_named_not_scripted(tmp_path: Path) -> None:
    @torch.library.custom_op("fpdoctortest::halve_log", mutates_args=())
    def halve_log(x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) / 2

    with fpdoctor.trace(repro=tmp_path / "r") as t:
        halve_log(torch.tensor([-1.0, 2.0]))
    finding = next(f for f in t.report.findings if f.name == "nonfinite-produced")
    info = finding.evidence["reproducer"]
    assert info["scripted"] is False and "fpdoctortest.halve_log" in info["why"]
    assert "No reproducer" in finding.message and not (tmp_path / "r").exists()


def test_a_directory_fpdoctor_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match="did not write"):
        fpdoctor.trace(repro=tmp_path)
    with pytest.raises(InputError, match="not a directory"):
        repro.check_dir(str(tmp_path / "mine.txt"))
    with pytest.raises(InputError, match="cannot be created"):
        repro.check_dir(str(tmp_path / "mine.txt" / "sub"))
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / repro.MARKER).write_text("", encoding="utf-8")
    (ours / "input7.bin").write_bytes(b"old")
    assert repro.check_dir(str(ours)) == str(ours)
    repro.write(str(ours), {"op": "aten.log.default", "tensors": []}, {})
    assert not (ours / "input7.bin").exists()  # an earlier reproducer's file is gone


def test_a_crash_reproducer_of_a_custom_op_is_named_not_scripted(tmp_path: Path) -> None:
    op = {"op": "mylib::fused", "shapes": [[4, 4]], "dtypes": ["float32"], "device": "cpu", "tensors": 1}
    directory, why = repro.write_crash(str(tmp_path / "r"), op, "SIGFPE")
    assert directory is None and "mylib.fused.default" in why and "not an aten op" in why
