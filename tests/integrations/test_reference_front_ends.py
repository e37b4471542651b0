"""The reference step under `fpdoctor watch` and the Lightning callback: the model's backward at
step 1 against the same step in fp32 without autocast or loss scaling (numerics/training/reference.py).

The departing recipe is one of our own: a custom autograd function whose backward drops the chain
rule's factor when it runs in bf16 (an "optimised" low-precision path that is wrong). No rule
foresees it: the step is finite, the loss goes down, only a reference says the gradients are a
third of what they should be. The healthy recipes (bf16 autocast, clipping, accumulation) must
say what they were compared with and find nothing.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch
from torch import nn

from fpdoctor.integrations.script import ScriptWatch
from tests.integrations.lit import FpDoctorCallback, Net, data, trainer


class _Thrice(torch.autograd.Function):
    """y = 3x, whose backward forgets the 3 when x is bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.low = x.dtype == torch.bfloat16
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad if ctx.low else grad * 3


class _Mlp(nn.Module):
    def __init__(self, broken: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.broken = nn.Linear(16, 64), nn.Linear(64, 4), broken

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(_Thrice.apply(h) if self.broken else h * 3)


def _watched(broken: bool, *, clip: float | None = None, accumulate: int = 1) -> Any:
    model = _Mlp(broken)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 32, 16, generator=g), torch.randint(0, 4, (4, 32), generator=g)
    watcher = ScriptWatch(notify=None)
    with watcher:
        for step in range(4 // accumulate):
            for micro in range(accumulate):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x[step * accumulate + micro])
                loss = nn.functional.cross_entropy(out.float(), y[step * accumulate + micro]) / accumulate
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return watcher.report


def test_watch_finds_a_backward_that_departs_from_the_fp32_step():
    report = _watched(broken=True)
    (found,) = report.by_name("gradients-depart-from-reference")
    assert found.evidence["stage"] == "backward" and found.evidence["step"] == 1
    departed = {d["parameter"]: d["norm_ratio"] for d in found.evidence["departed"]}
    assert set(departed) == {"a.weight", "a.bias"}  # b's gradients do not pass through the function
    assert all(abs(r - 1 / 3) < 0.05 for r in departed.values())
    assert report.data["reference_step"]["compared_steps"] == [1]


def test_watch_says_what_it_compared_on_healthy_recipes():
    for clip, accumulate in ((None, 1), (0.01, 1), (None, 2)):  # plain, clipped hard, accumulated
        report = _watched(broken=False, clip=clip, accumulate=accumulate)
        assert report.by_name("gradients-depart-from-reference") == [], (clip, accumulate)
        judged = report.data["reference_step"]
        assert judged["compared_steps"] == [1] and judged["worst"]["cosine"] > 0.99
        (line,) = [text for key, text in report.data["summary"] if key == "reference step"]
        assert line.startswith("step 1 against an fp32 step") and "within 2x" in line
        # watch replays from the gradients at the outputs: what it compared is what the backward left (the
        # script's unscale_ and clip between the backward and the step are judged apart: TRN021, a clip's finding)
        assert "gradient(s) as the backward left them" in line, line
        assert "the gradients at step(s) 1 against an fp32 step" in report.data["judged"]


