"""`fpdoctor watch -- train.py`: scripts written as users write them, run unmodified.

Healthy -> bitwise the same final weights as without the watch; a NaN injected once from outside
the script -> skipped, replayed, transient; a model that overflows fp16 at a fixed line under a
GradScaler -> deterministic-nonfinite at that line with a finite fp32 control; a 2-rank DDP job on
gloo with the fault on rank 1 -> rank 1 named by both ranks; bad input -> one line, exit 2."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fpdoctor
from tests import distillation, zygote
from tests.conftest import run_python

TRAIN = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
g = torch.Generator().manual_seed(1)
for step in range(1, 9):
    opt.zero_grad()
    for micro in range(2):  # gradient accumulation
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y) / 2
        loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8, generator=g))  # an evaluation forward between steps
    model.train()
torch.save(model.state_dict(), sys.argv[1])
print("trained", flush=True)
"""

# a NaN written into the first Linear's output on the 7th training forward of the process, from
# outside the script (a global hook): the replay's forward is a later call, so it is finite
INJECT = """
import runpy, sys, torch
calls = [0]
def hook(module, args, output):
    if isinstance(module, torch.nn.Linear) and module.in_features == 8 and torch.is_grad_enabled():
        calls[0] += 1
        if calls[0] == 7:
            output = output.clone()
            output[0, 0] = float("nan")
            return output
torch.nn.modules.module.register_module_forward_hook(hook)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

AMP = """
import torch
from torch import nn
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x):
        h = self.a(x)
        h = h * h * 1000.0  # overflows fp16
        return self.b(h)

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(5):
    x, y = torch.randn(8, 16, generator=g) * 20, torch.randn(8, 1, generator=g)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""

DDP = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
state = {"step": 0, "done": False}

def hook(grad):  # rank 1's first backward of step 3 only: a one-off fault
    if rank == 1 and state["step"] == 3 and not state["done"]:
        state["done"] = True
        grad = grad.clone()
        grad[0, 0] = float("nan")
    return grad

model.module[0].weight.register_hook(hook)
g = torch.Generator().manual_seed(10 + rank)
for step in range(1, 7):
    state["step"] = step
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
dist.destroy_process_group()
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _env() -> dict[str, str]:
    """The environment the runs below get: the tests' own where the fpdoctor they import is this tree's
    (`make test`: an editable install), else with this tree's src first on PYTHONPATH."""
    src = Path(__file__).resolve().parents[2] / "src"
    if Path(fpdoctor.__file__).resolve().is_relative_to(src):
        return dict(os.environ)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}


