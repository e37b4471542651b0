"""benchmarks/gpu_check.py: its one line on a machine without a GPU, and its pure parts (which
tests need a GPU, outcome tallies, budget rows, the summary, time limits that stop a hung part)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "gpu_scripts")]
import kernel_log  # noqa: E402
from gpu_tests import needs_gpu, skip_texts, tally  # noqa: E402

import gpu_check  # noqa: E402
from fpdoctor.health.kernel_sources import KernelText  # noqa: E402
from tests.test_device_fixtures import RECORDED  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU from torch, so this holds on a GPU machine too
    done = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        env=_env(CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path)),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpu-check: no CUDA GPU here (torch ") and lines[0].endswith("nothing to check")
    assert not (tmp_path / "gpu-check").exists()


@pytest.mark.parametrize(
    "reason",
    [
        "needs a CUDA device",
        "needs NVML and an NVIDIA GPU",
        "needs a CUDA GPU: device-side skipping and the asynchronous flag read",
        "requires cuBLASLt",
    ],
)
def test_a_skip_for_want_of_a_gpu_selects_the_test(reason):
    assert needs_gpu([], [reason], "", [])


@pytest.mark.parametrize(
    "reason",
    [
        "this machine has a CUDA device",
        "checks the message for a machine without CUDA",
        "with a GPU the probes run on it (test_gpu_probes_when_asked)",
        "this machine has a GPU; the no-GPU path needs none",
        "needs lightning",
    ],
)
def test_a_skip_because_a_gpu_is_there_or_for_another_need_does_not(reason):
    assert not needs_gpu([], [reason], "", [])


def test_the_gpu_marker_a_skip_in_the_body_and_a_cuda_parameter_select_the_test():
    assert needs_gpu(["parametrize", "gpu"], [], "", [])
    body = 'def test_x():\n    if not ok:\n        pytest.skip("needs an NVIDIA GPU")\n'
    assert skip_texts(body) == ["needs an NVIDIA GPU"]
    assert needs_gpu([], [], body, [])
    assert not needs_gpu([], [], 'pytest.skip("this machine has a GPU; the no-GPU path needs none")', [])
    assert needs_gpu(["parametrize"], [], "", ["cuda:0"])
    assert not needs_gpu(["parametrize"], [], "", ["cpu"])


def test_selection_runs_on_the_collected_tests_so_a_new_gpu_test_is_picked_up(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "test_mix.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.skipif(True, reason="needs a CUDA device")
            def test_cuda(): pass

            @pytest.mark.gpu
            def test_marked(): pass

            def test_in_body():
                pytest.skip("needs NVML and an NVIDIA GPU")

            @pytest.mark.skipif(False, reason="this machine has a CUDA device")
            def test_inverse(): pass

            @pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.skipif(True, reason="needs a GPU"))])
            def test_param(x): pass

            def test_plain(): pass
            """
        )
    )
    out = tmp_path / "selected.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "gpu_scripts" / "gpu_tests.py"), "--select", str(out), "--"]
    argv += [str(tmp_path), "--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    argv += ["-c", str(tmp_path / "pytest.ini")]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    chosen = json.loads(out.read_text())
    assert chosen["total"] == 7
    names = sorted(node.split("::")[1] for node in chosen["selected"])
    assert names == ["test_cuda", "test_in_body", "test_marked", "test_param[2]"]


def test_tally_takes_each_tests_worst_phase_and_ignores_a_line_cut_by_a_kill():
    lines = [
        json.dumps({"id": "a", "when": "call", "outcome": "passed"}),
        json.dumps({"id": "b", "when": "call", "outcome": "passed"}),
        json.dumps({"id": "b", "when": "teardown", "outcome": "failed"}),
        json.dumps({"id": "c", "when": "setup", "outcome": "skipped"}),
        '{"id": "d", "when": "ca',
    ]
    counts = tally(lines)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"] == ["b"] and counts["skips"] == ["c"]


def test_a_suite_stopped_at_the_budget_says_how_far_it_got_and_fails_only_on_failures():
    counts = tally([json.dumps({"id": f"t{i}", "when": "call", "outcome": "passed"}) for i in range(3)])
    status, detail = gpu_check.tests_verdict(counts, finished=False, of=1400)
    assert status == "pass" and "stopped at the budget after 3 of 1400 tests" in detail
    counts = tally([json.dumps({"id": "t", "when": "call", "outcome": "failed"})])
    assert gpu_check.tests_verdict(counts, finished=True) == ("fail", "0 passed, 1 failed, 0 skipped; failed: t")
    assert gpu_check.tests_verdict(tally([]), finished=True)[0] == "fail"  # nothing ran at all


BENCH_OUTPUT = """\
CUDA (NVIDIA H100 80GB HBM3): 8-layer transformer (dim 1024, 16 x 512 tokens), bf16 autocast
  plain (foreach AdamW)                                 41.20 ms/step   x1.000
CUDA fused (device-side skip) +0.4% (budget <= 1%)  PASS
CUDA foreach (host read) +3.5% (budget <= 3%)  FAIL
CUDA launch-bound: 2 layers dim 128, 4 x 32 tokens: 12 interleaved steps per variant, medians
  trace / floor 1.25x (budget <= 1.3x) PASS; trace / plain 1.61x (budget <= 1.5x) FAIL
ratio env / collect_env = 0.60  (budget <= 0.80)  PASS
  fingerprint (mm + digest)   612345.000 GFLOPS    96.1% of plain (budget >= 90%)  PASS
  --duration  3.0:   5.10 s wall (budget <= 10 s per node)  PASS;  2.10 s beyond the duration
"""


def test_budget_rows_are_read_from_a_benchmarks_own_lines():
    rows = gpu_check.budget_rows(BENCH_OUTPUT)
    got = [(r["row"], r["value"], r["budget"], r["verdict"]) for r in rows]
    assert got == [
        ("CUDA fused (device-side skip)", "+0.4%", "<= 1%", "PASS"),
        ("CUDA foreach (host read)", "+3.5%", "<= 3%", "FAIL"),
        ("trace / floor", "1.25x", "<= 1.3x", "PASS"),
        ("trace / plain", "1.61x", "<= 1.5x", "FAIL"),
        ("ratio env / collect_env", "0.60", "<= 0.80", "PASS"),
        ("fingerprint (mm + digest) 612345.000 GFLOPS", "96.1%", ">= 90%", "PASS"),
        ("--duration 3.0", "5.10s", "<= 10 s per node", "PASS"),
    ]
    assert rows[2]["context"].startswith("CUDA launch-bound")
    assert rows[0]["context"].startswith("CUDA (NVIDIA H100")


def _results() -> list:
    return [
        gpu_check.Result("GPU tests", "tests", "pass", "10 passed", seconds=12.0),
        gpu_check.Result(
            "bench_numerics (CUDA)",
            "bench",
            "fail",
            "1 of 2 budget rows pass",
            seconds=80.0,
            rc=1,
            ratios=gpu_check.budget_rows(BENCH_OUTPUT)[2:4],
            output="line 1\ntrace / plain 1.61x (budget <= 1.5x) FAIL\n",
        ),
        gpu_check.Result("watch bf16", "e2e", "skip", "`fpdoctor watch` is not built here"),
    ]


def test_the_summary_counts_the_parts_and_the_markdown_shows_budgets_and_failures():
    machine = {"cuda": True, "gpus": ["NVIDIA H100 80GB HBM3"], "torch": "2.11.0+cu130", "capability": "9.0"}
    summary = gpu_check.build_summary(machine, _results(), wall_s=301.24, budget_s=460)
    assert summary["counts"] == {"pass": 1, "fail": 1, "skip": 1}
    assert summary["wall_s"] == 301.2 and summary["machine"]["gpus"] == ["NVIDIA H100 80GB HBM3"]
    assert [p["status"] for p in summary["parts"]] == ["pass", "fail", "skip"]
    assert json.loads(json.dumps(summary)) == summary
    text = gpu_check.markdown(summary, _results())
    assert "NVIDIA H100 80GB HBM3 (sm 9.0)" in text and "1 passed, 1 failed, 1 skipped in 301.2 s" in text
    assert "| bench_numerics (CUDA) | fail | 80.0 | 1 of 2 budget rows pass |" in text
    assert "| trace / plain" not in text  # rows carry their heading
    assert "trace / plain | 1.61x | <= 1.5x | FAIL |" in text
    assert "### bench_numerics (CUDA)" in text and "trace / plain 1.61x (budget <= 1.5x) FAIL" in text
    assert "watch bf16" in gpu_check.table(summary)


def test_the_machines_facts_come_back_as_a_fixture_folder_the_cpu_suite_reads(tmp_path):
    """What the device tool brings back (at most 8 files, at most 2 folders below $OUT): the
    summary, the crash report, and fixtures/ holding the files tests/test_device_fixtures.py reads."""
    assert set(gpu_check.FIXTURES) == set(RECORDED)
    work, out = tmp_path / "work", tmp_path / "OUT" / "gpu-check"
    work.mkdir()
    for name in (*gpu_check.FIXTURES, *gpu_check.ARTIFACTS, "env.json", "selected.json"):
        (work / name).write_text(name)
    summary = gpu_check.build_summary({"cuda": True}, _results(), wall_s=1.0, budget_s=460)
    gpu_check.write_outputs(out, work, summary, _results())
    files = sorted(str(p.relative_to(out.parent)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        [f"gpu-check/{n}" for n in ("summary.json", "summary.md", "parts.log", *gpu_check.ARTIFACTS)]
        + [f"gpu-check/fixtures/{n}" for n in gpu_check.FIXTURES]
    )
    assert len(files) <= 8 and all(f.count("/") <= 2 for f in files)
    assert (out / "fixtures" / "kernel.log").read_text() == "kernel.log"


def test_a_failed_nvidia_smi_leaves_no_fixture(tmp_path):
    ctx = gpu_check.Context(work=tmp_path, env={}, deadline=0.0)
    failed = gpu_check.Outcome(rc=9, seconds=0.1, output="NVIDIA-SMI has failed because it couldn't communicate")
    assert gpu_check._judge_smi(ctx, failed)[0] == "fail" and not (tmp_path / "nvidia-smi-q.txt").exists()
    ok = gpu_check.Outcome(rc=0, seconds=0.1, output="==============NVSMI LOG==============\n")
    assert gpu_check._judge_smi(ctx, ok)[0] == "pass" and (tmp_path / "nvidia-smi-q.txt").exists()


KERNEL_LINES = [
    "2026-11-20T09:14:02,000000+00:00 Linux version 6.8.0-1015-nvidia (buildd@lcy02-amd64-050) #16-Ubuntu SMP",
    "2026-11-20T09:14:03,100000+00:00 EXT4-fs (nvme0n1p1): mounted filesystem",
    "2026-11-20T09:14:09,733980+00:00 NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release",
    "2026-11-20T10:01:12,000000+00:00 NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python, Ch 00000008",
    '2026-11-20T10:02:00,000000+00:00 audit: type=1400 apparmor="STATUS"',
]


def test_the_kernel_log_keeps_the_nvidia_lines_and_boot_markers_that_health_reads_back(tmp_path, cli, capsys):
    out = tmp_path / "kernel.log"
    assert kernel_log.main([str(out)], read=lambda: KernelText("dmesg", KERNEL_LINES)) == 0
    assert capsys.readouterr().out == "2 NVIDIA line(s) of 5 kept from dmesg\n"
    assert out.read_text().splitlines() == [KERNEL_LINES[0], KERNEL_LINES[2], KERNEL_LINES[3]]
    facts = json.loads(cli("health", "--from", str(out), "--format", "json").out)["data"]["facts"]
    assert facts["driver"] == "580.159.04" and [(x["xid"], x["pci"]) for x in facts["xids"]] == [(31, "0000:18:00.0")]


def test_a_kernel_log_without_nvidia_lines_or_unreadable_writes_no_file(tmp_path, capsys):
    out = tmp_path / "kernel.log"
    quiet = KernelText("dmesg", [KERNEL_LINES[0], KERNEL_LINES[1]])
    assert kernel_log.main([str(out)], read=lambda: quiet) == 0 and not out.exists()
    denied = KernelText(None, [], tried={"dmesg": "not readable: kernel.dmesg_restrict=1"})
    assert kernel_log.main([str(out)], read=lambda: denied) == kernel_log.NOT_READ and not out.exists()
    said = capsys.readouterr().out.splitlines()
    assert said == ["0 NVIDIA line(s) of 2 kept from dmesg; no file",
                    "no kernel log could be read: dmesg: not readable: kernel.dmesg_restrict=1"]  # fmt: skip
    ctx = gpu_check.Context(work=tmp_path, env={}, deadline=0.0)
    assert gpu_check._judge_kernel_log(ctx, gpu_check.Outcome(kernel_log.NOT_READ, 0.1, said[1]))[0] == "skip"


def test_no_gpu_line():
    assert gpu_check.no_gpu_line({"cuda": True}) is None
    assert "no CUDA GPU here (torch 2.5" in str(gpu_check.no_gpu_line({"cuda": False, "torch": "2.5"}))
    assert "torch does not import" in str(gpu_check.no_gpu_line({"error": "torch does not import: X"}))


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # a zombie not yet reaped by its new parent has ended


def test_a_hung_part_is_stopped_at_its_limit_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    outcome = gpu_check.run_command([sys.executable, "-c", code], limit_s=3)
    assert outcome.timed_out and outcome.rc is None
    assert time.monotonic() - start < 15
    assert "started" in outcome.output
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild)


def test_a_part_over_its_limit_fails_the_next_still_runs_and_the_budget_skips_the_rest(tmp_path):
    sleeper = gpu_check.Part("sleeps", "e2e", 2, lambda ctx: [sys.executable, "-c", "import time; time.sleep(30)"])
    quick = gpu_check.Part(
        "quick", "e2e", 30, lambda ctx: [sys.executable, "-c", "print('ok')"], lambda ctx, o: ("pass", o.output.strip())
    )
    ctx = gpu_check.Context(work=tmp_path, env=dict(os.environ), deadline=time.monotonic() + gpu_check.RESERVE_S + 60)
    slow = gpu_check.run_part(sleeper, ctx)
    assert (slow.status, slow.timed_out) == ("fail", True) and "stopped at its time limit (2 s)" in slow.detail
    assert slow.seconds < 10
    assert gpu_check.run_part(quick, ctx).detail == "ok"
    ctx.deadline = time.monotonic() + gpu_check.RESERVE_S + 2  # less than a part's least time is left
    late = gpu_check.run_part(quick, ctx)
    assert (late.status, late.detail) == ("skip", "no time left in the budget")


def test_a_parts_limit_is_cut_to_what_the_budget_has_left():
    assert gpu_check.part_limit(90, deadline=1000, now=500) == 90
    assert gpu_check.part_limit(90, deadline=1000, now=950) == 50 - gpu_check.RESERVE_S


def test_the_gpu_scripts_run_where_no_gpu_is():
    scripts = ROOT / "benchmarks" / "gpu_scripts"
    for dtype in ("fp16", "bf16"):
        argv = [sys.executable, str(scripts / "train_amp.py"), "--device", "cpu", "--dtype", dtype, "--steps", "2"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert f"{dtype} on cpu: 2 steps" in done.stdout
    done = subprocess.run(
        [sys.executable, str(scripts / "sigfpe.py"), "--device", "cpu"], capture_output=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGFPE
