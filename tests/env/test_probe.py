"""GEMM probes in child processes: results, crashes and hangs never take fpdoctor down."""

from __future__ import annotations

from fpdoctor.env.probe import default_specs, run_probes
from tests.env.strict import strict_json


def _spec(name, dtype="fp32", **extra):
    return {"name": name, "dtype": dtype, "shape": [64, 128, 32], "device": "cpu", **extra}


def test_cpu_probes_pass_against_the_float64_reference():
    results = run_probes([_spec("a"), _spec("b", "bf16"), _spec("c", "fp16")])
    for r in results:
        assert r["status"] == "ok", r
        assert 0 <= r["max_abs_err"] <= r["tolerance"]


def test_a_probe_killed_by_sigfpe_is_reported_and_the_rest_still_run():
    results = run_probes([_spec("before"), _spec("crash", "bf16", fault="sigfpe"), _spec("after", "fp16")])
    assert [r["status"] for r in results] == ["ok", "crashed", "ok"]
    assert results[1]["signal"] == "SIGFPE" and results[1]["returncode"] == -8


def test_a_hanging_probe_is_killed_after_its_timeout():
    results = run_probes([_spec("hang", fault="hang"), _spec("after")], timeout_s=2)
    assert results[0]["status"] == "timeout"
    assert results[1]["status"] == "ok"


def test_default_plan():
    cpu = [s["dtype"] for s in default_specs("cpu", None)]
    assert cpu == ["fp32", "bf16", "fp16"]
    hopper = default_specs("cuda", (9, 0))
    assert [s["dtype"] for s in hopper][:5] == ["fp32", "tf32", "bf16", "fp16", "fp8_e4m3"]
    assert {"h20-linear-bf16", "h20-gemm-fp16"} <= {s["name"] for s in hopper}
    assert "fp8_e4m3" not in [s["dtype"] for s in default_specs("cuda", (8, 0))]


def test_probe_crash_becomes_a_finding_end_to_end(cli, tmp_path):

    # The recorded H20 facts plus a live probe that really dies of SIGFPE.
    from fpdoctor.env.doctor import diagnose_env
    from tests.conftest import ENV_FIXTURES

    facts = strict_json((ENV_FIXTURES / "rules" / "ENV101-cublas-h20-sigfpe.json").read_text())
    report = diagnose_env(facts=facts, probe=True, probe_specs=[_spec("h20-linear-bf16", "bf16", fault="sigfpe")])
    crashed = report.by_name("probe-crashed")
    assert len(crashed) == 1 and crashed[0].evidence["signal"] == "SIGFPE"
    assert "ENV101 cublas-h20-sigfpe explains it" in crashed[0].message
    assert report.exit_code == 1


def test_a_probe_that_raises_is_noted_and_its_text_is_evidence():

    import torch

    from fpdoctor.env.doctor import diagnose_env
    from tests.conftest import ENV_FIXTURES

    facts = strict_json((ENV_FIXTURES / "rules" / "ENV201-probe-crashed.json").read_text())
    # One past the last CUDA device, on any machine: "invalid device ordinal" where there are GPUs,
    # "not compiled with CUDA" or "no NVIDIA driver" where there are none. Each one raises.
    missing = f"cuda:{torch.cuda.device_count()}"
    spec = {"name": "gemm-fp32", "dtype": "fp32", "shape": [16, 16, 16], "device": missing}
    report = diagnose_env(facts=facts, probe=True, probe_specs=[spec])
    assert report.data["facts"]["probes"][0]["status"] == "error"
    assert "probe gemm-fp32" in report.data["not_checked"]
    assert report.findings == []


def test_a_child_that_writes_a_lot_to_stderr_is_not_taken_for_a_hang(tmp_path, monkeypatch):
    """More than a pipe holds on stderr (debug logging of a CUDA library) while the probe runs:
    the child must not block on its write, and the end of what it wrote is kept as evidence."""
    import types

    from fpdoctor.env import probe
    from fpdoctor.env.probe_child import RESULT, START

    script = tmp_path / "noisy_child.py"
    script.write_text(
        "import json, os, signal, sys\n"
        "for spec in json.loads(sys.argv[1]):\n"
        f"    print({START!r} + spec['name'], flush=True)\n"
        "    sys.stderr.write('cublas debug line\\n' * 120_000)  # ~2 MiB\n"
        "    sys.stderr.flush()\n"
        "    if spec['name'] == 'dies':\n"
        "        sys.stderr.write('last words\\n')\n"
        "        sys.stderr.flush()\n"
        "        os.kill(os.getpid(), signal.SIGABRT)\n"
        f"    print({RESULT!r} + json.dumps({{'name': spec['name'], 'status': 'ok'}}), flush=True)\n"
    )
    monkeypatch.setattr(probe, "probe_child", types.SimpleNamespace(__file__=str(script)))
    monkeypatch.setattr(probe, "IMPORT_ALLOWANCE_S", 5.0)
    results = run_probes([_spec("a"), _spec("dies"), _spec("b")], timeout_s=5)
    assert [r["status"] for r in results] == ["ok", "crashed", "ok"]
    assert results[1]["signal"] == "SIGABRT" and results[1]["stderr_tail"].endswith("cublas debug line\nlast words\n")


def test_a_child_that_cannot_start_is_a_result_not_an_exception(monkeypatch, tmp_path):
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    results = run_probes([_spec("a"), _spec("b")])
    assert [r["status"] for r in results] == ["error", "error"]
    assert results[0]["error"].startswith("probe child did not start: [Errno 2]")
