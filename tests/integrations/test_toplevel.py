"""What `fpdoctor watch` does per step, kept off per-module and per-parameter work: its module hooks
see the top-level calls only (none of its global hooks in torch's tables while one runs, so the
submodule calls inside it take torch's hook-free path), and its list of parameters is made again
only when the optimizer's param groups change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from fpdoctor import torchprivate as tp
from fpdoctor.integrations import _toplevel
from fpdoctor.integrations._toplevel import TopLevelCalls


@pytest.fixture(autouse=True)
def eager_program(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A program that has compiled nothing (earlier tests in this process may have): the count of
    frames Dynamo was handed, settable by a test."""
    frames = [0]
    monkeypatch.setattr(_toplevel, "dynamo_frames_seen", lambda: frames[0])
    return frames


def _ours(calls: TopLevelCalls) -> set[int]:
    """The ids of `calls`' global hooks still in torch's tables."""
    tables = tp.global_forward_hook_tables(module_hooks)
    assert tables is not None
    handles = {h.id for h in calls._handles}
    return handles & (set(tables[0]) | set(tables[1]))


class Inner(nn.Module):
    """Notes, as it runs, which of the watch's global hooks torch would call for it."""

    def __init__(self, calls: list[TopLevelCalls], fail: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls, self.fail, self.seen = calls, fail, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_ours(self.calls[0]))
        if self.fail:
            raise ValueError("a forward that raises")
        return self.lin(x)


def _recording() -> tuple[TopLevelCalls, list[tuple[str, Any, bool]], list[TopLevelCalls]]:
    events: list[tuple[str, Any, bool]] = []

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        events.append(("pre", module, True))

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: Any, *output: Any) -> None:
        events.append(("post", module, bool(output) and output[0] is not None))

    calls = TopLevelCalls(pre, post)
    return calls, events, [calls]


def test_only_top_level_calls_are_seen_and_the_calls_inside_them_meet_no_hook_of_the_watch():
    calls, events, box = _recording()
    inner = Inner(box)
    model = nn.Sequential(inner, nn.ReLU())
    calls.start()
    try:
        assert len(_ours(calls)) == 2
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))
        assert inner.seen == [set(), set()]  # taken out for the top-level call's duration
        assert len(_ours(calls)) == 2  # and put back after it
        assert events == [("pre", model, True), ("post", model, True)] * 2
        assert not model._forward_hooks  # the hook that saw the call end came off with it
    finally:
        calls.close()
    assert not _ours(calls) and not model._forward_hooks
    assert calls._handles[1].id not in tp.global_forward_hooks_with_kwargs(module_hooks)
    model(torch.ones(1, 2))
    assert len(events) == 4  # nothing seen after close


def test_a_raising_forward_ends_its_call_and_leaves_no_hook_behind():
    calls, events, box = _recording()
    failing = Inner(box, fail=True)
    other = nn.Linear(2, 2)
    calls.start()
    try:
        with pytest.raises(ValueError, match="a forward that raises"):
            failing(torch.ones(1, 2))
        assert events == [("pre", failing, True), ("post", failing, False)]  # no output: it raised
        assert failing._forward_hooks  # torch was iterating them: the hook comes off later
        assert len(_ours(calls)) == 2  # back in torch's tables
        other(torch.ones(1, 2))  # the next top-level call takes the raising call's hook off
        assert not failing._forward_hooks and not other._forward_hooks
        with pytest.raises(ValueError):
            failing(torch.ones(1, 2))
    finally:
        calls.close()
    assert not failing._forward_hooks and not _ours(calls)


def test_a_module_that_takes_no_hook_of_its_own_keeps_the_global_hooks_and_its_depth(monkeypatch):
    calls, events, box = _recording()
    inner = Inner(box)
    model = nn.Sequential(inner, nn.ReLU())

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no hooks on this module")

    monkeypatch.setattr(model, "register_forward_hook", refuse)
    calls.start()
    try:
        model(torch.ones(1, 2))
    finally:
        calls.close()
    assert len(inner.seen[0]) == 2  # the global hooks stayed in: the nested calls counted, not seen
    assert events == [("pre", model, True), ("post", model, True)]


def test_once_the_program_compiles_the_hooks_stay_in_but_for_the_module_compiled_inside_its_call(
    eager_program: list[int],
):
    calls, events, box = _recording()
    inner = Inner(box)
    model = nn.Sequential(inner, nn.ReLU())

    class Compiling(nn.Module):  # torch.compile(model) called at the top: Dynamo compiles inside its call
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            eager_program[0] += 1
            return model(x)

    compiling = Compiling()
    calls.start()
    try:
        compiling(torch.ones(1, 2))
        compiling(torch.ones(1, 2))  # its code was compiled with the hooks out: out again
        model(torch.ones(1, 2))  # anything else, once the program compiles: the hooks stay as they are
    finally:
        calls.close()
    assert inner.seen[:2] == [set(), set()] and len(inner.seen[2]) == 2
    assert [e[1] for e in events] == [compiling, compiling, compiling, compiling, model, model]


def test_the_watch_checks_a_param_group_added_after_its_first_step():
    """The watch's list of parameters is made once and again when the optimizer's groups change: a
    parameter added later whose gradient is Inf (the loss finite) makes the step non-finite, and it
    is skipped."""
    from fpdoctor.integrations.script import ScriptWatch

    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    extra = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    with ScriptWatch(replay=False, gpu_health=False) as watch:
        for step in range(3):
            if step == 2:
                opt.add_param_group({"params": [extra]})
            opt.zero_grad()
            # sqrt at 0: a finite loss, an Inf gradient for the parameter added last
            loss = model(x).square().mean() + (torch.sqrt(extra - 1).sum() if step == 2 else 0)
            loss.backward()
            opt.step()
    judge = next(iter(watch.runs.values())).judge
    assert [h.finite for h in judge.history] == [True, True, False]
    assert judge.skipped == 1 and extra.item() == 1.0
