"""`fpdoctor trace -- SCRIPT.py ARGS` end to end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import Result, run_fpdoctor, run_python

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h / (h - h) if sys.argv[1] == "bad" else h

    torch.manual_seed(0)
    model = nn.Sequential(Scorer(), nn.Linear(8, 1))
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    print("loss", loss.item())
""")


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _split(err: str) -> tuple[str, dict]:
    """The script's own stderr, and the JSON report fpdoctor wrote after it (stdout is the script's)."""
    at = err.index('{\n  "schema"')
    return err[:at], json.loads(err[at:])


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """`fpdoctor trace --format json -- train.py bad`, a plain run (no --fail-on, no launcher): the
    script's folder and the result, for the tests that read it (each run is an interpreter that
    imports torch)."""
    folder = tmp_path_factory.mktemp("bad")
    return folder, run_fpdoctor("trace", "--format", "json", "--", _script(folder), "bad")


def test_trace_a_script_that_makes_nan(bad_run):
    tmp_path, result = bad_run
    assert result.code == 1
    _, doc = _split(result.err)
    assert "{" not in result.out  # the script's stdout is its own
    first = next(f for f in doc["findings"] if f["name"] == "nonfinite-produced")
    assert first["where"]["module"] == "0" and first["where"]["op"] == "aten.div.Tensor"
    assert first["evidence"]["location"].startswith(str(tmp_path / "train.py"))
    assert doc["data"]["summary"][0] == ["script", f"{tmp_path / 'train.py'} bad"]


def test_trace_a_healthy_script(tmp_path):
    result = run_fpdoctor("trace", "--", _script(tmp_path), "good")
    assert result.code == 0 and "loss" in result.out and "OK" in result.err and "OK" not in result.out


