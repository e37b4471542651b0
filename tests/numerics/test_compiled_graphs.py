"""Each Dynamo graph checked where it runs (numerics/compiled/graphs.py): the first graph that made NaN/Inf
is named, a compiled-only fault made by an Inductor pass of the test's own is named with the pass
CompilerBisector finds, and its reproducer shows the NaN in a fresh interpreter without fpdoctor;
a healthy compiled model gives no finding, no warning and no graph compiled anew."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.compiled.graphs import GraphCheck
from tests.numerics.compiled_faults import NanAfterTanh
from tests.numerics.dynamo_counts import counted, needs_backend


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


def _loop(model: nn.Module, backend: str) -> tuple[Any, Any, Any]:
    """(the compiled wrapper, its optimizer, a forward-backward step)."""
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        return loss

    return compiled, opt, forward_backward


@pytest.fixture(scope="module")
def compiled_only() -> Iterator[dict[str, Any]]:
    """One Inductor compile of a model whose compiled program (only) has its tanh made NaN by a
    post-grad pass the test registers; the sentinel's report of its first step."""
    needs_backend("inductor")
    torch.manual_seed(0)
    model = Net()
    out: dict[str, Any] = {}
    with torch._inductor.config.patch(post_grad_custom_post_pass=NanAfterTanh()), counted() as seen:
        compiled, opt, forward_backward = _loop(model, "inductor")
        guard = fpdoctor.Sentinel(compiled, opt)
        guard.step(forward_backward)
        out["report"] = guard.report
        del guard  # its graph check comes off now, not when the module's tests are done
    out["seen"] = seen
    yield out
    for f in out["report"].findings:
        made = f.evidence.get("reproducer") or {}
        if made.get("dir"):
            shutil.rmtree(made["dir"], ignore_errors=True)


def test_the_compiled_only_graph_is_named(compiled_only: dict[str, Any]) -> None:
    found = {f.name: f for f in compiled_only["report"].findings}
    only = found["compiled-only-nonfinite"]
    graph = only.evidence["compiled_graph"]
    assert graph["backend"] == "inductor" and graph["bad_outputs"] == [0]
    assert graph["modules"] == ["a", "b"]
    assert any("test_compiled_graphs.py" in line and "in forward" in line for line in graph["lines"])
    assert "torch.tanh" in graph["ops"]
    assert only.evidence["graph_eager"] == "finite"  # the graph's own ops, run eagerly on its inputs
    assert f"Dynamo graph {graph['id']}" in only.message
    # the step check's own finding names the same graph, read from the per-call flags
    assert found["nonfinite-loss"].evidence["compiled_graph"]["id"] == graph["id"]


def test_the_pass_is_found_by_the_bisector(compiled_only: dict[str, Any]) -> None:
    only = compiled_only["report"].by_name("compiled-only-nonfinite")[0]
    settled = only.evidence["graph_compiled"]
    assert settled["recompiled"] == "non-finite"
    assert settled["emulate_precision_casts"] == "non-finite"  # rounding does not explain a pass's NaN
    found = settled["bisect"]
    assert (found["backend"], found["subsystem"], found["debug_info"]) == (
        "inductor",
        "post_grad_passes",
        "post_grad_custom_post_pass",
    )
    bad, good = found["sides"]["bad"], found["sides"]["good"]
    assert bad["TORCH_BISECT_SUBSYSTEM"] == "post_grad_passes"
    assert int(good["TORCH_BISECT_MAX"]) == int(bad["TORCH_BISECT_MAX"]) - 1
    assert "post_grad_custom_post_pass" in only.message


