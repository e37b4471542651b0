"""torch.compile'd training loops under trace, the Sentinel and `watch`: fpdoctor compiles nothing
of its own (same graphs, same graph breaks, no warning naming its files), a NaN made inside the
compiled region is found, and each finding says where it was seen (evidence.seen_in)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor
from tests.numerics.dynamo_counts import counted, needs_backend

# aot_eager: Dynamo and AOTAutograd as torch.compile runs them, without Inductor's C++ build
# (tens of seconds per graph on a small machine); what fpdoctor must stay out of is Dynamo's part.
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _compiles() -> None:
    needs_backend(BACKEND)


class Net(nn.Module):
    def __init__(self, nan: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)
        self.nan = nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.nan:
            h = torch.log(h - 1.0)  # NaN made inside the compiled region
        return self.b(h)


def _loop(nan: bool = False, *, whole: bool = False, backend: Any = BACKEND) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = Net(nan)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        return loss

    def step() -> torch.Tensor:
        loss = forward_backward()
        opt.step()
        return loss

    return compiled, opt, forward_backward, torch.compile(step, backend=backend) if whole else step


def _ours(text: str) -> list[str]:
    """Dynamo's and torch's warnings that name fpdoctor's files or its hooks (not its own notices)."""
    return [line for line in text.splitlines() if "/fpdoctor/" in line or "global hooks" in line]


def _plain(whole: bool) -> dict[str, Any]:
    *_, step = _loop(whole=whole)
    with counted() as seen:
        for _ in range(3):
            step()
    return seen


@pytest.mark.parametrize("whole", [False, True], ids=["compiled-module", "compiled-step"])
def test_watch_compiles_what_the_program_compiles(whole: bool) -> None:
    plain = _plain(whole)
    *_, step = _loop(whole=whole)
    with counted() as seen, fpdoctor.watch() as watch:
        for _ in range(3):
            step()
    assert (seen["graphs"], seen["breaks"]) == (plain["graphs"], plain["breaks"])
    assert _ours(seen["text"]) == []
    assert [f.name for f in watch.report.findings if f.name == "sentinel-error"] == []


def test_sentinel_compiles_what_the_program_compiles() -> None:
    plain = _plain(False)
    model, opt, forward_backward, _ = _loop()
    with counted() as seen:
        guard = fpdoctor.Sentinel(model, opt)
        for _ in range(3):
            guard.step(forward_backward)
    assert (seen["graphs"], seen["breaks"]) == (plain["graphs"], plain["breaks"])
    assert _ours(seen["text"]) == []
    assert guard.report.findings == []


def test_sentinel_finds_a_nan_made_in_the_compiled_region() -> None:
    model, opt, forward_backward, _ = _loop(nan=True)
    guard = fpdoctor.Sentinel(model, opt)
    with counted() as seen:
        guard.step(forward_backward)
    assert _ours(seen["text"]) == []
    found = {f.name: f for f in guard.report.findings}
    assert found["nonfinite-loss"].evidence["seen_in"] == "compiled"
    assert found["nonfinite-loss"].evidence["compiled_output"] == {"module": "<root>", "call": 1, "compiled_calls": 1}
    replayed = found["deterministic-nonfinite"]
    assert replayed.evidence["seen_in"] == "eager replay"
    assert replayed.where["op"] == "aten.log.default"
    assert "test_compiled.py" in replayed.evidence["location"]


def test_watch_finds_a_nan_made_in_the_compiled_region() -> None:
    *_, step = _loop(nan=True)
    with counted() as seen, fpdoctor.watch() as watch:
        step()
    assert _ours(seen["text"]) == []
    found = {f.name: f for f in watch.report.findings}
    assert found["deterministic-nonfinite"].evidence["seen_in"] == "eager replay"
    assert found["deterministic-nonfinite"].where["op"] == "aten.log.default"
    assert found["nonfinite-loss"].evidence["seen_in"] == "compiled"
    model = next(iter(watch.runs.values())).judge.model
    assert not model._forward_hooks  # nothing left on the script's compiled module once the watch ends


def test_trace_says_where_its_findings_were_seen() -> None:
    """The NaN the compiled graph made was seen in the compiled program (its op named by the
    graph's eager re-run); the tracer's own findings were seen in the eager ops around it."""
    model, _, _, step = _loop(nan=True)
    with counted() as seen, fpdoctor.trace(model) as t:
        step()
    assert _ours(seen["text"]) == []
    produced = t.report.by_name("nonfinite-produced")
    assert produced and produced[0].where["op"] == "torch.log"
    assert produced[0].evidence["seen_in"] == "compiled"
    assert {f.evidence["seen_in"] for f in t.report.findings[1:]} <= {"eager"}