def test_script_errors_are_reported_with_exit_1(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\nx = torch.ones(2) / 0\nraise RuntimeError('boom')\n")
    result = run_fpdoctor("trace", "--format", "json", "--", str(path))
    assert result.code == 1 and "RuntimeError: boom" in result.err
    _, doc = _split(result.err)
    assert "boom" in doc["data"]["not_checked"]["script"]
    # what was traced first (it may be the cause), then how the script ended
    assert [f["name"] for f in doc["findings"]] == ["nonfinite-produced", "uncaught-exception"]


CRASH = textwrap.dedent("""
    import torch

    def pick(values, i):
        return values[i]

    print("loaded")
    pick(torch.ones(3), 10)
""")


def test_a_script_that_crashed_is_never_ok(tmp_path):
    path = tmp_path / "crash.py"
    path.write_text(CRASH)
    plain = run_python(str(path), timeout=300)
    result = run_fpdoctor("trace", "--format", "json", "--fail-on", "never", "--", str(path))
    assert result.code == plain.returncode == 1  # the script's fate, whatever --fail-on says of findings
    assert result.out == plain.stdout == "loaded\n"
    _, doc = _split(result.err)
    assert doc["verdict"] == "error"
    (f,) = doc["findings"]
    assert (f["code"], f["name"], f["severity"]) == ("CRS002", "uncaught-exception", "error")
    assert f["evidence"]["exception"] == "IndexError" and f["evidence"]["exit_code"] == 1
    assert f["evidence"]["error"] == "index 10 is out of bounds for dimension 0 with size 3"
    assert f["where"] == {"file": str(path), "line": 5, "function": "pick"}
    assert "IndexError: index 10 is out of bounds" in f["message"] and f"{path}:5 in pick" in f["message"]


def test_sys_exit_codes_are_the_scripts(tmp_path):
    path = tmp_path / "stop.py"
    path.write_text("import sys\nimport torch\ntorch.ones(2) / 0\nsys.exit(int(sys.argv[1]))\n")
    stopped = run_fpdoctor("trace", "--format", "json", "--", str(path), "3")
    assert stopped.code == 3
    _, doc = _split(stopped.err)
    ended = doc["findings"][-1]
    assert ended["name"] == "uncaught-exception" and ended["evidence"]["exception"] == "SystemExit"
    assert ended["where"]["line"] == 4 and "sys.exit(3)" in ended["message"]
    finished = run_fpdoctor("trace", "--format", "json", "--fail-on", "never", "--", str(path), "0")
    _, doc = _split(finished.err)  # sys.exit(0) ends well: only what was traced is reported
    assert finished.code == 0 and [f["name"] for f in doc["findings"]] == ["nonfinite-produced"]


def test_a_script_terminated_by_sigterm_gets_its_report_then_fpdoctor_dies_of_it(tmp_path):
    """As `python SCRIPT.py` would die of it (returncode -15, a shell's 143): the report of what ran
    first, whose headline says the script was not checked to its end, never OK."""
    path = tmp_path / "job.py"
    path.write_text("import os, signal, torch\ntorch.ones(2) + 1\nos.kill(os.getpid(), signal.SIGTERM)\nprint('on')\n")
    result = run_fpdoctor("trace", "--", str(path), timeout=120)
    assert (result.code, result.out) == (-signal.SIGTERM, "")
    assert result.err.strip().splitlines()[0].split()[:3] == ["INCOMPLETE", "fpdoctor", "trace"], result.err
    assert "terminated by SIGTERM before the script ended" in result.err


WARNS = "import torch\nx = torch.full((64,), 30000.0, dtype=torch.float16)\nprint(float((x * 2.05).max()))\n"


def test_fail_on_chooses_which_findings_fail_a_script_that_ended_well(tmp_path, bad_run):
    bad, warns = _script(tmp_path), tmp_path / "warns.py"
    warns.write_text(WARNS)
    assert bad_run[1].code == 1  # a plain run: error-level findings fail CI
    assert run_fpdoctor("trace", "--fail-on", "warning", "--", str(warns)).code == 1
    # under a launcher a rank's findings do not fail it, unless asked
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert run_fpdoctor("trace", "--", bad, "bad", env=env).code == 0


@pytest.mark.parametrize(
    ("verdict", "fail_on", "code"),
    [
        ("error", "error", 1),
        ("error", "never", 0),
        ("warning", "error", 0),
        ("warning", "warning", 1),
        ("ok", "warning", 0),
        ("info", "warning", 0),
    ],
)
def test_fail_on_decides_the_exit_status_of_a_script_that_ended_well(verdict, fail_on, code):
    from fpdoctor.cli.trace_outcome import default_fail_on, status
    from fpdoctor.report.model import Finding, Report, Severity

    findings = (
        []
        if verdict == "ok"
        else [Finding(code="NUM999", name="x", severity=Severity(verdict), title="t", message="m")]
    )
    report = Report(command="trace", findings=findings)
    assert report.verdict == ("ok" if verdict == "info" else verdict)
    assert status(0, report, fail_on) == code
    assert status(3, report, fail_on) == 3  # the script's own failure is its status, whatever was found
    assert (default_fail_on(False), default_fail_on(True)) == ("error", "never")


def test_bad_usage(tmp_path, cli):
    missing = cli("trace", "--", str(tmp_path / "none.py"))
    assert missing.code == 2 and "no such script" in missing.err
    bad_dtype = cli("trace", "--dtype", "fp12", "--", _script(tmp_path), "good")
    assert bad_dtype.code == 2 and "--dtype" in bad_dtype.err
    typo = cli("trace", "--dtype", "bf61", "--", _script(tmp_path), "good")  # one set of names with compare/plan
    assert typo.code == 2 and "did you mean bf16?" in typo.err


def test_autocast_what_if(tmp_path):
    result = run_fpdoctor("trace", "--dtype", "bf16", "--format", "json", "--", _script(tmp_path), "good")
    _, doc = _split(result.err)
    assert ["autocast", "cpu bfloat16"] in doc["data"]["summary"]
    assert result.code == 0


CURVE = textwrap.dedent("""
    import contextlib, sys
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)

        def forward(self, x):
            h = F.gelu(self.a(x))
            with torch.autocast(x.device.type, enabled=False):  # a region the code keeps in fp32, backward too
                g = h.float() @ self.b.weight.float().t()
            return self.head(torch.softmax(h @ g.t() / 8, -1) @ h)

    real = sys.argv[1]  # a dtype: the autocast region of a real loop; "none": plain fp32 code
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where trace --dtype autocasts
    for name in ("SGD", "AdamW"):
        torch.manual_seed(0)
        model = Net().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if name == "SGD" else \\
            torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = torch.randn(64, 16, device=device), torch.randint(0, 5, (64,), device=device)
        losses = []
        for step in range(5):
            region = torch.autocast(device, dtype=getattr(torch, real)) if real != "none" else contextlib.nullcontext()
            with region:  # the model called twice: one cast copy of each weight, shared
                loss = F.cross_entropy(model(x), y) + 0.1 * (model(x) - model(x.flip(0))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(name, losses)
""")


@pytest.mark.parametrize(("flag", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_the_autocast_what_if_trains_as_a_real_autocast_run(tmp_path, flag, dtype):
    path = tmp_path / "curve.py"
    path.write_text(CURVE)
    real = run_python(str(path), dtype, check=True, timeout=300)
    what_if = run_fpdoctor("trace", "--dtype", flag, "--", str(path), "none")
    assert what_if.code == 0, what_if.err[-2000:]
    curves = dict(line.split(" ", 1) for line in real.stdout.splitlines())
    assert set(curves) == {"SGD", "AdamW"}
    # loss after loss, bit for bit: the what-if trains the weights each step made, as the real run does
    assert what_if.out == real.stdout
    assert all(len(set(json.loads(c))) == 5 for c in curves.values())  # and the loss moves


MISMATCH = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.time_embed = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8))

        def forward(self, x):
            return self.time_embed(self.body(x))

    model = Net().half()
    model.time_embed[2].float()  # one layer stayed fp32
    model(torch.randn(2, 8, dtype=torch.float16))
""")


def test_a_dtype_error_is_explained_and_the_traceback_is_the_users(tmp_path):
    path = tmp_path / "mismatch.py"
    path.write_text(MISMATCH)
    result = run_fpdoctor("trace", "--format", "json", "--", str(path))
    assert result.code == 1
    traceback, doc = _split(result.err)
    assert doc["verdict"] == "error"
    (f,) = [f for f in doc["findings"] if f["name"] == "dtype-mismatch"]
    assert f["where"] == {"module": "time_embed.2", "op": "aten.addmm.default", "phase": "forward"}
    origins = {o["origin"] for o in f["evidence"]["operands"]}
    assert "parameter time_embed.2.weight" in origins
    assert "a tensor made by aten.silu.default in module `time_embed.1`" in origins
    assert f["evidence"]["expected"] == "torch.float16" and f["evidence"]["dtype"] == "torch.float32"
    assert f["fix"].startswith("model.get_submodule('time_embed.2').to(torch.float16)")
    # the traceback a plain run prints: the script's lines, torch's modules, nothing of ours
    assert "Traceback (most recent call last)" in traceback
    assert f'File "{path}", line 12, in forward' in traceback
    assert "mat1 and mat2 must have the same dtype" in traceback
    assert "fpdoctor" not in traceback and "runpy" not in traceback and "_dynamo" not in traceback


def test_headroom_is_opt_in(tmp_path):
    plain = run_fpdoctor("trace", "--format", "json", "--", _script(tmp_path), "good")
    _, doc = _split(plain.err)
    assert doc["data"]["headroom"] == []
    with_headroom = run_fpdoctor("trace", "--headroom", "--format", "json", "--", _script(tmp_path), "good")
    _, doc = _split(with_headroom.err)
    # "0" and the root hand on their last child's output: counted once, for the child
    assert {row["module"] for row in doc["data"]["headroom"]} == {"0.lin", "1"}


DDP_SCRIPT = textwrap.dedent("""
    import datetime
    import os
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    scale = 0.0 if rank == 1 else 1.0  # rank 1's batch: a zero scale
    y = model(x)
    loss = (y / (y * scale)).sum()  # y / 0: Inf on rank 1 only
    loss.backward()
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.jobs  # 2-rank torchrun job
def test_torchrun_one_report_per_rank_and_a_merged_one(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "report.json"
    code, err = _torchrun(["-m", "fpdoctor", "trace", "--format", "json", "-o", str(out), "--", str(script)])
    assert code == 0, err[-2000:]  # rank 1 found an error, and its script ended well
    ranks = [json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in (0, 1)]
    host = socket.gethostname()
    for r, doc in enumerate(ranks):
        assert doc["data"]["distributed"] == {"rank": r, "world_size": 2, "local_rank": r, "host": host}
        assert all(f["where"]["rank"] == r and f["where"]["host"] == host for f in doc["findings"])
    assert ranks[0]["verdict"] == "ok"
    first = next(f for f in ranks[1]["findings"] if f["name"] == "nonfinite-produced")
    assert first["where"]["rank"] == 1
    merged = json.loads(out.read_text())
    assert merged["verdict"] == "error" and merged["data"]["distributed"]["merged"]
    assert {f["where"]["rank"] for f in merged["findings"]} == {1}
    assert [row["rank"] for row in merged["data"]["ranks"]] == [0, 1]
    assert not list(tmp_path.glob(".report.json.rank*"))  # the merge's own files are gone


def _torchrun(args, timeout=90):
    # --standalone: a free port and a fresh run id; a session of its own so a hang is killed whole
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err


SURVIVOR_SCRIPT = textwrap.dedent("""
    import os
    import time
    import torch

    rank = int(os.environ["RANK"])
    y = torch.ones(3) / torch.zeros(3) if rank == 0 else torch.ones(3)  # rank 0 holds the bad batch
    if rank == 1:
        raise SystemExit(5)  # rank 1 fails at once: torchrun terminates rank 0
    time.sleep(60)
""")


@pytest.mark.jobs  # 2-rank torchrun job
def test_a_rank_terminated_by_torchrun_still_writes_its_report(tmp_path):
    script = tmp_path / "survivor.py"
    script.write_text(SURVIVOR_SCRIPT)
    out = tmp_path / "report.json"
    code, err = _torchrun(["-m", "fpdoctor", "trace", "--format", "json", "-o", str(out), "--", str(script)])
    assert code != 0
    rank0 = json.loads((tmp_path / "report.rank0.json").read_text())
    assert "SIGTERM" in rank0["data"]["not_checked"]["script"], err[-2000:]
    assert [f["name"] for f in rank0["findings"]] == ["nonfinite-produced"]
    assert json.loads(out.read_text())["verdict"] == "error"  # both ranks wrote: the merged view exists


DDP_TRAIN_SCRIPT = textwrap.dedent("""
    import datetime
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(6, 4)
        if rank == 1 and step == 2:
            x[3] = torch.log(x[3] - 10)  # rank 1's batch: log of negatives, NaN
        opt.zero_grad()
        model(x).square().mean().backward()  # the all-reduce carries rank 1's NaN to rank 0
        opt.step()
    dist.destroy_process_group()
""")


@pytest.mark.jobs  # 2-rank torchrun job
def test_torchrun_ddp_nan_from_another_rank_is_received_not_made(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_TRAIN_SCRIPT)
    out = tmp_path / "report.json"
    code, err = _torchrun(["-m", "fpdoctor", "trace", "--fail-on", "error", "-o", str(out), "--", str(script)])
    assert code != 0, err[-2000:]  # asked to: a rank with error-level findings fails
    rank0, rank1 = (json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in (0, 1))
    # rank 0 made nothing non-finite: what it got came through the all-reduce
    assert not [f for f in rank0["findings"] if f["name"] == "nonfinite-produced"], rank0["findings"]
    received = [f for f in rank0["findings"] if f["name"] == "nonfinite-input"]
    assert received and received[0]["evidence"]["origin"] == "collective", rank0["findings"]
    assert "allreduce" in received[0]["message"]
    made = next(f for f in rank1["findings"] if f["name"] == "nonfinite-produced")
    assert made["where"]["op"] == "aten.log.default"
    merged = json.loads(out.read_text())
    assert merged["findings"][0]["name"] == "nonfinite-produced" and merged["findings"][0]["where"]["rank"] == 1


EARLY_SCRIPT = textwrap.dedent("""
    import datetime
    import sys
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    dist.barrier()
    if rank == 0:
        torch.ones(3) / torch.zeros(3)  # rank 0: a finding, and done at once
    else:
        time.sleep(4)  # rank 1 still works when rank 0 has finished
        open(sys.argv[1], "w").write("rank 1 done")
    dist.destroy_process_group()
""")


@pytest.mark.jobs  # 2-rank torchrun job
def test_torchrun_a_rank_with_findings_that_finishes_first_leaves_the_others_working(tmp_path):
    script, done = tmp_path / "early.py", tmp_path / "rank1.out"
    script.write_text(EARLY_SCRIPT)
    out = tmp_path / "report.json"
    code, err = _torchrun(["-m", "fpdoctor", "trace", "-o", str(out), "--", str(script), str(done)], timeout=120)
    assert code == 0, err[-2000:]
    assert done.read_text() == "rank 1 done"  # never terminated by the launcher
    rank0 = json.loads((tmp_path / "report.rank0.json").read_text())
    assert [f["name"] for f in rank0["findings"]] == ["nonfinite-produced"]
    rank1 = json.loads((tmp_path / "report.rank1.json").read_text())
    assert rank1["verdict"] == "ok" and "script" not in rank1["data"]["not_checked"]
    assert json.loads(out.read_text())["verdict"] == "error"
