"""The trace names whose a custom op is: the program's, or the environment's (registered by a
sitecustomize before the first line), from where torch's dispatcher says it was defined."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import fpdoctor
from fpdoctor.numerics.engine import reruns

SITECUSTOMIZE = """\
import torch

_lib = torch.library.Library("nodeops", "DEF")
_lib.define("logit(Tensor x) -> Tensor")
_lib.impl("logit", lambda x: torch.log(x / (1 - x)), "CPU")
"""

SCRIPT = """\
import json, sys
import torch
import fpdoctor

with fpdoctor.trace(repro=sys.argv[1]) as t:
    torch.ops.nodeops.logit(torch.tensor([0.5, 1.0]))  # 1.0: log(1 / 0) = inf
finding = next(f for f in t.report.findings if f.name == "nonfinite-produced")
sys.stdout.write("WHY " + json.dumps(finding.message) + "\\n")
"""


def test_an_op_the_environment_registered_is_not_called_the_programs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    (tmp_path / "train.py").write_text(SCRIPT, encoding="utf-8")
    environ = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path / "repro")],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("WHY "))
    message = json.loads(line.removeprefix("WHY "))
    assert "defined by the environment, not your code" in message
    assert f"sitecustomize at {site / 'sitecustomize.py'}:3" in message
    assert "defined by your code" not in message


def test_an_op_the_program_defined_is_its_own(tmp_path: Path) -> None:
    @torch.library.custom_op("fpdoctorwhose::halve_log", mutates_args=())
    def halve_log(x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) / 2

    with fpdoctor.trace(repro=tmp_path / "r") as t:
        halve_log(torch.tensor([-1.0, 2.0]))
    finding = next(f for f in t.report.findings if f.name == "nonfinite-produced")
    assert "a custom op defined by your code at " in finding.message
    assert "fpdoctorwhose.halve_log.default" in finding.message


def test_an_op_from_an_installed_package_or_unknown_is_said_so(monkeypatch) -> None:
    monkeypatch.setattr(
        "fpdoctor.numerics.engine.reruns.defined_at", lambda op: ("/v/lib/site-packages/ext/ops.py", 12)
    )
    assert reruns.whose("ext.fused.default") == (
        "defined by an installed package, not your code: registered at /v/lib/site-packages/ext/ops.py:12"
    )
    monkeypatch.setattr("fpdoctor.numerics.engine.reruns.defined_at", lambda op: ("/build/ext/csrc/ops.cpp", 40))
    assert reruns.whose("ext.fused.default") == "a compiled extension's op, registered at /build/ext/csrc/ops.cpp:40"
    monkeypatch.setattr("fpdoctor.numerics.engine.reruns.defined_at", lambda op: None)
    assert "not known" in reruns.whose("ext.fused.default")
