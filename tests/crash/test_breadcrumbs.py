"""Breadcrumbs: a process that dies of a signal inside an op leaves that op, in flight, to its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fpdoctor.crash import breadcrumbs

TIMEOUT_S = 120

# An addmm kernel that dies of SIGFPE for one shape, as cuBLASLt does on an H20 (fault injection:
# the CPU kernel is replaced; every other shape gets the real one through addmm.out).
_FAULTY_ADDMM = """
import signal
import warnings

import torch

CRASHING = ((8, 32), (32, 64))


def addmm(bias, mat1, mat2, *, beta=1, alpha=1):
    if (tuple(mat1.shape), tuple(mat2.shape)) == CRASHING:
        signal.raise_signal(signal.SIGFPE)
    out = mat1.new_empty((mat1.shape[0], mat2.shape[1]))
    return torch.ops.aten.addmm.out(bias, mat1, mat2, beta=beta, alpha=alpha, out=out)


LIB = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
    LIB.impl("addmm", addmm, "CPU")
"""

_CRASHING_TRAINER = """
import sys
import threading

from fpdoctor.crash import breadcrumbs

breadcrumbs.arm(sys.argv[1])
assert "torch" not in sys.modules  # arming waits for the program's own import

import torch
from torch import nn

{faulty}


class Block(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(Block(16, 32), Block(32, 64))

    def forward(self, x):
        return self.encoder(x)


torch.manual_seed(0)
model = Net().to(torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
optimizer.step()
try:
    torch.mm(torch.ones(2, 3), torch.ones(2, 3))
except RuntimeError:
    pass
worker = threading.Thread(target=lambda: torch.ones(3).relu())
worker.start()
worker.join()
print(threading.get_ident(), worker.ident, flush=True)
with torch.no_grad():
    model(torch.randn(8, 16, dtype=torch.bfloat16))
print("survived", flush=True)
"""


def _run(tmp_path: Path, body: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(script), str(run_dir), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    tmp_path = tmp_path_factory.mktemp("crash")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_TRAINER.format(faulty=_FAULTY_ADDMM), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=TIMEOUT_S)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, tmp_path, breadcrumbs.read(str(tmp_path), proc.pid)


def test_the_op_a_signal_killed_reads_as_in_flight_with_module_shapes_and_dtypes(crashed):
    proc, _, ops = crashed
    assert proc.returncode == -signal.SIGFPE, proc.stderr
    assert "survived" not in proc.stdout
    main_thread = int(proc.stdout.split()[0])
    in_flight = [op for op in ops if not op["done"]]
    assert len(in_flight) == 1, in_flight
    op = in_flight[0]
    assert op["op"] == "aten::addmm"
    assert op["module"] == "encoder.1.fc"
    assert op["shapes"] == [[64], [8, 32], [32, 64]]
    assert op["dtypes"] == ["bfloat16"] * 3
    assert op["device"] == "cpu"
    assert op["phase"] == "forward"
    assert op["thread"] == main_thread
    assert op is ops[-1] and op["seq"] == max(o["seq"] for o in ops)


def test_the_ring_covers_backward_optimizer_other_threads_and_raising_ops(crashed):
    proc, _, ops = crashed
    main_thread, worker_thread = (int(x) for x in proc.stdout.split()[:2])
    seqs = [op["seq"] for op in ops]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    backward = [op for op in ops if op["phase"] == "backward"]
    # A backward op is named after the module whose forward op made its autograd node.
    assert any(op["op"] == "aten::mm" and op["module"] == "encoder.0.fc" for op in backward), backward
    assert any(op["op"] == "aten::threshold_backward" and op["module"] == "encoder.1" for op in backward)
    assert any(op["phase"] == "optimizer" for op in ops)
    raised = [op for op in ops if op["raised"]]
    assert [(op["op"], op["shapes"], op["done"]) for op in raised] == [("aten::mm", [[2, 3], [2, 3]], True)]
    worker = [op for op in ops if op["thread"] == worker_thread]
    assert [(op["op"], op["shapes"]) for op in worker][-1] == ("aten::relu", [[3]])
    assert all(op["thread"] in (main_thread, worker_thread) for op in ops)


def test_the_last_finished_ops_lead_up_to_the_crash(crashed):
    _, _, ops = crashed
    names = [(op["op"], op["module"], op["done"]) for op in ops[-4:]]
    assert names == [
        ("aten::addmm", "encoder.0.fc", True),
        ("aten::relu", "encoder.0", True),
        ("aten::t", "encoder.1.fc", True),
        ("aten::addmm", "encoder.1.fc", False),
    ]


def test_a_torn_or_cut_ring_loses_only_what_was_torn(crashed):
    _, run_dir, _ = crashed
    path = next(p for p in run_dir.iterdir() if p.name.startswith("crumbs.") and p.name[7:].isdigit())
    data = bytearray(path.read_bytes())
    ops = breadcrumbs.parse(bytes(data))
    last = ops[-1]
    offset = breadcrumbs.HEADER_SIZE + (last["seq"] % breadcrumbs.SLOTS) * breadcrumbs.SLOT_SIZE
    # Death in the middle of the slot's write: its trailing sequence number is still the old one.
    data[offset + breadcrumbs.SLOT_SIZE - 8 : offset + breadcrumbs.SLOT_SIZE] = (last["seq"] - 4096).to_bytes(
        8, "little", signed=True
    )
    torn = breadcrumbs.parse(bytes(data))
    assert [op["seq"] for op in torn] == [op["seq"] for op in ops[:-1]]
    # A file cut short keeps the slots before the cut.
    cut = breadcrumbs.parse(bytes(data[:offset]))
    assert cut and all(op["seq"] < last["seq"] for op in cut)
    assert {op["op"] for op in cut} <= {op["op"] for op in ops} | {"?"}
    # Not a ring at all.
    assert breadcrumbs.parse(b"") == []
    assert breadcrumbs.parse(b"\0" * 4096) == []
    assert breadcrumbs.parse(b"FPDCRMB9" + bytes(data[8:])) == []
    assert breadcrumbs.read(str(run_dir), 1) == []


def test_a_process_that_never_imports_torch_gets_no_ring_and_no_torch(tmp_path):
    proc = _run(
        tmp_path,
        """
        import json, os, sys, time
        from fpdoctor.crash import breadcrumbs

        breadcrumbs.arm(sys.argv[1])
        import csv, decimal, email.parser  # imports go on as usual
        print(json.dumps({"torch": "torch" in sys.modules, "cublas": os.environ.get("CUBLAS_LOGDEST_DBG"),
                          "pid": os.getpid()}))
        """,
        env={"CUBLAS_LOGDEST_DBG": str(tmp_path / "run" / "cublas.%i.log")},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["torch"] is False
    assert list((tmp_path / "run").iterdir()) == []
    # The cuBLAS log has no %i of its own: each process writes its pid into the name.
    assert result["cublas"] == str(tmp_path / "run" / f"cublas.{result['pid']}.log")


def test_looking_torch_up_without_importing_it_leaves_the_hook_waiting(tmp_path):
    proc = _run(
        tmp_path,
        """
        import importlib.util, os, sys
        from fpdoctor.crash import breadcrumbs

        breadcrumbs.arm(sys.argv[1])
        assert importlib.util.find_spec("torch") is not None  # what transformers does to test for torch
        import torch

        assert torch.__spec__.loader is torch.__loader__  # torch keeps its own loader
        assert type(torch.__loader__).__name__ == "SourceFileLoader"
        torch.ones(2, 5).sum()
        print(os.getpid())
        """,
    )
    assert proc.returncode == 0, proc.stderr
    ops = breadcrumbs.read(str(tmp_path / "run"), int(proc.stdout))
    assert ("aten::sum", [[2, 5]]) in [(op["op"], op["shapes"]) for op in ops]
    assert all(op["done"] for op in ops)


def test_a_forked_child_writes_its_own_ring(tmp_path):
    proc = _run(
        tmp_path,
        """
        import os, sys
        from fpdoctor.crash import breadcrumbs

        breadcrumbs.arm(sys.argv[1])
        import torch

        torch.ones(7).add(1)
        child = os.fork()
        if child == 0:
            torch.ones(5).add(1)
            os._exit(0)
        os.waitpid(child, 0)
        torch.ones(9).add(1)
        print(os.getpid(), child)
        """,
    )
    assert proc.returncode == 0, proc.stderr
    parent, child = (int(x) for x in proc.stdout.split())
    parent_adds = [
        op["shapes"] for op in breadcrumbs.read(str(tmp_path / "run"), parent) if op["op"] == "aten::add.Tensor"
    ]
    child_adds = [
        op["shapes"] for op in breadcrumbs.read(str(tmp_path / "run"), child) if op["op"] == "aten::add.Tensor"
    ]
    assert parent_adds == [[[7]], [[9]]]
    assert child_adds == [[[5]]]  # names from before the fork still resolve in the child's file


def test_recording_never_changes_results(tmp_path):
    torch = pytest.importorskip("torch")
    from torch import nn

    def step() -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 8)
        out = model(x)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        return [out.detach(), *grads, *[p.detach() for p in model.parameters()]]

    plain = step()
    with breadcrumbs.recording(str(tmp_path)):
        recorded = step()
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded, strict=True))
    ops = breadcrumbs.read(str(tmp_path), os.getpid())
    assert {op["phase"] for op in ops} == {"forward", "backward", "optimizer"}
    assert {"0", "1", "2", "3"} <= {op["module"] for op in ops}


def test_a_failing_recorder_never_reaches_the_user(tmp_path):
    torch = pytest.importorskip("torch")
    from torch import nn

    class Unhashable(nn.Linear):  # module hooks key modules by identity; this one refuses
        __hash__ = None  # type: ignore[assignment]

    model = nn.Sequential(Unhashable(4, 4), nn.ReLU())
    x = torch.ones(2, 4)
    expected = model(x)
    with breadcrumbs.recording(str(tmp_path)):
        recorder, _ = breadcrumbs._Armed.scoped[str(tmp_path)]
        recorder.ring.map.close()  # every slot write now raises
        try:
            out = model(x)
            out.sum().backward()
        finally:
            recorder.ring = breadcrumbs._Ring(str(tmp_path))  # a usable ring for later tests
            breadcrumbs._Armed.scoped.pop(str(tmp_path))
    assert torch.equal(out, expected)


def test_compiled_code_stays_compiled_under_breadcrumbs(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        pytest.skip("this torch runs compiled code eagerly under any dispatch mode")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        return torch.sin(x) @ x + 1

    torch._dynamo.reset()
    x = torch.randn(4, 4)
    try:
        with breadcrumbs.recording(str(tmp_path)):
            out = torch.compile(f, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1  # not skipped for the mode: dynamo traced it
    assert torch.equal(out, f(x))


def test_library_log_env_names_per_process_files(tmp_path):
    env = breadcrumbs.library_log_env(str(tmp_path))
    assert env["CUBLASLT_LOG_LEVEL"] == "5"
    assert env["CUBLASLT_LOG_FILE"] == str(tmp_path / "cublaslt.%i.log")
    assert env["CUBLAS_LOGINFO_DBG"] == "1"
    assert env["CUBLAS_LOGDEST_DBG"] == str(tmp_path / "cublas.%i.log")


def test_library_log_tail(tmp_path):
    # Lines in the shape of cuBLASLt's API trace (synthetic; the files are the libraries' own).
    lt = [
        f"[2026-11-23 10:00:0{i}][cublasLt][4242][Api][cublasLtMatmulAlgoGetHeuristic] "
        f"Adesc=[type=R_16BF rows=1024 cols={i} ld=1024] computeDesc=[computeType=COMPUTE_32F]"
        for i in range(30)
    ]
    (tmp_path / "cublaslt.4242.log").write_text("\n".join(lt) + "\n")
    (tmp_path / "cublas.4242.log").write_text("I! cuBLAS (v12.1) function cublasGemmEx() called:\n\n")
    tail = breadcrumbs.library_log_tail(str(tmp_path), 4242, lines=3)
    assert tail == ["I! cuBLAS (v12.1) function cublasGemmEx() called:", *lt[-3:]]
    assert breadcrumbs.library_log_tail(str(tmp_path), 4243) == []
    assert breadcrumbs.library_log_tail(str(tmp_path), 4242, lines=0) == []
    big = tmp_path / "cublaslt.7.log"
    big.write_bytes(b"x" * 200_000 + b"\nlast line\n")
    assert breadcrumbs.library_log_tail(str(tmp_path), 7) == ["last line"]