def test_watch_reference_every_zero_says_it_was_off(tmp_path):
    model = _Mlp(broken=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    watcher = ScriptWatch(notify=None, reference_every=0)
    with watcher:
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
    assert watcher.report.by_name("gradients-depart-from-reference") == []
    assert watcher.report.data["reference_step"]["off"] == "switched off (reference_every=0)"


def test_a_negative_reference_every_is_refused_in_one_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('never runs')\n")
    run = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "watch", "--reference-every", "-3", "--", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2 and "never runs" not in run.stdout
    assert run.stderr.strip().count("\n") == 0 and "--reference-every" in run.stderr


class _BrokenNet(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.net[0](x))
        return nn.functional.mse_loss(self.net[3](_Thrice.apply(h)).float(), y)


def test_the_lightning_callback_compares_its_first_step_with_the_reference():
    for module, departs in ((_BrokenNet(), True), (Net(), False)):
        callback = FpDoctorCallback()
        trainer([callback], max_steps=3, precision="bf16-mixed", gradient_clip_val=0.5).fit(module, data())
        found = callback.report.by_name("gradients-depart-from-reference")
        assert bool(found) == departs, type(module).__name__
        assert callback.report.data["reference_step"]["compared_steps"] == [1]
        if departs:
            assert {d["parameter"] for d in found[0].evidence["departed"]} == {"net.0.weight", "net.0.bias"}


# -- the update stages under watch: the optimizer's update on the step's own gradients ------------


def _watched_updates(model: nn.Module, optimizer: torch.optim.Optimizer, *, between: Any = None, steps: int = 3) -> Any:
    """fp32 (or the model's own dtype) training under watch; `between(step)` runs after each optimizer step."""
    g = torch.Generator().manual_seed(2)
    dtype = next(model.parameters()).dtype
    watcher = ScriptWatch(notify=None)
    with watcher:
        for step in range(steps):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # hard: clipping is the user's own processing
            optimizer.step()
            optimizer.zero_grad()
            if between is not None:
                between(step)
    return watcher.report


def test_watch_compares_the_update_stages_on_healthy_recipes_and_finds_nothing():
    for fused in (False, True):
        model = _Mlp(broken=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        before = [p.detach().clone() for p in model.parameters()]
        report = _watched_updates(model, optimizer)
        assert report.by_name("update-departs-from-reference") == [], str(report)
        assert report.by_name("gradients-depart-from-reference") == []
        assert "the optimizer's update and what the weights kept of it at step(s) 1" in report.data["judged"]
        assert "over fp32 copies of the weights and its state, on the step's own gradients" in report.data["judged"]
        # a plain run of the same steps leaves the same weights, bit for bit
        plain = _Mlp(broken=False)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=fused)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            nn.functional.cross_entropy(plain(x), y).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            plain_opt.step()
            plain_opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
        assert sys.getprofile() is None


def test_watch_finds_a_weight_decay_applied_again_between_steps_at_the_kept_stage():
    model = _Mlp(broken=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def decay_again(step: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)  # the line the finding names

    line = decay_again.__code__.co_firstlineno + 3
    report = _watched_updates(model, optimizer, between=decay_again)
    (found,) = report.by_name("update-departs-from-reference")
    assert found.evidence["stage"] == "kept" and found.evidence["step"] == 1, found.message
    (call,) = found.evidence["written_by"]
    assert call["call"] == "mul_" and call["line"] == line and call["file"] == __file__
    assert f"{__file__}:{line}" in found.message
    assert "your step's own gradients" in found.message
    assert sys.getprofile() is None


def test_watch_finds_bf16_weights_whose_updates_round_away_at_the_intended_stage():
    model = _Mlp(broken=False).bfloat16()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    report = _watched_updates(model, optimizer)
    # told once, as its mechanism (the update checks' TRN010), with the reference step's evidence and check
    assert report.by_name("update-departs-from-reference") == [], str(report)
    (found,) = report.by_name("update-rounded-away")
    reference = found.evidence["reference_step"]
    assert reference["stage"] == "intended" and reference["step"] == 1, found.message
    assert found.trial is not None and found.trial.tried and found.trial.after == 0, found.trial
    assert "fp32 copies" in found.trial.changed and "The reference step measures it" in found.message
    assert "master weights" in found.fix


# -- the update stages under the callbacks: where the gradients they see are the optimizer's -------


class _DecayAgain(Net):
    """The module decays its weights again after each batch (AdamW decays them already)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(0.9)  # the line the finding names


def test_the_lightning_callback_compares_the_update_stages_where_lightning_does_not_clip():
    callback = FpDoctorCallback()
    trainer([callback], max_steps=3).fit(Net(), data())
    assert callback.report.by_name("update-departs-from-reference") == [], str(callback.report)
    assert callback.report.data["reference_step"]["update_steps"] == [1]

    callback = FpDoctorCallback()
    trainer([callback], max_steps=3).fit(_DecayAgain(), data())
    (found,) = callback.report.by_name("update-departs-from-reference")
    assert found.evidence["stage"] == "kept", found.message
    line = _DecayAgain.on_train_batch_end.__code__.co_firstlineno + 3
    assert ("mul_", line) in {(c["call"], c["line"]) for c in found.evidence["written_by"]}

    callback = FpDoctorCallback()  # Lightning clips after the callback's hook: the backward alone
    trainer([callback], max_steps=3, gradient_clip_val=0.5).fit(_DecayAgain(), data())
    assert callback.report.by_name("update-departs-from-reference") == []
    assert callback.report.data["reference_step"]["update_steps"] == []


def test_the_hf_callback_compares_the_update_stages_after_the_trainers_clipping(tmp_path):
    from tests.integrations.hf import FpDoctorCallback as HfCallback
    from tests.integrations.hf import Tokens, arguments, tiny_gpt2, transformers

    def run(model: nn.Module, **kwargs: Any) -> Any:
        callback = HfCallback(reference_every=500)
        args = arguments(tmp_path, max_steps=3, max_grad_norm=0.5, **kwargs)
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
        return callback.report

    report = run(tiny_gpt2())
    assert report.by_name("update-departs-from-reference") == [], str(report)
    assert report.data["reference_step"]["update_steps"] == [1]
    # bf16 weights at a learning rate whose updates are under their spacing: told once, checked
    report = run(tiny_gpt2().bfloat16(), learning_rate=1e-6)
    found = report.by_name("update-rounded-away") or report.by_name("update-departs-from-reference")
    assert len(found) == 1, str(report)
    stage = found[0].evidence.get("reference_step", found[0].evidence).get("stage")
    assert stage == "intended", found[0].message
    assert found[0].trial is not None and found[0].trial.tried and found[0].trial.after == 0
