"""The tests' fork server (tests/zygote.py) runs a script as a new interpreter would: its argv, working
folder, sys.path[0], streams, exit code (a sys.exit, an uncaught exception, a signal) and atexit
handlers, compared with the same script in a new interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zygote

SCRIPT = """
import atexit, os, signal, sys
import torch
print("argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("cwd", os.getcwd(), "name", __name__, "threads", torch.get_num_threads())
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
how = sys.argv[1]
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("bad batch")
if how == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_forked_script_behaves_as_in_a_new_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    # a server of this test's own: the worker's may have been started with another environment
    monkeypatch.setattr(zygote, "_servers", {})
    monkeypatch.delenv("FPDOCTOR_TESTS_FRESH", raising=False)
    assert zygote.served([str(script), "exit"], env)
    for how in ("exit", "raise", "signal", "end"):
        fresh = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env, check=False)
        code, out, err = zygote.run([str(script), how], env, timeout=120)
        assert (code, out) == (fresh.returncode, fresh.stdout), (how, code, out, fresh.returncode, fresh.stdout)
        assert err.splitlines()[0] == fresh.stderr.splitlines()[0] == "to stderr"
        assert err.splitlines()[-1] == fresh.stderr.splitlines()[-1], (err, fresh.stderr)  # ValueError: bad batch
    zygote._servers["server"].close()
