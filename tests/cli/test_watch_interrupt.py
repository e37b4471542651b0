"""`fpdoctor watch` and Ctrl-C: the script's KeyboardInterrupt is printed as python prints it, the
report of the steps so far follows (INCOMPLETE, never OK), and fpdoctor then dies of SIGINT as
python does after an uncaught KeyboardInterrupt (a shell's 130, a parent's returncode -2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

INTERRUPTED = textwrap.dedent(
    """
    import os, signal, torch
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    print("stepped", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
    print("went on", flush=True)
    """
)


def _run(*argv: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT at its default in the child, as a shell starts a job: a pytest-xdist worker ignores it, and
    # python started with SIGINT ignored keeps ignoring it (no KeyboardInterrupt to test)
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("output", [False, True])
def test_ctrl_c_gives_the_report_then_dies_of_sigint_as_python_does(tmp_path, output):
    script = tmp_path / "job.py"
    script.write_text(INTERRUPTED, encoding="utf-8")
    plain = _run(sys.executable, str(script), cwd=str(tmp_path))
    report = tmp_path / "report.json"
    options = ["-o", str(report)] if output else []
    watched = _run(sys.executable, "-m", "fpdoctor", "watch", *options, "--", str(script), cwd=str(tmp_path))
    assert plain.returncode == watched.returncode == -signal.SIGINT, watched.stderr
    assert plain.stdout == watched.stdout == "stepped\n"
    assert watched.stderr.splitlines().count("KeyboardInterrupt") == plain.stderr.splitlines().count(
        "KeyboardInterrupt"
    )
    assert plain.stderr.splitlines().count("KeyboardInterrupt") == 1
    assert watched.stderr.startswith(plain.stderr.strip().splitlines()[0])  # python's traceback first
    assert "fpdoctor: interrupted" not in watched.stderr
    if output:
        doc = json.loads(report.read_text(encoding="utf-8"))
        assert doc["data"]["status"] == "incomplete" and doc["data"]["steps"] == 2 and doc["verdict"] != "ok"
        assert "interrupted (KeyboardInterrupt, Ctrl-C)" in dict(doc["data"]["summary"])["ended"]
    else:
        after = watched.stderr.split("\nKeyboardInterrupt\n", 1)[1].strip().splitlines()
        assert after[0].split()[:3] == ["INCOMPLETE", "fpdoctor", "watch"], watched.stderr