def _watch(
    tmp_path: Path, *command: str, timeout: int = 240, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`python -m fpdoctor watch ... -- COMMAND` in tmp_path, forked from the tests' server where it can
    be (tests/zygote.py: torch imported once), else in a new interpreter."""
    args = ["-m", "fpdoctor", "watch", *options, "-o", str(tmp_path / "report.json"), "--", *command]
    env = _env()
    if zygote.served(args, env):
        with contextlib.chdir(tmp_path):
            code, out, err = zygote.run(args, env, timeout)
        return subprocess.CompletedProcess([sys.executable, *args], code, out, err)
    return subprocess.run(
        [sys.executable, *args], check=False, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )


def _report(tmp_path: Path, name: str = "report.json") -> dict:
    return json.loads((tmp_path / name).read_text())


@pytest.fixture(scope="module")
def plain_train(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """TRAIN as python runs it, without fpdoctor: its stdout and its weights, which the watched
    runs of it below must give bitwise."""
    tmp = tmp_path_factory.mktemp("plain")
    script = _write(tmp, "train.py", TRAIN)
    plain = run_python(str(script), str(tmp / "plain.pt"), timeout=120)
    assert plain.returncode == 0, plain.stderr
    return plain.stdout, torch.load(tmp / "plain.pt")


def test_a_healthy_script_trains_to_bitwise_the_same_weights(tmp_path, plain_train):
    script = _write(tmp_path, "train.py", TRAIN)
    stdout, a = plain_train
    watched = _watch(tmp_path, "python", str(script), str(tmp_path / "watched.pt"))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == stdout  # the script's stdout is its own
    b = torch.load(tmp_path / "watched.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = _report(tmp_path)
    assert report["verdict"] == "ok" and report["data"]["steps"] == 8 and report["data"]["micro_batches"] == 16


def test_a_nan_injected_once_is_skipped_replayed_and_called_transient(tmp_path):
    script = _write(tmp_path, "train.py", TRAIN)
    inject = _write(tmp_path, "inject.py", INJECT)
    # the fault comes at a call count, which the reference step's two extra forwards would move
    watched = _watch(tmp_path, str(inject), str(script), str(tmp_path / "w.pt"), options=("--reference-every", "0"))
    assert watched.returncode == 0, watched.stderr
    assert "fpdoctor watch: step 4: non-finite, skipped; transient-fault-suspected" in watched.stderr
    report = _report(tmp_path)
    names = [f["name"] for f in report["findings"]]
    assert names == ["nonfinite-loss", "transient-fault-suspected"]
    assert report["data"]["skipped_steps"] == 1 and report["data"]["verdicts"] == {"4": "transient-fault-suspected"}


# knowledge distillation with KL(p_t || p_s) written out: where the confident teacher's softmax
# underflows to 0, its entropy term is 0 * log(0) = NaN in the loss, while every gradient (through
# the student's log-softmax alone) is finite: the script trains, its loss prints NaN
DISTILL = """
import sys, torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
teacher = nn.Linear(8, 10)
with torch.no_grad():
    teacher.weight.mul_(300.0)
teacher.requires_grad_(False)
student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
for step in range(1, 13):
    x = torch.randn(16, 8, generator=g)
    p_t = F.softmax(teacher(x), dim=-1)
    loss = (p_t * (p_t.log() - F.log_softmax(student(x), dim=-1))).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save(student.state_dict(), sys.argv[1])
print("trained", flush=True)
"""


def test_a_nan_loss_whose_gradients_are_finite_is_applied_as_the_script_applies_it(tmp_path):
    """The watch keeps a non-finite gradient from the weights; a NaN loss with finite gradients
    makes a finite update, which the script applies: skipping it would change the run."""
    script = _write(tmp_path, "distill.py", DISTILL)
    plain = run_python(str(script), str(tmp_path / "plain.pt"), timeout=120)
    assert plain.returncode == 0
    watched = _watch(tmp_path, str(script), str(tmp_path / "watched.pt"))
    assert watched.returncode == 0, watched.stderr
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise the plain run's weights
    report = _report(tmp_path)
    loss = next(f for f in report["findings"] if f["name"] == "nonfinite-loss")
    assert "its gradients were finite, so its update was applied" in loss["message"], loss["message"]
    assert report["data"]["skipped_steps"] == 0
    assert "training-stalled" not in [f["name"] for f in report["findings"]]
    assert report["findings"][0]["name"] == "nonfinite-produced"  # at the loss's line, the cause


def test_an_fp16_overflow_under_a_grad_scaler_is_named_at_its_line_with_a_finite_fp32_control(tmp_path):
    script = _write(tmp_path, "amp.py", AMP)
    watched = _watch(tmp_path, str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    verdict = next(f for f in report["findings"] if f["name"] == "deterministic-nonfinite")
    line = next(i for i, text in enumerate(script.read_text().splitlines(), start=1) if "overflows fp16" in text)
    assert verdict["where"]["op"] == "aten.mul.Tensor"
    assert verdict["evidence"]["location"].endswith(f"amp.py:{line} in forward")
    assert verdict["evidence"]["control_fp32"] == "finite"
    assert verdict["evidence"]["occurrences"] == 2  # replayed twice, the rest counted under the cause
    stalled = next(f for f in report["findings"] if f["name"] == "training-stalled")
    assert "the optimizer never ran" in stalled["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.jobs  # 2-rank torchrun job
def test_under_torchrun_every_rank_names_the_rank_that_held_the_fault(tmp_path):
    script = _write(tmp_path, "ddp.py", DDP)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    watch = ["-m", "fpdoctor", "watch", "-o", str(tmp_path / "report.json"), "--", str(script)]
    run = subprocess.run(
        [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *watch],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        report = _report(tmp_path, f"report.rank{rank}.json")
        gradient = next(f for f in report["findings"] if f["name"] == "nonfinite-gradient")
        assert gradient["where"]["rank"] == 1 and gradient["evidence"]["step"] == 3
        assert report["data"]["verdicts"] == {"3": "transient-fault-suspected"}
        # the ranks' gradient norms rode in the step's all-reduce (the corruption sentinel, calibrating)
        assert report["data"]["corruption"]["ranks"] == 2 and report["data"]["corruption"]["judged_steps"] >= 1
    merged = _report(tmp_path)
    assert {f["where"]["rank"] for f in merged["findings"]} == {1}


COMPRESSED = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
MEAN = "--mean" in sys.argv
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
opt = torch.optim.SGD(model.parameters(), lr=1e-7)
g = torch.Generator().manual_seed(10 + rank)
for step in range(1, 7):
    x = torch.randn(128, 16, generator=g)
    y = 50.0 * x[:, :1] + 200.0  # raw units
    if rank == 1 and step == 3:
        y = 40.0 * y  # one shard's batch of outliers
    err = (model(x) - y) ** 2
    opt.zero_grad()
    (err.mean() if MEAN else err.sum()).backward()
    opt.step()
dist.destroy_process_group()
"""


def _torchrun_watch(tmp_path: Path, script: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 -m fpdoctor watch -o OUT/report.json -- SCRIPT ARGS` on loopback."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    watch = ["-m", "fpdoctor", "watch", "-o", str(out / "report.json"), "--", str(script), *args]
    return subprocess.run(
        [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *watch],
        check=False, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=_env(),
    )  # fmt: skip


# fp16 autocast with a GradScaler; rank 1's shard holds a raw column near 4e4: its cast overflows every step
OVERFLOWING_RANK = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(1, 5):
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    if rank == 1:
        x[:, 3] = 40000.0 + 15000.0 * x[:, 3]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
dist.destroy_process_group()
"""


@pytest.mark.jobs  # a 2-rank torchrun job
def test_under_torchrun_the_replayed_ranks_findings_name_that_rank_and_the_forwards_line(tmp_path):
    script = _write(tmp_path, "ddp.py", OVERFLOWING_RANK)
    run = _torchrun_watch(tmp_path, script, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    forward = next(i for i, line in enumerate(OVERFLOWING_RANK.splitlines(), 1) if line.endswith("# FORWARD"))
    merged = _report(tmp_path)
    produced = next(f for f in merged["findings"] if f["name"] == "nonfinite-produced")
    assert produced["where"]["rank"] == 1 and produced["title"].startswith("rank 1: ")
    replayed = next(f for f in merged["findings"] if f["name"] == "deterministic-nonfinite")
    assert replayed["where"]["rank"] == 1 and f"ddp.py:{forward} in" in replayed["evidence"]["location"]
    # rank 0's own: its steps skipped with rank 1's (the all-reduced gradients were Inf), nothing it made
    assert {f["name"] for f in merged["findings"] if f["where"].get("rank") == 0} <= {"training-stalled"}


@pytest.mark.jobs  # two 2-rank torchrun jobs
def test_a_gradient_past_the_compression_hooks_dtype_is_told_by_the_hook_not_the_machine(tmp_path):
    """DDP's fp16_compress_hook casts each bucket to fp16 before the all-reduce; the replay runs without
    the reduction, so it is finite. That is not a fault that did not reproduce: the rank whose local
    gradient is past fp16's range is named with the hook, and its fix (a mean loss) as printed is clean."""
    script = _write(tmp_path, "compressed.py", COMPRESSED)
    for arm in ([], ["--mean"]):
        out = tmp_path / ("mean" if arm else "sum")
        out.mkdir()
        run = _torchrun_watch(tmp_path, script, out, *arm)
        assert run.returncode == 0, run.stderr[-3000:]
        merged = _report(out)
        if arm:
            assert not [f for f in merged["findings"] if f["severity"] == "error"], merged["findings"]
            continue
        names = [f["name"] for f in merged["findings"]]
        assert "transient-fault-suspected" not in names, names
        told = next(f for f in merged["findings"] if f["name"] == "deterministic-nonfinite")
        assert told["where"]["rank"] == 1 and told["evidence"]["comm_hook"] == "fp16_compress_hook", told
        assert told["evidence"]["local_grad_absmax"] > 65504 and "a mean over the batch" in told["fix"]
        assert told["fix_trial"]["status"] == "checked"
        for rank in (0, 1):
            assert _report(out, f"report.rank{rank}.json")["data"]["verdicts"] == {"3": "deterministic-nonfinite"}


UNDERFLOWED = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5)))
if "--no-hook" not in sys.argv:
    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-16)
g = torch.Generator().manual_seed(rank)
first = None
for step in range(12):
    x = torch.randn(32, 20, generator=g)
    y = x[:, :5].argmax(1)
    loss = 1e-9 * nn.functional.cross_entropy(model(x), y)  # an auxiliary task's weight, typed 1e-9
    opt.zero_grad()
    loss.backward()
    opt.step()
    first = first if first is not None else loss.item()
if rank == 0:
    print(f"loss {first:.4g} -> {loss.item():.4g}")
dist.destroy_process_group()
"""


ONE_HEAD_UNDER = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.Tanh())
        self.label = nn.Linear(32, 4)
        self.drift = nn.Linear(12, 1)  # a sensor drift, in metres, read straight off the channels

    def forward(self, x):
        return self.label(self.trunk(x)), self.drift(x) * 1e-5


model = nn.parallel.DistributedDataParallel(TwoHeads())
if "--no-hook" not in sys.argv:
    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
for step in range(12):
    x = torch.randn(64, 12, generator=g)
    logits, drift = model(x)
    loss = nn.functional.cross_entropy(logits, x[:, :4].argmax(1)) + ((drift - 2e-5 * x[:, :1]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.jobs  # two 2-rank torchrun jobs
def test_one_heads_gradients_a_compression_hook_rounds_to_zero_are_named_never_ok(tmp_path):
    """The drift head's loss term is ~1e-10 beside the label's: its gradients sit under fp16's smallest
    subnormal and fp16_compress_hook hands them over as zeros at every step, while the rest train and
    the loss falls. The parameters are named with the hook; without the hook, no such finding."""
    script = _write(tmp_path, "one_head.py", ONE_HEAD_UNDER)
    for arm in ([], ["--no-hook"]):
        out = tmp_path / ("no-hook" if arm else "hook")
        out.mkdir()
        run = _torchrun_watch(tmp_path, script, out, *arm)
        assert run.returncode in (0, 1), run.stderr[-3000:]
        merged = _report(out)
        zero = [f for f in merged["findings"] if f["name"] == "gradients-all-zero"]
        if arm:
            assert not zero, merged["findings"]
            continue
        assert merged["verdict"] == "error" and zero, merged["findings"]
        told = zero[0]
        assert told["evidence"]["parameters"] == ["module.drift.bias", "module.drift.weight"], told["evidence"]
        assert told["evidence"]["comm_hook"] == "fp16_compress_hook" and "no hook" in told["fix"]


@pytest.mark.jobs  # two 2-rank torchrun jobs
def test_gradients_a_compression_hook_rounds_to_zero_are_named_with_the_hook_never_ok(tmp_path):
    """fp16_compress_hook casts each bucket to fp16 before the all-reduce: local gradients under 2.98e-08
    become 0 and the run trains on zeros with a finite loss. The reference step cannot recompute reduced
    gradients, and the verdict was OK; every received gradient 0 at the sampled steps is an error naming
    the hook, measured on the step's local gradients replayed without the reduction (all made 0 in fp16,
    none in bf16), and the run without it (as printed: no hook) trains and is no such finding."""
    script = _write(tmp_path, "underflowed.py", UNDERFLOWED)
    for arm in ([], ["--no-hook"]):
        out = tmp_path / ("no-hook" if arm else "hook")
        out.mkdir()
        run = _torchrun_watch(tmp_path, script, out, *arm)
        assert run.returncode in (0, 1), run.stderr[-3000:]
        first, last = (float(v) for v in run.stdout.split("loss ")[-1].split(" -> "))
        merged = _report(out)
        zero = [f for f in merged["findings"] if f["name"] == "gradients-all-zero"]
        if arm:
            assert last < 0.9 * first, (first, last)  # it trains
            assert not zero, merged["findings"]
            continue
        assert last == pytest.approx(first, rel=0.05), (first, last)  # the symptom: nothing moves
        assert merged["verdict"] == "error" and zero, merged["findings"]
        assert merged["findings"][0]["name"] == "gradients-all-zero"
        told = zero[0]
        assert told["evidence"]["comm_hook"] == "fp16_compress_hook" and told["evidence"]["steps_looked"] == [1, 10]
        assert "no hook" in told["fix"] and told["evidence"]["flushed_share"] == 1.0, told["evidence"]
        # checked on the step's own local gradients, replayed without the reduction: bf16 keeps them
        trial = told["fix_trial"]
        assert trial["status"] == "checked" and (trial["before"], trial["after"]) == ("100%", "0%"), trial


def test_a_script_that_raises_exits_as_python_would_and_is_never_ok(tmp_path):
    script = _write(tmp_path, "bad.py", "import torch\nraise IndexError('index 9 is out of bounds')\n")
    watched = _watch(tmp_path, str(script))
    assert watched.returncode == 1
    assert "IndexError: index 9 is out of bounds" in watched.stderr
    report = _report(tmp_path)
    assert report["verdict"] == "error"
    assert [f["name"] for f in report["findings"]] == ["uncaught-exception"]


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ([], "no script given"),
        (["--", "python"], "no script given"),
        (["--", "missing.py"], "missing.py: no such script"),
        (["--", "python", "-c", "print(1)"], "-c: python's option -c is not supported here"),
        (["--", "python", "-m"], "-m needs a module name"),
        (["--", "python", "-I", "x.py"], "-I: python's option -I is not supported here (supported: -u -B -O"),
        (["--", "python", "--check-hash-based-pycs", "x.py"], "--check-hash-based-pycs: python's options other"),
        (["--", "python", "-W"], "-W needs an argument, as python's does"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, command, said):
    run = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "watch", *command],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(),
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0]


def test_the_python_api_watches_a_block_and_leaves_nothing_behind():
    from torch import nn

    import fpdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backward, step = torch.autograd.backward, torch.amp.GradScaler.step
    with fpdoctor.watch() as w:
        for i in range(4):
            x = torch.randn(8, 4)
            if i == 2:
                x[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.zeros(8, 1)).backward()
            opt.step()
            moved = not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert moved == (i != 2)  # the bad step was kept from the weights
    assert torch.autograd.backward is backward and torch.amp.GradScaler.step is step
    report = w.report
    assert report.data["steps"] == 4 and report.data["skipped_steps"] == 1
    assert report.data["verdicts"] == {3: "deterministic-nonfinite"}
    assert "fpdoctor watch" not in "".join(m.__class__.__module__ for m in model.modules())  # nothing added
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_bf16_weights_whose_updates_round_away_are_named_under_watch():
    import fpdoctor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)  # a typical fp32 learning rate
    g = torch.Generator().manual_seed(1)
    with fpdoctor.watch() as w:
        for _ in range(12):
            x, y = torch.randn(16, 32, generator=g).bfloat16(), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
    (found,) = w.report.by_name("update-rounded-away")
    assert found.evidence["dtype"] == "bfloat16" and found.evidence["occurrences"] == 2  # steps 1 and 11
    assert any(p["name"] == "0.weight" and p["rounded_share"] > 0.9 for p in found.evidence["parameters"])


BF16_TRAIN = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)).bfloat16()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)  # a typical fp32 learning rate
g = torch.Generator().manual_seed(1)
for step in range(12):
    x, y = torch.randn(16, 32, generator=g).bfloat16(), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()
print(torch.rand(1).item())  # the script's RNG goes on where it would without the watch
torch.save({**model.state_dict(), **{f"state.{k}": v for k, v in opt.state_dict()["state"][0].items()}}, sys.argv[1])
"""


def test_the_fix_for_bf16_updates_is_tried_under_watch_and_the_weights_stay_bitwise_the_same(tmp_path):
    script = _write(tmp_path, "train.py", BF16_TRAIN)
    plain = run_python(str(script), str(tmp_path / "plain.pt"))
    assert plain.returncode == 0, plain.stderr
    watched = _watch(tmp_path, "python", str(script), str(tmp_path / "watched.pt"))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (found,) = [f for f in _report(tmp_path)["findings"] if f["name"] == "update-rounded-away"]
    tried = found["evidence"]["what_if"]
    assert tried["tried"] and tried["steps"] == 8 and tried["moved_fp32_master"] > tried["moved_as_is"]
    # the loss to first order, from the gradients at the model's outputs: the watch knows no loss function
    assert 0 < tried["loss_fp32_master"] <= tried["loss_as_is"] < 10, tried
    assert "Tried: with fp32 master weights" in found["message"] and "(checked" in found["message"]
    assert "the loss to first order" in found["message"]
    assert not _report(tmp_path)["data"].get("not_checked")  # the copies' optimizer steps are not the script's


def test_sigterm_writes_the_report_of_the_steps_so_far_and_dies_of_it(tmp_path):
    script = _write(
        tmp_path,
        "slow.py",
        """
        import time, torch
        from torch import nn
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        print("stepped", flush=True)
        time.sleep(60)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fpdoctor", "watch", "-o", str(tmp_path / "report.json"), "--", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "stepped"
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err
    report = _report(tmp_path)
    assert report["data"]["steps"] == 2 and report["data"]["status"] == "incomplete"
    assert "terminated by SIGTERM" in report["data"]["not_checked"]["script"]


SELF_TERMINATED = """
import os, signal
print("stepped", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("went on", flush=True)
"""


@pytest.mark.parametrize("sigterm", ["default", "ignored"])
def test_a_script_that_is_terminated_meets_the_same_fate_as_without_the_watch(tmp_path, sigterm):
    """Killed by SIGTERM: the report first (never OK: the script was not checked to its end), then
    fpdoctor dies of SIGTERM as the script would have. SIGTERM ignored when it started (nohup, a
    launcher's choice): ignored by the script under the watch too."""
    script = _write(tmp_path, "job.py", SELF_TERMINATED)
    disposition = signal.SIG_DFL if sigterm == "default" else signal.SIG_IGN

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=_env(),
            preexec_fn=lambda: signal.signal(signal.SIGTERM, disposition),
        )  # fmt: skip

    plain = run(sys.executable, str(script))
    watched = run(sys.executable, "-m", "fpdoctor", "watch", "--", str(script))
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout)
    if sigterm == "ignored":
        assert plain.stdout == "stepped\nwent on\n" and watched.stderr.lstrip().startswith("OK ")
        return
    assert plain.returncode == -signal.SIGTERM and plain.stdout == "stepped\n"
    headline = watched.stderr.strip().splitlines()[0]
    assert headline.split()[:3] == ["INCOMPLETE", "fpdoctor", "watch"], watched.stderr
    assert "terminated by SIGTERM before the script ended" in watched.stderr


GAN_AND_LOSS = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
bce = nn.BCEWithLogitsLoss()
head = nn.Linear(8, 5)
oh = torch.optim.SGD(head.parameters(), 0.1)
scaler = torch.amp.GradScaler("cpu", enabled=False)  # the usual idiom when the dtype is not fp16
for step in range(1, 9):
    real = torch.randn(16, 8)
    if step == 3:
        real[0, 0] = float("inf")  # one bad batch, through the discriminator's step
    fake = G(torch.randn(16, 4))
    od.zero_grad()
    (bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))).backward()
    od.step()
    og.zero_grad()
    bce(D(fake), torch.ones(16, 1)).backward()
    og.step()
    y = torch.randint(0, 5, (16,))
    if step == 5:
        y[:] = -100  # every target ignored: cross_entropy is 0/0, after the model
    try:
        if step == 2:
            head(torch.randn(16, 7))  # a bad-shape batch the script catches
    except RuntimeError:
        pass
    oh.zero_grad()
    scaler.scale(nn.functional.cross_entropy(head(torch.randn(16, 8)), y)).backward()
    scaler.step(oh)
    scaler.update()
ok = all(bool(torch.isfinite(p).all()) for m in (G, D, head) for p in m.parameters())
print("finite", ok)
"""


def test_three_optimizers_a_disabled_scaler_a_caught_error_and_a_loss_made_nan_after_the_model(tmp_path):
    script = _write(tmp_path, "gan.py", GAN_AND_LOSS)
    watched = _watch(tmp_path, str(script))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.strip() == "finite True"  # every optimizer guarded: no NaN reached any weight
    assert "Warning" not in watched.stderr  # a forward that raised leaves no hook warning behind
    report = _report(tmp_path)
    assert "not_checked" not in report["data"]  # all three optimizers watched
    replayed = ("deterministic-nonfinite", "transient-fault-suspected")
    verdicts = [(f["name"], f["evidence"].get("step")) for f in report["findings"] if f["name"] in replayed]
    assert verdicts == [("deterministic-nonfinite", 3), ("deterministic-nonfinite", 5)]
    after = next(f for f in report["findings"] if f["name"] == replayed[0] and f["evidence"]["step"] == 5)
    assert "made after the model, in the loss computation" in after["message"]


def test_python_dash_m_runs_a_module_as_python_would(tmp_path):
    _write(tmp_path, "trainmod.py", TRAIN)
    watched = _watch(tmp_path, "python", "-u", "-m", "trainmod", str(tmp_path / "m.pt"))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == "trained\n"
    assert _report(tmp_path)["data"]["steps"] == 8


def test_a_gradient_penalty_loss_made_nan_is_said_to_be_made_after_the_model():
    import fpdoctor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with fpdoctor.watch() as w:
        for step in range(5):
            x = torch.randn(8, 4, requires_grad=True)
            out = model(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # a backward through the outputs first
            penalty = ((g.norm(dim=1) - 1) ** 2).mean() * (float("nan") if step == 3 else 1.0)
            opt.zero_grad()
            (out.mean() + penalty).backward()
            opt.step()
    (verdict,) = w.report.by_name("deterministic-nonfinite")
    assert verdict.evidence["step"] == 4 and "made after the model" in verdict.message


def _fused_run(watcher, bad_step=None, seen=None, kind="fused"):
    """An AdamW loop (`kind`: fused or foreach) with BatchNorm and two micro-batches per step;
    `bad_step` gets an Inf input."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
    g = torch.Generator().manual_seed(2)
    with contextlib.ExitStack() as stack:
        if watcher is not None:
            stack.enter_context(watcher)
        for step in range(1, 7):
            opt.zero_grad()
            for _ in range(2):
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
                if step == bad_step:
                    x[0, 0] = float("inf")
                (nn.functional.mse_loss(model(x), y) / 2).backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if seen is not None:
                seen.append(
                    {
                        "moved": not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
                        "pending": len(watcher._pending),
                        "flag_left": "found_inf" in vars(opt),
                        "adam_step": float(opt.state[model[0].weight]["step"]),
                        "undecided": watcher.report.data.get("undecided_steps"),
                    }
                )
    return model


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_device_side_skipping_keeps_a_healthy_run_bitwise_the_same(kind):
    from fpdoctor.integrations.script import ScriptWatch

    plain = _fused_run(None, kind=kind).state_dict()
    watcher = ScriptWatch(device_skip=True, notify=None)
    watched = _fused_run(watcher, kind=kind).state_dict()
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
    # the deferred path was the one taken: found_inf for the fused optimizer, the step undone for the other
    assert [(r.device_skip, r.fused) for r in watcher.runs.values()] == [(True, kind == "fused")]
    assert watcher.report.data["steps"] == 6 and watcher.report.findings == []


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_device_side_skipping_skips_on_the_device_and_decides_at_the_next_forward(kind):
    # the GPU path, forced on the CPU: the fused optimizer skips on the flag (the foreach one's step is
    # undone where the flag is set), the host looks a step later
    from fpdoctor.integrations.script import ScriptWatch

    seen: list[dict] = []
    watcher = ScriptWatch(device_skip=True, notify=None)
    model = _fused_run(watcher, bad_step=3, seen=seen, kind=kind)
    assert [s["moved"] for s in seen] == [True, True, False, True, True, True]  # step 3 kept from the weights
    assert seen[2]["pending"] == 1  # undecided when the step returned
    # the fused optimizer skipped it; the foreach one's step was undone on the device, its count included
    assert seen[2]["adam_step"] == 2.0 and seen[3]["adam_step"] == 3.0
    assert [s["undecided"] for s in seen] == [[1], [2], [3], [4], [5], [6]]  # each decided at the next forward
    assert not any(s["flag_left"] for s in seen)  # nothing of ours stays on the optimizer
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert all(bool(torch.isfinite(b).all()) for b in model.buffers())  # the bad forward's statistics undone
    report = watcher.report
    assert report.data["skipped_steps"] == 1 and report.data["verdicts"] == {3: "deterministic-nonfinite"}
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.evidence["step"] == 3


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_the_last_step_decided_on_the_device_is_decided_when_the_watch_ends(kind):
    from fpdoctor.integrations.script import ScriptWatch

    watcher = ScriptWatch(device_skip=True, notify=None)
    model = _fused_run(watcher, bad_step=6, kind=kind)
    assert watcher._pending == []
    assert watcher.report.data["verdicts"] == {6: "deterministic-nonfinite"}
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_step_undo_that_fails_is_a_finding_never_raised_into_the_step_and_the_watch_still_leaves(monkeypatch):
    from torch import nn
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    from fpdoctor.integrations import script

    def broken(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr(script.StepUndo, "undo", broken)
    backward, step = torch.autograd.backward, torch.amp.GradScaler.step
    pre, post = dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    watcher = script.ScriptWatch(device_skip=True, notify=None)
    with pytest.raises(ValueError, match="the user's own"), watcher:
        for i in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            if i == 2:  # this step raises after the watch's pre-hook: its undo is left for the watch's end

                def fail(*_):
                    raise ValueError("the user's own")

                opt.register_step_pre_hook(fail)
            opt.step()  # the first two steps' undo fails in the post-hook, never in the user's step
    assert torch.autograd.backward is backward and torch.amp.GradScaler.step is step
    assert dict(_global_optimizer_pre_hooks) == pre and dict(_global_optimizer_post_hooks) == post
    (error,) = [f for f in watcher.report.findings if "putting the optimizer's step back" in f.message]
    assert "RuntimeError: device lost" in error.message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the host must not wait for the device")
@pytest.mark.parametrize(
    ("kind", "scaled"),
    [("fused", False), ("fused", True), ("foreach", False)],
    ids=["fused-adamw", "fused-adamw-fp16-gradscaler", "foreach-adamw-device-skip"],
)
def test_watched_steps_on_a_gpu_do_not_synchronise(kind, scaled):
    from torch import nn

    import fpdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
    scaler = torch.amp.GradScaler("cuda", enabled=scaled)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")

    def step(x):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaled):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    # the fused optimizer skips by itself on a GPU by default; the foreach one's step is undone when asked
    with fpdoctor.watch(device_skip=True if kind == "foreach" else None) as w:
        for _ in range(3):  # warm-up: the first steps learn the model and which buffers change
            step(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                step(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        bad = x.clone()
        bad[0, 0] = float("nan")
        step(bad)
    assert [r.device_skip for r in w.runs.values()] == [True]
    report = w.report
    assert report.data["verdicts"] == {9: "deterministic-nonfinite"}
    assert report.data["skipped_steps"] == 1 and report.data["last_good_step"] == 8


def test_a_causal_attention_masks_minus_inf_does_not_lead_a_replayed_steps_findings():
    # nn.MultiheadAttention under a masked_fill(-inf) causal mask; the real fault: a sqrt of negatives
    from torch import nn

    import fpdoctor

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.broken = False

        def forward(self, x):
            n = x.shape[1]
            mask = torch.zeros(n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            h = self.emb(x)
            if self.broken:
                h = torch.sqrt(h)
            a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
            return self.head(a)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with fpdoctor.watch() as w:
        for step in range(1, 4):
            model.broken = step == 2
            opt.zero_grad()
            model(torch.randn(2, 5, 8)).mean().backward()
            opt.step()
    (verdict,) = w.report.by_name("deterministic-nonfinite")
    assert verdict.evidence["step"] == 2 and verdict.where["op"] == "aten.sqrt.default"
    assert not any("masked_fill" in str(f.where.get("op")) for f in w.report.findings)


HF_TRAINER = """
import os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch, transformers

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
model = transformers.GPT2LMHeadModel(config)
trainer_box = []

def poison(module, args, output):  # a NaN in the first MLP's activation on optimizer step 3
    if module.training and torch.is_grad_enabled() and trainer_box[0].state.global_step + 1 == 3:
        output = output.clone()
        output[0, 0, 0] = float("nan")
        return output

model.transformer.h[0].mlp.c_fc.register_forward_hook(poison)
args = transformers.TrainingArguments(
    output_dir="out", max_steps=5, per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
    save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0, learning_rate=1e-3,
)
callbacks = []
if sys.argv[1:] == ["own"]:
    from fpdoctor.integrations.hf import FpDoctorCallback
    callbacks.append(FpDoctorCallback())
trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
trainer_box.append(trainer)
print(sum(type(c).__name__ == "FpDoctorCallback" for c in trainer.callback_handler.callbacks), flush=True)
trainer.train()
"""


@pytest.mark.parametrize("own", [False, True], ids=["switched-on-by-watch", "the-scripts-own"])
def test_a_hugging_face_trainer_gets_the_callback_and_each_step_is_judged_once(tmp_path, own):
    pytest.importorskip("transformers", reason="the Hugging Face Trainer")
    pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate")
    script = _write(tmp_path, "hf_train.py", HF_TRAINER)
    watched = _watch(tmp_path, str(script), *(["own"] if own else []))
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert watched.stdout.splitlines()[0] == "1"  # one callback, whoever added it
    report = _report(tmp_path)
    assert report["data"]["steps"] == 0  # the watch's own judge left the Trainer's optimizer to the callback
    assert report["data"]["callbacks"] == [{"steps": 5, "skipped_steps": 1}]
    assert [f["evidence"]["step"] for f in report["findings"] if f["name"] == "nonfinite-loss"] == [3]
    assert [f["evidence"]["step"] for f in report["findings"] if f["name"] == "deterministic-nonfinite"] == [3]


def test_the_trainer_is_left_as_it_was_after_the_watch():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face Trainer")
    import fpdoctor

    init = transformers.Trainer.__init__
    with fpdoctor.watch():
        assert transformers.Trainer.__init__ is not init
    assert transformers.Trainer.__init__ is init


def test_pythons_own_options_are_in_force_as_python_would_set_them(tmp_path):
    script = _write(
        tmp_path,
        "opts.py",
        """
        import sys, warnings, torch
        from torch import nn
        warnings.warn("hidden by -W ignore")
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        print(sys.warnoptions[-1:], sys.flags.utf8_mode, sys.dont_write_bytecode, flush=True)
        """,
    )
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"  # as python3.12 train.py is typed
    # -O is the same restart as -W and -X (test_optimize_restarts_the_interpreter_with_it); run
    # end to end it would compile every module torch has, there being no optimized .pyc of them
    watched = _watch(tmp_path, python, "-W", "ignore", "-Xutf8", "-B", str(script))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.strip() == "['ignore'] 1 True"
    assert "hidden by" not in watched.stderr
    assert _report(tmp_path)["data"]["steps"] == 3


def test_optimize_restarts_the_interpreter_with_it(tmp_path, monkeypatch):
    from fpdoctor.cli import watch

    script = str(_write(tmp_path, "train.py", "pass\n"))
    command = ["python3", "-OO", "-Wignore", script, "--epochs", "2"]
    target, args, is_module, options = watch._script_of(command)
    assert (target, args, is_module, options) == (script, ["--epochs", "2"], False, ["-O", "-O", "-Wignore"])
    started: list[list[str]] = []
    monkeypatch.setattr(sys, "argv", ["fpdoctor", "watch", *command])
    monkeypatch.delenv("FPDOCTOR_WATCH_PYTHON_OPTIONS", raising=False)
    monkeypatch.setattr(watch.os, "execv", lambda exe, argv: started.append(argv))
    watch._start_again(options, command)
    assert started == [[sys.executable, "-O", "-O", "-Wignore", "-m", "fpdoctor", "watch", *command]]
    assert os.environ["FPDOCTOR_WATCH_PYTHON_OPTIONS"] == "1"  # the restarted one does not restart again
    started.clear()
    watch._start_again(options, command)
    assert started == []


def test_under_a_grad_scaler_the_device_path_decides_as_the_host_read_does():
    # the scaler gives the fused optimizer its own found_inf; the watch's flag joins it (either skips)
    from torch import nn

    from fpdoctor.integrations.script import ScriptWatch

    def train(device_skip):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu")
        g = torch.Generator().manual_seed(1)
        moved = []
        with ScriptWatch(device_skip=device_skip, notify=None) as w:
            for step in range(1, 7):
                x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x * (1e5 if step == 3 else 1.0))  # an Inf loss in fp16
                loss = nn.functional.mse_loss(out.float(), y) * (float("nan") if step == 5 else 1.0)
                before = [p.detach().clone() for p in model.parameters()]
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                moved.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
        return model, moved, scaler.get_scale(), w.report.data["verdicts"]

    host, deferred = train(False), train(True)
    assert deferred[1] == host[1] == [True, True, False, True, False, True]
    assert deferred[2] == host[2] and deferred[3] == host[3] == {
        3: "deterministic-nonfinite",
        5: "deterministic-nonfinite",
    }
    assert all(torch.equal(a, b) for a, b in zip(host[0].parameters(), deferred[0].parameters(), strict=True))


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_a_bad_first_step_skipped_on_the_device_leaves_no_optimizer_state_behind(kind):
    # the first step makes the optimizer's state: undone, it must not leave NaN moments for the next
    from fpdoctor.integrations.script import ScriptWatch

    watcher = ScriptWatch(device_skip=True, notify=None)
    model = _fused_run(watcher, bad_step=1, kind=kind)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert watcher.report.data["verdicts"] == {1: "deterministic-nonfinite"}


def test_device_skip_on_the_command_line_keeps_healthy_runs_bitwise_and_skips_a_bad_step(tmp_path, plain_train):
    # the foreach AdamW of TRAIN, its steps undone on the device where the flag says so
    script = _write(tmp_path, "train.py", TRAIN)
    inject = _write(tmp_path, "inject.py", INJECT)

    def watched(*command: str) -> subprocess.CompletedProcess[str]:
        report = str(tmp_path / "report.json")
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "fpdoctor",
                "watch",
                "--device-skip",
                "--reference-every",
                "0",
                "-o",
                report,
                "--",
                *command,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
            env=_env(),
        )

    healthy = watched(str(script), str(tmp_path / "watched.pt"))
    assert healthy.returncode == 0, healthy.stderr
    a, b = plain_train[1], torch.load(tmp_path / "watched.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bad = watched(str(inject), str(script), str(tmp_path / "bad.pt"))
    assert bad.returncode == 0, bad.stderr
    assert "fpdoctor watch: step 4: non-finite, skipped; transient-fault-suspected" in bad.stderr
    report = _report(tmp_path)
    assert report["data"]["skipped_steps"] == 1 and report["data"]["verdicts"] == {"4": "transient-fault-suspected"}
    assert all(bool(torch.isfinite(v).all()) for v in torch.load(tmp_path / "bad.pt").values())


def test_a_learning_rate_trial_from_weights_a_step_decided_on_the_device_has_moved_says_so():
    """Decided a step later, a finite step's update is made when the judge sees its climb: the trial
    starts from the state after that update (the climb's, one update on), and says so, never as if
    they were the weights the step started from."""
    from torch import nn

    from fpdoctor.integrations.script import ScriptWatch

    torch.manual_seed(0)
    # ReLU: its gradients overflow with the loss (a Tanh's saturate: an Inf loss with finite
    # gradients is applied, as the script applies it, and no step is skipped)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    g = torch.Generator().manual_seed(1)
    with ScriptWatch(device_skip=True, notify=None) as watcher:
        for i in range(36):
            if i == 12:  # a learning rate far too high from here on
                for group in opt.param_groups:
                    group["lr"] = 50.0
            opt.zero_grad()
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    assert watcher.report.by_name("loss-spike")
    (stalled,) = watcher.report.by_name("training-stalled")
    tried = stalled.evidence["lr_tried"]
    assert tried.get("after_update") is True and tried["fix_lr"] is not None, tried
    assert f"after step {tried['from_step']}'s update" in stalled.message, stalled.message


CLIP_SCALED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
centers = torch.randn(10, 32) * 1.5
y = torch.randint(0, 10, (1024,))
x = centers[y] + torch.randn(1024, 32)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    idx = torch.randint(0, 1024, (128,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    {unscale}torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_clip_of_gradients_still_scaled_is_found_at_the_optimizer_stage_and_unscaling_first_is_checked(
    tmp_path, unscale_first
):
    """fp16 autocast + GradScaler with clip_grad_norm_ before scaler.unscale_: the clip reads gradients
    65536x their size, and the optimizer takes them ~1e-5 of the backward's: the reference step's
    optimizer stage departs, its fix (unscale first) checked by that clip at loss scale 1. In the right
    order (unscale_, then clip) the same script is OK."""
    script = _write(tmp_path, "train.py", CLIP_SCALED.format(unscale="scaler.unscale_(opt); " if unscale_first else ""))
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    found = [f for f in report["findings"] if f["name"] == "gradients-depart-from-reference"]
    if unscale_first:
        assert report["verdict"] == "ok", [f["title"] for f in report["findings"]]
        return
    (first,) = found
    assert first["evidence"]["stage"] == "optimizer" and first["evidence"]["departed_count"] == 4, first["evidence"]
    assert all(d["norm_ratio"] < 1e-3 for d in first["evidence"]["departed"])
    assert first["fix"].startswith(
        "Unscale before you process the gradients: insert scaler.unscale_(opt) before line 18"
    )
    trial = first["fix_trial"]
    assert trial["status"] == "checked" and trial["before"] == 4 and trial["after"] == 0, trial


# the same classifier, 24 steps, clipping only after a warm-up (the clip at line 19, in an `if` at line 18)
CLIP_AFTER_WARMUP = CLIP_SCALED.replace("range(6)", "range(24)").replace(
    "    {unscale}torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
    "    if step >= 4:  # clipping after a warm-up\n        {clip}\n",
)


@pytest.mark.parametrize(
    "clip",
    [
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        "torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)",
    ],
)
def test_a_clip_of_scaled_gradients_that_starts_after_a_warm_up_is_an_error_whose_insertion_works_as_printed(
    tmp_path, clip
):
    """The clip starts at step 5, after the first reference step: the reference step at step 10 finds
    the optimizer's gradients ~1e-4 of the reference's (a clip of their norm, or of each value, read at
    scale 65536), an error naming the clip's line; the call inserted where the fix says makes it OK."""
    script = _write(tmp_path, "train.py", CLIP_AFTER_WARMUP.format(clip=clip))
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    first = report["findings"][0]
    assert first["name"] == "gradients-depart-from-reference" and first["severity"] == "error", first["title"]
    assert first["evidence"]["step"] == 10 and first["evidence"]["stage"] == "optimizer"
    assert f"line 19 (`{clip}`)" in first["message"], first["message"]
    # before the `if` that holds the clip, in the step's own block: a call there runs once a step
    said = "Unscale before you process the gradients: insert scaler.unscale_(opt) before line 18 of train.py (`if"
    assert first["fix"].startswith(said), first["fix"]
    assert first["fix_trial"]["status"] == "checked" and first["fix_trial"]["after"] == 0, first["fix_trial"]
    lines = script.read_text().splitlines()  # the call inserted as printed: before line 18, its indentation
    indent = lines[17][: len(lines[17]) - len(lines[17].lstrip())]
    script.write_text("\n".join([*lines[:17], f"{indent}scaler.unscale_(opt)", *lines[17:]]) + "\n")
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0 and _report(tmp_path)["verdict"] == "ok", _report(tmp_path)["findings"]


NORM_IN_FP16 = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x @ torch.randn(16, 1)) * 4
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).half()
opt = torch.optim.SGD(model.parameters(), lr={lr}, momentum=0.9)
for step in range({steps}):
    opt.zero_grad()
    F.mse_loss(model(x.half()).float(), y, reduction="sum").backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]) ** 2, 1).sqrt()
    for g in grads:
        g.mul_(torch.clamp(10.0 / norm, max=1.0))
    opt.step()
