"""The sitecustomize every instrumented Python process runs: records, dumps, hooks, chaining, forks."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from fpdoctor.crash import SITE_DIR, child_environment, run_command


def script(tmp_path: Path, body: str, name: str = "prog.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def quiet_run(argv: list[str], **kwargs):
    out, err = io.BytesIO(), io.BytesIO()
    result = run_command(argv, stdout=out, stderr=err, environment=False, **kwargs)
    return result, out.getvalue(), err.getvalue()


def names(result) -> list[str]:
    return [f.name for f in result.report.findings]


def test_records_of_a_clean_process(tmp_path):
    run_dir = tmp_path / "run"
    result, out, err = quiet_run([sys.executable, "-c", "print('hi')"], run_dir=str(run_dir))
    assert (result.exit_code, out, err, names(result)) == (0, b"hi\n", b"", [])
    (record,) = [json.loads(p.read_text()) for p in run_dir.glob("proc.*.json")]
    assert record["argv"][-2:] == ["-c", "print('hi')"] and record["faulthandler"] == "file"
    assert record["ppid"] == os.getpid() and record["term_dump"] is True
    pid = record["pid"]
    assert (run_dir / f"exit.{pid}.json").exists() and (run_dir / f"fault.{pid}").stat().st_size == 0
    assert not list(run_dir.glob("*.tmp"))


def test_chains_to_the_sitecustomize_it_shadows(tmp_path):
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITE_RAN'] = str(int(os.environ.get('USER_SITE_RAN', '0')) + 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(user_site)}
    code = "import os, sitecustomize; print(os.environ['USER_SITE_RAN'], sitecustomize.__file__)"
    _, out, _ = quiet_run([sys.executable, "-c", code], env=env, run_dir=str(tmp_path / "run"))
    assert out.decode().split() == ["1", str(user_site / "sitecustomize.py")]
    assert list((tmp_path / "run").glob("proc.*.json"))  # and fpdoctor's part ran too


def test_a_broken_user_sitecustomize_is_reported_as_python_reports_it(tmp_path):
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("raise RuntimeError('boom')\n")
    env = {**os.environ, "PYTHONPATH": str(user_site)}
    argv = [sys.executable, "-c", "print('still runs')"]
    plain = subprocess.run(argv, env=env, capture_output=True, check=False)
    _, out, err = quiet_run(argv, env=env)
    assert (out, err) == (plain.stdout, plain.stderr) == (b"still runs\n", plain.stderr)
    assert b"Error in sitecustomize" in err and b"RuntimeError: boom" in err


def test_without_a_run_dir_it_does_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": SITE_DIR, "FPDOCTOR_RUN_DIR": str(tmp_path / "absent")}
    done = subprocess.run([sys.executable, "-c", "import faulthandler; print(faulthandler.is_enabled())"], env=env,
                          capture_output=True, check=False)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, b"False\n", b"")


def test_an_unwritable_run_dir_never_breaks_the_program(tmp_path):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    run_dir.chmod(0o500)
    try:
        env = child_environment(dict(os.environ), str(run_dir), breadcrumbs=False)
        done = subprocess.run([sys.executable, "-c", "print('ok')"], env=env, capture_output=True, check=False)
    finally:
        run_dir.chmod(0o700)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"ok\n", b"")


def test_a_program_that_handles_sigterm_keeps_its_handler(tmp_path):
    prog = script(
        tmp_path,
        """
        import os, signal, sys
        signal.signal(signal.SIGTERM, lambda *a: (print("handled", flush=True), sys.exit(0)))
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
        """,
    )
    result, out, _ = quiet_run([sys.executable, prog])
    assert (result.exit_code, out, names(result)) == (0, b"handled\n", [])


def test_sigterm_with_the_default_action_dumps_the_stack_and_still_kills(tmp_path):
    prog = script(
        tmp_path,
        """
        import os, signal
        def checkpoint():
            os.kill(os.getpid(), signal.SIGTERM)
        checkpoint()
        """,
    )
    result, _, err = quiet_run([sys.executable, prog])
    assert result.exit_code == 128 + signal.SIGTERM and err == b""
    (finding,) = result.report.findings
    assert finding.name == "fatal-signal" and finding.evidence["signal"] == "SIGTERM"
    assert finding.evidence["function"] == "checkpoint"


def test_a_forked_child_gets_its_own_record_and_dump(tmp_path):
    prog = script(
        tmp_path,
        """
        import os
        def worker():
            os.abort()
        pid = os.fork()
        if pid == 0:
            worker()
        _, status = os.waitpid(pid, 0)
        print("child", os.WTERMSIG(status), flush=True)
        """,
    )
    result, out, _ = quiet_run([sys.executable, prog])
    assert result.exit_code == 0 and out == f"child {int(signal.SIGABRT)}\n".encode()
    (finding,) = result.report.findings
    # the command handled its child's death and exited 0: said, but not as an error
    assert finding.name == "fatal-signal" and finding.severity.value == "warning"
    assert finding.evidence["signal"] == "SIGABRT" and finding.evidence["function"] == "worker"
    child = next(p for p in result.report.data["processes"] if p["pid"] == finding.where["pid"])
    parent = next(p for p in result.report.data["processes"] if p["pid"] != finding.where["pid"])
    assert child["ppid"] == parent["pid"]


def test_a_forked_child_dumps_on_sigterm_only_with_the_default_action(tmp_path):
    """The dump follows the disposition the child inherited: its own file under the default
    action, nothing (and the program's handler in place) once the program took SIGTERM."""
    prog = script(
        tmp_path,
        """
        import os, signal, sys
        def writer():
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)  # reached only when SIGTERM is handled
        if sys.argv[1] == "handler":
            signal.signal(signal.SIGTERM, lambda *a: print("handled", flush=True))
        pid = os.fork()
        if pid == 0:
            writer()
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        """,
    )
    result, out, _ = quiet_run([sys.executable, prog, "default"], run_dir=str(tmp_path / "default"))
    assert out == f"child {-signal.SIGTERM}\n".encode()
    (finding,) = result.report.findings
    assert finding.evidence["signal"] == "SIGTERM" and finding.evidence["function"] == "writer"
    result, out, _ = quiet_run([sys.executable, prog, "handler"], run_dir=str(tmp_path / "handler"))
    assert (out, names(result)) == (b"handled\nchild 0\n", [])
    records = [json.loads(p.read_text()) for p in (tmp_path / "handler").glob("proc.*.json")]
    assert [r["term_dump"] for r in records if r["forked"]] == [False]


def test_an_exception_in_a_thread_is_recorded_not_reported(tmp_path):
    prog = script(
        tmp_path,
        """
        import threading
        def load():
            raise KeyError("shard-7")
        t = threading.Thread(target=load, name="loader"); t.start(); t.join()
        """,
    )
    result, _, err = quiet_run([sys.executable, prog])
    assert result.exit_code == 0 and b"KeyError: 'shard-7'" in err and names(result) == []
    (proc,) = result.report.data["processes"]
    assert [(e["type"], e["thread"]) for e in proc["exceptions"]] == [("builtins.KeyError", "loader")]


def test_a_dump_the_user_sent_to_stderr_is_still_read(tmp_path):
    """PYTHONFAULTHANDLER (or torchelastic's @record) puts the dump on stderr: it stays there,
    and the report reads it back from the stream."""
    prog = script(
        tmp_path,
        """
        import ctypes
        def decode():
            ctypes.string_at(0)
        decode()
        """,
    )
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    result, _, err = quiet_run([sys.executable, prog], env=env)
    assert result.exit_code == 128 + signal.SIGSEGV and b"Fatal Python error: Segmentation fault" in err
    (finding,) = result.report.findings
    assert finding.evidence["signal"] == "SIGSEGV" and finding.evidence["user_frame"] == f"{prog}:4 in decode"


def test_a_parent_that_fails_its_own_way_after_its_child_died(tmp_path):
    """A DataLoader-like parent: its worker is killed, then it raises its own error. Both are
    reported, the worker first; a parent that only reports its child (torchrun) would not be."""
    prog = script(
        tmp_path,
        """
        import os, signal
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(pid, 0)
        raise RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: Killed.")
        """,
    )
    result, _, _ = quiet_run([sys.executable, prog])
    assert result.exit_code == 1
    assert names(result) == ["fatal-signal", "uncaught-exception"]
    worker, parent = result.report.findings
    assert worker.evidence["signal"] == "SIGKILL" and worker.severity.value == "error"
    assert parent.evidence["error_kind"] == "dataloader-worker" and "dmesg" in parent.fix


def test_a_ranks_own_workers_are_not_ranks(tmp_path):
    """DataLoader workers (forked or spawned) inherit RANK: they are the rank's helpers, not
    more ranks of the job."""
    prog = script(
        tmp_path,
        """
        import os, subprocess, sys
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        subprocess.run([sys.executable, "-c", "pass"], check=True)  # a spawned helper
        raise RuntimeError("rank failed")
        """,
    )
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    result, _, _ = quiet_run([sys.executable, prog], env=env)
    assert names(result) == ["uncaught-exception"] and result.report.findings[0].where["rank"] == 0
    assert len(result.report.data["processes"]) == 3
    assert [row[0] for row in result.report.data["table"]["rows"]][:1] == [
        f"rank 0 (pid {result.report.findings[0].where['pid']})"
    ]


def test_an_exception_then_a_crash_at_shutdown_is_the_exception(tmp_path):
    """A CUDA error, then an abort while the interpreter shuts down (libraries' destructors):
    the exception is the story; the later dump stays in the data."""
    prog = script(
        tmp_path,
        """
        import atexit, os
        atexit.register(os.abort)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        """,
    )
    result, _, _ = quiet_run([sys.executable, prog])
    assert result.exit_code == 128 + signal.SIGABRT
    (finding,) = result.report.findings
    assert finding.name == "cuda-error" and finding.evidence["error_kind"] == "illegal-address"
    (proc,) = result.report.data["processes"]
    assert proc["ended"] == "exception" and proc["later_fault"]["signal"] == "SIGABRT"
    assert proc["later_fault"]["threads"]  # atexit's call has no Python frame, the thread is there


def test_the_programs_excepthook_questions_get_the_same_answers(tmp_path):
    """`sys.excepthook is sys.__excepthook__` decides what the exceptiongroup backport (Python
    3.10), PyQt and code.InteractiveConsole do: it stays true. A hook the program installs
    later that never passes the exception on still leaves it recorded."""
    prog = script(
        tmp_path,
        """
        import sys
        print(sys.excepthook is sys.__excepthook__, flush=True)
        def own(exc_type, exc, tb):
            sys.stderr.write(f"own hook: {exc}\\n")
        sys.excepthook = own
        def load():
            raise ValueError("shard 7 is empty")
        load()
        """,
    )
    plain = subprocess.run([sys.executable, prog], capture_output=True, check=False)
    result, out, err = quiet_run([sys.executable, prog])
    assert (result.exit_code, out, err) == (plain.returncode, plain.stdout, plain.stderr) == (
        1, b"True\n", b"own hook: shard 7 is empty\n"
    )  # fmt: skip
    (finding,) = result.report.findings
    assert finding.name == "uncaught-exception" and finding.evidence["exception"] == "builtins.ValueError"
    assert finding.evidence["function"] == "load"


def test_a_hook_that_passes_on_to_the_original_records_once(tmp_path):
    """apport's hook (Ubuntu's system Python) and most custom ones end in sys.__excepthook__."""
    prog = script(
        tmp_path,
        """
        import sys
        def own(exc_type, exc, tb):
            sys.stderr.write("own hook\\n")
            sys.__excepthook__(exc_type, exc, tb)
        sys.excepthook = own
        raise KeyError("k")
        """,
    )
    result, _, err = quiet_run([sys.executable, prog])
    assert err.startswith(b"own hook\nTraceback") and err.endswith(b"KeyError: 'k'\n")
    (proc,) = result.report.data["processes"]
    assert [e["type"] for e in proc["exceptions"]] == ["builtins.KeyError"]
