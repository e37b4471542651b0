"""Compiled models under `trace` (numerics/compiled/under_trace.py): the graphs run compiled, each call
checked; the eager ops around them are traced; the first bad graph is run again apart: its op
and line where eager makes the NaN too, `compiled-only-nonfinite` where only the compiled
program does. A healthy compiled model gives no finding, no warning and no graph of its own."""

from __future__ import annotations

import contextlib
import json
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor
from tests.conftest import run_fpdoctor
from tests.numerics.dynamo_counts import counted, needs_backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _inductor() -> None:
    needs_backend("inductor")


class Net(nn.Module):
    def __init__(self, log: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.log:
            h = torch.log(h - 2.0)  # NaN in the model's own math: eager makes it too
        return self.b(h)


LOG_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "torch.log(h - 2.0)" in line)


def _steps(model: nn.Module, traced: bool) -> Any:
    """Two forward-backward steps of the compiled model: the trace's report, or None."""
    torch.manual_seed(0)
    compiled = torch.compile(model)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with fpdoctor.trace(compiled) if traced else contextlib.nullcontext() as t:
        for _ in range(2):
            loss = ((compiled(x) - y) ** 2).mean()
            loss.backward()
    return t


def test_a_healthy_compiled_model_runs_compiled_with_the_ops_around_it_traced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a reproducer's folder would be made
    with counted() as plain:
        _steps(Net(), traced=False)
    with counted() as seen:
        t = _steps(Net(), traced=True)
    assert (seen["graphs"], seen["frames"], seen["recompiles"]) == (plain["graphs"], plain["frames"], 0)
    assert "fpdoctor" not in seen["text"] and "global hooks" not in seen["text"]
    assert t.report.findings == []
    assert "torch.compile" not in t.report.data["not_checked"]
    assert dict(t.report.data["summary"])["compiled graph calls"].startswith("2 run compiled")
    ops = {r.op for r in t.records}
    # the loss's ops, forward and backward, are the eager ones around the graph; the graph's own
    # (Linear's addmm, in forward or backward) ran compiled, unseen by the tracer
    assert {"aten.sub.Tensor", "aten.pow.Tensor_Scalar", "aten.mean.default"} <= ops
    assert not {"aten.addmm.default", "aten.mm.default", "aten.tanh.default"} & ops
    assert list(tmp_path.iterdir()) == []  # no reproducer to write: no folder made for one


def test_a_nan_the_eager_ops_make_too_names_the_op_and_the_user_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with counted():
        t = _steps(Net(log=True), traced=True)
    first = t.report.findings[0]
    assert first.name == "nonfinite-produced" and first.where["op"] == "torch.log"
    assert first.evidence["seen_in"] == "compiled"
    assert first.evidence["location"].startswith(f"{__file__}:{LOG_LINE} in forward")
    assert first.evidence["compiled_graph"]["id"] == "0/0"
    # the eager loss ops got the NaN from the graph's output, which the tracer names as such; what
    # the NaN did downstream is not told as bad input data
    made = [leaf for leaf in t.tracer.leaves if leaf.origin == "compiled"]
    assert made and made[0].name == "an output of compiled graph 0/0" and made[0].kind == "nan"
    assert not [f for f in t.report.findings if f.name == "nonfinite-input"]
    assert list(tmp_path.iterdir()) == []  # the eager op is the finding: no reproducer, no folder


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    import torch._inductor.config
    from torch import nn
    from tests.numerics.compiled_faults import NanAfterTanh

    torch._inductor.config.post_grad_custom_post_pass = NanAfterTanh()
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))
    loss = (model(torch.randn(4, 8)) ** 2).mean()
    loss.backward()
    print(float(loss))
""")


def test_the_cli_trace_of_a_compiled_only_nan_names_the_graph_and_the_pass(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT)), encoding="utf-8")
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "--repro", str(tmp_path / "repro"), "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    assert "fpdoctor" not in result.err.replace(str(tmp_path), "")
    found = json.loads(report.read_text(encoding="utf-8"))["findings"]
    assert [f["name"] for f in found] == ["compiled-only-nonfinite"]
    only = found[0]["evidence"]
    assert only["seen_in"] == "compiled" and only["graph_eager"] == "finite"
    assert only["compiled_graph"]["id"] == "0/0" and "torch.tanh" in only["compiled_graph"]["ops"]
    assert only["graph_compiled"]["recompiled"] == "non-finite"
    assert only["graph_compiled"]["bisect"]["found"] is True
    assert only["reproducer"]["reproduced"] is True
    assert "Dynamo graph 0/0" in found[0]["message"]