def _nan_after_compiling(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """A backend with a fault of its own: the compiled graph's float outputs come out NaN, which
    the model's eager ops never make."""

    def run(*args: Any) -> Any:
        out = gm(*args)
        return type(out)(o * math.nan if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)

    return run


def test_a_nan_only_the_compiled_program_makes_is_compiled_only() -> None:
    model, opt, forward_backward, _ = _loop(backend=_nan_after_compiling)
    guard = fpdoctor.Sentinel(model, opt)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    guard.step(forward_backward)
    found = {f.name: f for f in guard.report.findings}
    assert "transient-fault-suspected" not in found and "deterministic-nonfinite" not in found
    only = found["compiled-only-nonfinite"]
    assert only.code == "TRN012" and only.evidence["seen_in"] == "compiled"
    assert math.isfinite(only.evidence["eager_replay_loss"]) and math.isnan(only.evidence["compiled_rerun_loss"])
    assert counters["stats"]["unique_graphs"] == 1  # the re-run compiled nothing anew
    assert found["nonfinite-loss"].evidence["seen_in"] == "compiled"


def test_an_eager_model_keeps_its_findings_as_they_were() -> None:
    torch.manual_seed(0)
    model = Net(nan=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    guard = fpdoctor.Sentinel(model, opt)
    guard.step(forward_backward)
    assert all("seen_in" not in f.evidence for f in guard.report.findings)


def test_the_first_compiled_block_with_a_nonfinite_output_is_named() -> None:
    """Blocks compiled one by one (as large trainers compile theirs): the check names the block
    whose compiled output first went non-finite, not the blocks that passed it on."""
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8) for _ in range(3)]
    with torch.no_grad():
        blocks[1].weight.fill_(3e38)  # finite weights; block 1's outputs overflow, block 2 passes Inf/NaN on
    model = nn.Sequential(*[torch.compile(b, backend=BACKEND) for b in blocks])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.rand(4, 8) + 1.0

    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    guard = fpdoctor.Sentinel(model, opt, replay=False)
    guard.step(forward_backward)
    loss = guard.report.by_name("nonfinite-loss")[0]
    assert loss.evidence["compiled_output"] == {"module": "1", "call": 1, "compiled_calls": 3}


def test_watch_started_before_dynamo_is_imported_compiles_nothing_of_its_own(tmp_path: Any) -> None:
    """`fpdoctor watch -- train.py` starts before the script imports torch._dynamo: fpdoctor's code
    is kept out of Dynamo when the script compiles, and the graphs are the script's own."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        """
import sys, torch
from torch import nn
watched = sys.argv[1] == "watched"
if watched:
    import fpdoctor
    w = fpdoctor.watch()
assert "torch._dynamo" not in sys.modules or not watched
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
@torch.compile(backend="aot_eager")
def step():
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
for _ in range(3):
    step()
from torch._dynamo.utils import counters
print("COUNTS", counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
"""
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {
        how: subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=300, env=env, check=True
        )
        for how in ("plain", "watched")
    }
    counts = {how: [line for line in r.stdout.splitlines() if line.startswith("COUNTS")] for how, r in runs.items()}
    assert counts["watched"] == counts["plain"] and counts["plain"]
    assert _ours(runs["watched"].stderr) == []


def test_the_lightning_callback_on_a_compiled_model() -> None:
    """The framework callbacks judge a compiled model's steps like the sentinel: the same graphs as
    without fpdoctor, and a NaN in a batch found in the compiled program and named by the eager replay."""
    pytest.importorskip("lightning.pytorch", reason="needs lightning (`make test`)")
    from fpdoctor.integrations.lightning import FpDoctorCallback
    from tests.integrations.lit import Net, data, trainer

    def fit(callbacks: list[Any]) -> dict[str, Any]:
        net = Net(nan_data=(3, 1))
        net.net = torch.compile(net.net, backend=BACKEND)
        with counted() as seen:
            trainer(callbacks, max_steps=4).fit(net, data())
        return seen

    plain = fit([])
    callback = FpDoctorCallback()
    seen = fit([callback])
    assert (seen["graphs"], seen["breaks"]) == (plain["graphs"], plain["breaks"])
    assert _ours(seen["text"]) == []
    found = {f.name: f for f in callback.report.findings}
    assert found["nonfinite-loss"].evidence["seen_in"] == "compiled"
    assert found["nonfinite-loss"].evidence["compiled_output"]["module"] == "net"
    assert found["deterministic-nonfinite"].evidence["seen_in"] == "eager replay"


def test_inductor_compiled_nan_is_found_and_replayed() -> None:
    """The same with Inductor's C++ kernels (the rest of this file uses aot_eager to stay fast): the
    NaN of a fused kernel is seen in the compiled program and named by the eager replay."""
    needs_backend("inductor")
    model, opt, forward_backward, _ = _loop(nan=True, backend="inductor")
    guard = fpdoctor.Sentinel(model, opt)
    with counted() as seen:
        guard.step(forward_backward)
    assert _ours(seen["text"]) == []
    found = {f.name: f for f in guard.report.findings}
    assert found["nonfinite-loss"].evidence["seen_in"] == "compiled"
    assert found["nonfinite-loss"].evidence["compiled_output"]["module"] == "<root>"
    assert found["deterministic-nonfinite"].evidence["seen_in"] == "eager replay"
    assert found["deterministic-nonfinite"].where["op"] == "aten.log.default"
    assert seen["graphs"] == 1  # the replay ran eagerly; nothing was compiled anew