"""


def test_a_clip_by_a_norm_that_overflows_fp16_zeroes_every_gradient_and_is_found_at_the_optimizer_stage(tmp_path):
    """Pure fp16 weights clipped by hand by a norm of the squared gradients, summed in fp16: it is Inf,
    10 / inf is 0, and every gradient the optimizer takes is 0 while the backward's are not. watch
    said OK; the optimizer stage departs, every parameter zeroed, and the fix names the norm in fp32."""
    script = _write(tmp_path, "train.py", NORM_IN_FP16.format(lr=1e-3, steps=5))
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    (first,) = [f for f in report["findings"] if f["name"] == "gradients-depart-from-reference"]
    assert first["evidence"]["stage"] == "optimizer", first["evidence"]
    assert first["evidence"]["departed_count"] == first["evidence"]["compared"] == 4
    assert all(d["norm_ratio"] == 0 and d["zeros"] == 1 for d in first["evidence"]["departed"])
    assert "multiplied them all by 0" in first["message"] and "in fp32" in first["fix"]
    assert first["severity"] == "error" and report["verdict"] == "error"  # the weights never move: not a warning
    assert first["fix_trial"]["status"] == "not-tried"


def test_a_flat_window_whose_experiment_went_non_finite_is_said_undecided(tmp_path):
    """The same run for 201 steps, a learning rate the clip was there for: the loss is flat, and the
    progress experiment (the optimizer stepped on the backward's gradients, unclipped) goes non-finite.
    That decides nothing, and the report says so instead of counting the window as judged."""
    script = _write(tmp_path, "train.py", NORM_IN_FP16.format(lr=0.5, steps=201))
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    judged = dict(report["data"]["summary"])["judged"]
    assert "1 flat, 1 put to an fp32 reference, 1 of them undecided: the what-if's steps went non-finite" in judged, (
        judged
    )


PRESSURE = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 6)
y = 1013.25 + 2.0 * torch.tanh(x @ torch.randn(6, 1))
model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 1))
with torch.no_grad():
    model[-1].bias.fill_({start})
model = model.half()
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
for step in range(40):
    idx = torch.randint(0, 2048, (128,))
    out = model(x[idx].half()).float()
    loss = F.mse_loss(out + {offset}, y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("anomaly", [False, True])
def test_a_regression_output_too_coarse_for_its_format_is_named_where_the_reference_step_cannot_see(tmp_path, anomaly):
    """Sea-level pressure near 1013 hPa that varies by 2, predicted by a model cast to fp16 (spacing
    0.5 there): rounding the output alone costs a large share of what it varies by. watch said OK
    (its reference step replays the backward from the output's gradient). Predicting the anomaly
    (the constant added back in fp32) is healthy and stays OK."""
    start, offset = ("0.0", "1013.25") if anomaly else ("1013.25", "0.0")
    script = _write(tmp_path, "train.py", PRESSURE.format(start=start, offset=offset))
    watched = _watch(tmp_path, "python", str(script))
    assert watched.returncode == 0, watched.stderr
    report = _report(tmp_path)
    found = [f for f in report["findings"] if f["name"] == "output-too-coarse-in-training"]
    if anomaly:
        assert not found, [f["title"] for f in report["findings"]]
        return
    (first,) = found
    evidence = first["evidence"]
    assert evidence["dtype"] == "float16" and 1000 < evidence["magnitude"] < 1030
    assert evidence["share_of_spread"] >= 0.05 and "predict the offset from a constant" in first["fix"]


def test_a_second_optimizers_counts_are_in_the_summary_beside_the_firsts():
    """A teacher trained first, then a student whose steps go non-finite (trial79): the summary's
    counts were the teacher's alone ("non-finite steps 0" beside the student's NaN findings)."""
    from torch import nn

    from fpdoctor.integrations.script import ScriptWatch

    torch.manual_seed(0)
    teacher, student = nn.Linear(8, 4), nn.Linear(8, 4)
    opt_t, opt_s = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (teacher, student))
    with ScriptWatch(notify=None, reference_every=0) as watcher:
        for _ in range(6):
            opt_t.zero_grad()
            teacher(torch.randn(4, 8)).pow(2).mean().backward()
            opt_t.step()
        for _ in range(3):
            opt_s.zero_grad()
            out = student(torch.randn(4, 8))
            (out / (out - out)).mean().backward()  # NaN on every step
            opt_s.step()
    summary = dict(watcher.report.data["summary"])
    assert summary["non-finite steps (optimizer 1)"] == "0" and summary["steps (optimizer 1)"] == "6"
    assert summary["optimizer 2"].startswith("3 steps, 3 non-finite"), summary["optimizer 2"]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach, undone on the device", "fused, found_inf"])
def test_a_step_decided_on_the_device_skips_a_nan_loss_only_where_its_gradients_are_bad(fused: bool) -> None:
    """--device-skip: the flag the optimizer is given (or the undo reads) is the gradients', not the
    loss's: a NaN loss with finite gradients steps as the script steps."""

    from fpdoctor.integrations.script import ScriptWatch

    def run(watched: bool) -> tuple[dict[str, torch.Tensor], ScriptWatch | None]:
        teacher, student = distillation.teacher_and_student()
        kind = {"fused": True} if fused else {"foreach": True}
        opt = torch.optim.AdamW(student.parameters(), lr=1e-2, **kind)
        g = torch.Generator().manual_seed(1)
        watch = ScriptWatch(device_skip=True, notify=None) if watched else None
        with watch if watch is not None else contextlib.nullcontext():
            for _ in range(8):
                x = torch.randn(16, 8, generator=g)
                loss = distillation.loss(teacher, student, x)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return {k: v.clone() for k, v in student.state_dict().items()}, watch

    plain, _ = run(False)
    watched, watch = run(True)
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
    assert watch is not None and watch.report.data["skipped_steps"] == 0
    assert watch.report.by_name("nonfinite-loss")


@pytest.mark.parametrize("guard", ["every loss skipped", "eval forwards", "trains", "autograd.grad", "no optimizer"])
def test_a_loop_whose_guard_skips_every_loss_is_never_ok_and_keeps_a_bounded_number_of_forwards(guard):
    """`if not torch.isfinite(loss): continue` on a loss that overflows fp16 every time: 300 training
    forwards, no backward, no step. The watch judged nothing; its report says so (TRN020) instead of OK,
    and keeps at most CALLS_KEPT of the forwards no step took. Forwards in eval mode (a validation loop
    with gradients on), a loop that trains, one that takes its gradients by torch.autograd.grad and
    steps by hand, and forwards with no optimizer at all (MC-dropout inference) are not it."""
    from torch import nn

    import fpdoctor
    from fpdoctor.integrations import script

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if guard not in ("autograd.grad", "no optimizer") else None
    model.train(guard != "eval forwards")
    with fpdoctor.watch() as w:
        for _ in range(300 if guard not in ("trains", "autograd.grad") else 30):
            x, y = torch.randn(32, 4), 1000 + 100 * torch.randn(32, 1)
            loss = ((model(x).half() - y.half()) ** 2).mean()  # (1000)^2 is past fp16's 65504
            if guard == "no optimizer":
                continue
            if guard == "autograd.grad":
                grads = torch.autograd.grad(loss.float() / 1e6, list(model.parameters()))
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads, strict=True):
                        p.sub_(1e-3 * g)
                continue
            if guard == "trains":
                loss = loss.float() / 1e6
            elif not torch.isfinite(loss):
                continue
            assert opt is not None
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert len(w._calls) <= script.CALLS_KEPT
    names = [f.name for f in w.report.findings]
    if guard == "every loss skipped":
        assert names == ["training-never-stepped"] and w.report.findings[0].evidence["training_forwards"] == 300
    else:
        assert "training-never-stepped" not in names, names