def test_the_reproducer_reproduces_in_a_fresh_interpreter(compiled_only: dict[str, Any]) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    only = compiled_only["report"].by_name("compiled-only-nonfinite")[0]
    made = only.evidence["reproducer"]
    assert made["reproduced"] is True, made
    directory = Path(made["dir"])
    code = (directory / "repro.py").read_text() + (directory / "graph.py").read_text()
    assert "import fpdoctor" not in code and "from fpdoctor" not in code
    assert not list(directory.glob("*.pt")) and not list(directory.glob("*.pkl"))  # no pickle
    sides = json.loads((directory / "repro.json").read_text())["sides"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # fpdoctor cannot be imported there
    for side, expected in (("bad", 1), ("good", 0)):
        done = subprocess.run(
            [sys.executable, str(directory / "repro.py")],
            cwd=str(directory),
            env={**env, **sides[side]},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == expected, (side, done.stdout[-500:], done.stderr[-2000:])


def test_no_graph_was_compiled_anew_for_the_diagnosis(compiled_only: dict[str, Any]) -> None:
    """The re-runs compile copies of the graph directly, not through Dynamo: the program's
    compiled code is what it was (one graph; the compiled re-run of the step hit it)."""
    assert compiled_only["seen"]["graphs"] == 1
    assert compiled_only["seen"]["recompiles"] == 0
    assert [line for line in compiled_only["seen"]["text"].splitlines() if "/fpdoctor/" in line] == []
    assert "Bisect" not in compiled_only["seen"]["text"]


def _healthy(watched: bool) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(0)
    model = Net()
    with counted() as seen:
        compiled, opt, forward_backward = _loop(model, "aot_eager")
        guard = fpdoctor.Sentinel(compiled, opt) if watched else None
        for _ in range(3):
            guard.step(forward_backward) if guard is not None else (forward_backward(), opt.step())
    return seen, guard


def test_a_healthy_compiled_model_adds_no_graph_no_finding_no_warning() -> None:
    plain, _ = _healthy(False)
    seen, guard = _healthy(True)
    assert (seen["graphs"], seen["frames"], seen["recompiles"]) == (plain["graphs"], plain["frames"], 0)
    assert guard.report.findings == []
    assert [line for line in seen["text"].splitlines() if "/fpdoctor/" in line or "global hooks" in line] == []


def test_the_first_graph_with_a_nonfinite_output_is_named_where_eager_makes_it_too() -> None:
    torch.manual_seed(0)
    model = Net(log=True)
    with counted():
        compiled, opt, forward_backward = _loop(model, "aot_eager")
        guard = fpdoctor.Sentinel(compiled, opt)
        guard.step(forward_backward)
    found = {f.name: f for f in guard.report.findings}
    graph = found["nonfinite-loss"].evidence["compiled_graph"]
    assert "torch.log" in graph["ops"] and graph["call"] == 1
    assert any("test_compiled_graphs.py" in line for line in graph["lines"])
    assert found["deterministic-nonfinite"].where["op"] == "aten.log.default"
    assert "compiled-only-nonfinite" not in found


def test_graph_calls_are_read_once_per_window() -> None:
    """Per call one flag stays on the device; `first_bad` reads them at once, in call order."""
    check = GraphCheck()
    try:
        torch._dynamo.reset()
        blocks = [torch.compile(nn.Linear(4, 4), backend="aot_eager") for _ in range(3)]
        with torch.no_grad():
            blocks[1].weight.fill_(math.inf)
        x = torch.ones(2, 4)
        check.begin()
        for block in blocks:
            x = block(x)
        bad = check.first_bad()
        assert bad is not None and (bad["at_call"], bad["graph_calls"]) == (2, 3)
        assert bad["number"] in [g.number for g in check.graphs]
        check.begin()
        assert check.first_bad() is None
    finally:
        check.close()


def _rounded_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a * b  # rounded to bf16 by eager; Inductor keeps the fp32 product inside its fused kernel
    d = c.float() - a.float() * b.float()  # eager: the rounding error (2**-14); Inductor: 0
    return 1.0 / d


def test_a_bf16_rounding_difference_is_settled_by_emulate_precision_casts(tmp_path: Any) -> None:
    """Fused fp32 intermediates of a bf16 graph (no fault of a pass) are told apart from a pass's
    NaN: emulate_precision_casts makes the graph finite, so nothing is bisected."""
    from fpdoctor.numerics.compiled.step import graph_evidence

    needs_backend("inductor")
    a = torch.full((4,), 1 + 2**-7, dtype=torch.bfloat16)
    assert _rounded_apart(a, a).isfinite().all()
    check = GraphCheck()
    try:
        torch._dynamo.reset()
        with check.capturing() as found:
            assert not torch.compile(_rounded_apart)(a, a).isfinite().all()
    finally:
        check.close()
    assert found and found[0].bad_outputs == [0]
    evidence = graph_evidence(found[0], str(tmp_path / "repro"))
    assert evidence["graph_eager"] == "finite"
    settled = evidence["graph_compiled"]
    assert (settled["recompiled"], settled["emulate_precision_casts"]) == ("non-finite", "finite")
    assert settled["settled_by"] == "emulate_precision_casts" and "bisect" not in settled
    assert "operator.mul" in evidence["compiled_graph"]["ops"]
    assert evidence["reproducer"]["reproduced"] is True


def test_watch_names_the_graph_compiled_before_its_first_step() -> None:
    """`watch` makes its judge at the first optimizer step, after the first forward compiled the
    graph: the graph is wrapped all the same, and the bad step names it."""
    torch.manual_seed(0)
    model = Net(log=True)
    with counted() as seen, fpdoctor.watch() as watch:
        _, opt, forward_backward = _loop(model, "aot_eager")
        forward_backward()
        opt.step()
    assert seen["graphs"] == 1
    found = {f.name: f for f in watch.report.findings}
    graph = found["nonfinite-loss"].evidence["compiled_graph"]
    assert "torch.log" in graph["ops"] and graph["backend"] == "aot_eager"


def test_a_graph_whose_eager_ops_make_the_nan_names_the_op_and_line() -> None:
    """The graph re-run eagerly, node by node, on the inputs it had: the node of origin and the
    user line Dynamo recorded for it; then it is not compiled-only, and nothing is recompiled."""
    from fpdoctor.numerics.compiled.step import graph_evidence

    torch.manual_seed(0)
    model = Net(log=True)
    check = GraphCheck()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        with check.capturing() as found:
            compiled(torch.randn(4, 8))
    finally:
        check.close()
    assert found
    evidence = graph_evidence(found[0], None)
    origin = evidence["graph_eager_origin"]
    assert evidence["graph_eager"] == "non-finite" and origin["op"] == "torch.log"
    assert origin["line"].split(" in ")[0].endswith("test_compiled_graphs.py:" + str(_line_of("torch.log(h - 2.0)")))
    assert "graph_compiled" not in evidence and "reproducer" not in evidence


def _line_of(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(Net.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _torchs_own() -> bool:
    """Dynamo's one call of the backend is torch's, not a check's wrapper."""
    from torch._dynamo.output_graph import OutputGraph

    return "fpdoctor" not in OutputGraph.call_user_compiler.__module__


def test_a_sentinel_gone_puts_dynamos_class_back() -> None:
    """The Sentinel has no end of its own: once it is collected, its graph check is taken off."""
    import gc

    gc.collect()
    assert _torchs_own()  # no check of an earlier test is left open
    torch.manual_seed(0)
    with counted():
        compiled, opt, forward_backward = _loop(Net(), "eager")
        guard = fpdoctor.Sentinel(compiled, opt)
        guard.step(forward_backward)
        assert not _torchs_own()
        del guard
        gc.collect()
    assert _torchs_own()


def test_a_captured_call_keeps_its_inputs_as_they_were_before_the_graph_wrote_into_them() -> None:
    """A graph that writes into its input in place: the copy the re-runs start from is the input
    before the call, and it is judged finite on those values."""

    def f(x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return torch.log(x - 3.0)  # NaN from the written value 2; from the input's 1 too

    check = GraphCheck()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="eager")
        x = torch.ones(4)
        with check.capturing() as found:
            compiled(x)
        assert torch.equal(x, torch.full((4,), 2.0))  # the program's own input was written, as without us
        (captured,) = found
        assert torch.equal(captured.inputs[0], torch.ones(4))
    finally:
        check.close()


def test_dynamos_class_is_put_back_when_a_stale_check_is_held_only_by_a_reference_cycle() -> None:
    """A check whose owner was dropped without closing it (a sentinel left open by code that ended) stays in
    the open set while a reference cycle holds it and the collector has not run: the last check to close
    put nothing back, and a later program's compile ran through fpdoctor's wrapper."""
    import gc

    from torch._dynamo.output_graph import OutputGraph

    class Owner:
        def __init__(self) -> None:
            self.me = self  # a cycle: freed only by the collector
            self.check = GraphCheck()

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        Owner()  # opened, never closed, unreachable but not freed
        live = GraphCheck()
        assert "fpdoctor" in OutputGraph.call_user_compiler.__module__
        live.close()
        assert "fpdoctor" not in OutputGraph.call_user_compiler.__module__
    finally:
        if enabled:
            gc.enable()


def test_a_check_closed_by_a_finalizer_while_another_closes_does_not_hang() -> None:
    """Closing a check collects the stale ones a reference cycle holds (above); a stale owner's finalizer
    (a judge's, which closes its own check) then ran inside that close, on the same thread, and waited for
    the lock the close held: the program hung (a Lightning test ran into pytest's 300 s timeout)."""
    import gc
    import threading
    import weakref

    class Owner:
        def __init__(self) -> None:
            self.me = self  # a cycle: freed only by the collector
            check = GraphCheck()
            weakref.finalize(self, check.close)

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        Owner()
        live = GraphCheck()
        closer = threading.Thread(target=live.close, daemon=True)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "closing a check hung on its own lock"
    finally:
        if enabled:
            gc.enable()
