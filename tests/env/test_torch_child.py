"""`import torch` in a child: facts on success, the cause on failure, every other fact regardless."""

from __future__ import annotations

import textwrap

import torch

from fpdoctor.env.collect import finish_torch_child
from fpdoctor.env.sources import torch_child
from tests.conftest import run_fpdoctor
from tests.env.strict import strict_json


def test_child_reports_this_torch():
    facts = finish_torch_child(torch_child.spawn())
    assert facts["import"] == "ok" and facts["stage"] == "done"
    assert facts["version"] == torch.__version__
    assert facts["cuda"] == torch.version.cuda
    assert facts["precision"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert any(path.endswith("libtorch_cpu.so") for path in facts["mapped"])


def _broken_torch(tmp_path, body: str):
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": str(tmp_path)}


def test_import_error_is_captured(tmp_path, monkeypatch):
    env = _broken_torch(
        tmp_path,
        """
        raise ImportError("/x/libcusparse.so.12: undefined symbol: __nvJitLink_12_4, version libnvJitLink.so.12")
    """,
    )
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    facts = finish_torch_child(torch_child.spawn())
    assert facts["import"] == "failed"
    assert "undefined symbol: __nvJitLink_12_4" in facts["error"]


def test_import_killed_by_a_signal(tmp_path, monkeypatch):
    env = _broken_torch(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    facts = finish_torch_child(torch_child.spawn())
    assert facts["import"] == "failed" and facts["signal"] == "SIGILL"


def test_env_diagnoses_a_broken_torch_and_still_collects_the_rest(tmp_path):
    env = _broken_torch(
        tmp_path,
        """
        raise ImportError("A module that was compiled using NumPy 1.x cannot be run in\\n"
                          "NumPy 2.1.0 as it may crash. ... _ARRAY_API not found")
    """,
    )
    result = run_fpdoctor("env", "--format", "json", env=env)
    doc = strict_json(result.out)
    assert result.code == 1
    names = {f["name"] for f in doc["findings"]}
    assert {"torch-import-failed", "numpy-abi-mismatch"} <= names
    facts = doc["data"]["facts"]
    assert facts["python"]["version"] and facts["os"]["system"] == "Linux"  # the other sources still ran
    cause = next(f for f in doc["findings"] if f["name"] == "torch-import-failed")
    assert cause["evidence"]["known_issue"] == "NUMPY2_ABI" and "numpy<2" in cause["fix"]