def test_a_grad_scaler_whose_scale_fp32_cannot_invert_never_steps_nan_into_the_weights():
    """Every step skipped halves the scale; ~165 in a row take it below 1/fp32's max, where 1/scale is
    Inf: unscale_ turns the (finite) scaled gradients into NaN and its own check, which reads them scaled,
    passes them, so the scaler steps the optimizer on NaN. The watch keeps that from the weights and says
    why (amp-scale-collapse), with no replay that would blame the machine."""
    from torch import nn

    import fpdoctor

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-149)  # where ~165 skips in a row leave it
    with fpdoctor.watch() as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert torch.isfinite(model.weight).all() and torch.isfinite(model.bias).all()
    names = [f.name for f in w.report.findings]
    assert names[0] == "amp-scale-collapse" and "1/scale is Inf" in w.report.findings[0].message, names
    # no gradient overflowed in this run: the title says the scale's state, not an overflow
    assert "fp32 can invert" in w.report.findings[0].title and "overflow" not in w.report.findings[0].title
    assert "transient-fault-suspected" not in names and "deterministic-nonfinite" not in names, names


# a loss past fp32's range made after the model (a sum of squares of outputs in the thousands, scaled up):
# the outputs are finite, the loss +Inf every time
INF_LOSS = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(1, 5):
    out = model(torch.randn(16, 8, generator=g))
    loss = (out * 1e20).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_replays_evidence_says_the_kind_of_value_the_step_made_not_its_stand_in(tmp_path):
    # watch sees no loss function: the replay judges the forward's outputs (finite) and a stand-in for the
    # loss; its evidence is of the step's loss, +Inf, never the stand-in's NaN
    script = _write(tmp_path, "inf_loss.py", INF_LOSS)
    watched = _watch(tmp_path, str(script))
    assert watched.returncode in (0, 1), watched.stderr
    report = _report(tmp_path)
    verdict = next(f for f in report["findings"] if f["name"] == "deterministic-nonfinite")
    assert verdict["evidence"].get("kind") == "+inf", verdict["evidence"]
