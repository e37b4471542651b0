"""A fork server for the suite's end-to-end runs: `python -m fpdoctor ...` and `python script.py`
started as a fork of an interpreter that has already imported torch, instead of a new interpreter
that imports it again.

Why: hundreds of tests run the CLI end to end, and importing torch is most of what a short run
costs (about 1 s of 1.7 s for a trace of a small script, several seconds on a loaded machine).
The commands served here (`SERVED`) import torch themselves before they run any user code, and the
tests' scripts import it first thing, so a child forked after that import starts where a new
interpreter would be a second later. torch._dynamo is imported too: the first step of any torch.optim
optimizer imports it (as much again as torch, on this machine), so a training script would anyway; a
test whose premise is that Dynamo is not imported yet runs its script with subprocess. argv, the
working folder, sys.path[0], the environment and the standard streams are the run's own, and the
child exits through the interpreter's normal shutdown (atexit handlers, flushed streams).

A run is served by a new interpreter instead when its environment differs from the server's
(variables read at import time would be stale), when its command is not in `SERVED` (`run`, `env`
and `health` are fast or watch their own imports), or when FPDOCTOR_TESTS_FRESH=1 is set, which
runs the whole suite the slow way. A script that sets a variable torch reads at import (TORCH_LOGS)
before its own `import torch` is run with subprocess, not run_python: here torch is imported first.

One server per pytest process (an xdist worker runs its tests one at a time), started on first use
and stopped at exit. It forks from a single thread and never runs a parallel op itself, so the
child's OpenMP pool is started by the child."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

SERVED = frozenset({"trace", "watch", "compare", "plan", "audit", "demo"})
# set per test by pytest (and by xdist per worker): never read by the code under test at import; and
# PYTHONPATH, which the child puts on its sys.path itself, where a new interpreter would
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "PYTHONPATH"})

_SERVER = r"""
import io, json, os, runpy, sys
import torch  # noqa: F401  the import every served command makes first
import torch._dynamo  # noqa: F401  what an optimizer's first step imports (torch.optim calls into it): ~1.5 s

requests, replies = sys.stdin.buffer, sys.stdout.buffer
for line in requests:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        requests.close(); replies.close()
        os.chdir(job["cwd"])
        os.environ.clear(); os.environ.update(job["env"])
        # the run's PYTHONPATH, after sys.path[0] as a new interpreter puts it (the server's own is there already)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = [os.path.abspath(p) for p in extra]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0); os.close(null)
        for fd, path in ((1, job["out"]), (2, job["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd); os.close(f)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        encoding = os.environ.get("PYTHONIOENCODING", "").partition(":")[0] or None  # "utf-8[:errors]"
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace", line_buffering=True
        )
        args = job["args"]
        del requests, replies, job, line, pid, f, fd, path, null, encoding, extra
        if args[0] == "-m":  # argv[0] becomes the module's file, sys.path[0] the working folder, as `python -m` has
            sys.argv, sys.path[0] = args[1:], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:  # a script: argv as given, sys.path[0] its folder
            sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
        sys.exit(0)  # a __main__ that returns: exit 0, as the interpreter does
    replies.write(b"%d\n" % pid); replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(b"%d\n" % os.waitstatus_to_exitcode(status)); replies.flush()
"""


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _VOLATILE}


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = _env_key(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        atexit.register(self.close)

    def run(self, args: list[str], env: dict[str, str], out: str, err: str, timeout: float) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"args": args, "cwd": os.getcwd(), "env": env, "out": out, "err": err}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self._read()
        timer = _Timer(pid, timeout)
        try:
            code = self._read()
        finally:
            timer.cancel()
        if timer.fired:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        return code

    def _read(self) -> int:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tests' fork server ended (exit code {self.proc.poll()}): see tests/zygote.py")
        return int(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a child still running (pytest interrupted): not left behind
                self.proc.kill()


class _Timer:
    """Kill the child (not the server) when a run goes past its timeout, as subprocess.run does."""

    def __init__(self, pid: int, timeout: float) -> None:
        import threading

        self.fired = False
        self._timer = threading.Timer(timeout, self._kill, (pid,))
        self._timer.daemon = True
        self._timer.start()

    def _kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended as the timer fired: no timeout
            os.kill(pid, signal.SIGKILL)
            self.fired = True

    def cancel(self) -> None:
        self._timer.cancel()


_servers: dict[str, _Server] = {}  # the one server of this pytest process, under "server"


def served(args: list[str], env: dict[str, str]) -> bool:
    """Whether `python ARGS` with ENV can run as a fork of the server: `-m fpdoctor COMMAND` for a
    command in SERVED, or a script of the test's own (a .py file) that imports torch itself."""
    if os.environ.get("FPDOCTOR_TESTS_FRESH") == "1" or not args:
        return False
    if args[0] == "-m":
        if args[1:2] != ["fpdoctor"] or len(args) < 3 or args[2] not in SERVED:
            return False
    elif not (args[0].endswith(".py") and os.path.isfile(args[0])):
        return False
    server = _servers.get("server")
    return server is None or server.env == _env_key(env)


def run(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """`python ARGS` forked from the server: (exit code, stdout, stderr)."""
    server = _servers.get("server")
    if server is None or server.proc.poll() is not None:
        server = _servers["server"] = _Server(env)
    with tempfile.TemporaryDirectory(prefix="fpdoctor-tests-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        code = server.run(args, env, out, err, timeout)
        with open(out, encoding="utf-8", errors="replace") as o, open(err, encoding="utf-8", errors="replace") as e:
            return code, o.read(), e.read()
