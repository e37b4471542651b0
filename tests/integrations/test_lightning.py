"""The Lightning callback in real `Trainer.fit` runs on the CPU: the sentinel's findings, skips and
verdicts, under gradient accumulation, clipping, bf16 and fp16 (a CPU GradScaler), fused optimizers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.integrations.lit import NAN, FpDoctorCallback, Net, Weights, data, logged, pl, same, trainer

LOGGER = "lightning.pytorch.fpdoctor"


def _fit(module: Net, max_steps: int = 8, *, report_path: str | None = None, **kwargs):
    callback = FpDoctorCallback(report_path=report_path)
    weights = Weights()
    run = trainer([callback, weights], max_steps=max_steps, **kwargs)
    run.fit(module, data())
    return callback, weights, callback.report


def _names(report) -> list[str]:
    return [f.name for f in report.findings]


def test_a_clean_run_has_no_findings_and_says_one_line(tmp_path):
    path = tmp_path / "fpdoctor.json"
    with logged(LOGGER) as lines:
        _, _, report = _fit(Net(), report_path=str(path))
    assert report.findings == []
    assert report.data["steps"] == 8 and report.data["nonfinite_steps"] == 0 and report.data["skipped_steps"] == 0
    assert report.data["last_good_step"] == 8
    assert len(report.data["timeline"]["loss"]) == 8 and all(math.isfinite(v) for v in report.data["timeline"]["loss"])
    assert lines == ["fpdoctor: 8 optimizer steps checked, 0 non-finite, 0 skipped (lightning)"]
    written = json.loads(path.read_text())
    assert written["command"] == "sentinel" and written["verdict"] == "ok" and written["data"]["steps"] == 8


def test_a_nan_loss_at_step_k_is_named_skipped_and_replayed():
    with logged(LOGGER) as lines:
        _, weights, report = _fit(Net(nan_data=(3, 1)))
    loss = report.by_name("nonfinite-loss")
    assert [f.evidence["step"] for f in loss] == [3] and loss[0].evidence["kind"] == "nan"
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.evidence["step"] == 3
    assert "lit.py" in verdict.evidence["location"] and verdict.where["phase"] == "forward"
    assert report.data["verdicts"] == {3: "deterministic-nonfinite"}
    assert report.data["nonfinite_steps"] == 1 and report.data["skipped_steps"] == 1
    assert same(weights.before[3], weights.before[4])  # step 3 changed nothing
    assert not same(weights.before[2], weights.before[3])
    assert 3 in report.data["timeline"]["nonfinite"]
    assert any(line.startswith("fpdoctor: step 3: nonfinite-loss") for line in lines)


def test_a_transient_nonfinite_gradient_is_skipped_and_suspected_as_a_fault():
    _, weights, report = _fit(Net(bad_grad=(4, NAN)))
    (grad,) = report.by_name("nonfinite-gradient")
    assert grad.evidence["step"] == 4 and grad.evidence["kind"] == "nan"
    assert grad.evidence["parameters"] == ["net.0.weight"]  # seen before clipping or anything else
    (verdict,) = report.by_name("transient-fault-suspected")
    assert verdict.evidence["step"] == 4
    assert same(weights.before[4], weights.before[5])
    assert report.data["skipped_steps"] == 1 and report.data["last_good_step"] == 8


@pytest.mark.parametrize("kind", ["foreach", "fused", "sgd"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(kind):
    module = Net(bad_grad=(2, math.inf), optimizer=kind)
    _, weights, report = _fit(module, max_steps=4)
    assert [f.evidence["kind"] for f in report.by_name("nonfinite-gradient")] == ["+inf"]
    assert same(weights.before[2], weights.before[3])
    optimizer = module.trainer.optimizers[0]
    if kind != "sgd":
        steps = {float(s["step"]) for s in optimizer.state.values()}
        assert steps == {3.0}  # four steps, one skipped: Adam's step count never saw it


def test_gradient_accumulation_names_the_micro_batch():
    _, weights, report = _fit(Net(nan_data=(2, 3)), max_steps=4, accumulate_grad_batches=3)
    (loss,) = report.by_name("nonfinite-loss")
    assert loss.evidence["step"] == 2 and loss.evidence["micro_batch"] == 3
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.evidence["micro_batch"] == 3
    assert report.data["micro_batches"] == 12 and report.data["steps"] == 4
    # the mean of the micro-batches' own losses, not Lightning's loss divided by 3
    finite = [v for v in report.data["timeline"]["loss"] if math.isfinite(v)]
    assert all(v > 0.3 for v in finite)
    assert same(weights.before[2], weights.before[3])


def test_with_gradient_clipping_the_bad_parameter_is_still_the_one_named():
    _, weights, report = _fit(Net(bad_grad=(3, NAN)), gradient_clip_val=0.5)
    (grad,) = report.by_name("nonfinite-gradient")
    assert grad.evidence["parameters"] == ["net.0.weight"] and "spread" not in grad.evidence
    assert same(weights.before[3], weights.before[4])
    assert report.data["skipped_steps"] == 1


def test_bf16_autocast_runs_clean_and_names_a_nan_step():
    _, _, clean = _fit(Net(), max_steps=4, precision="bf16-mixed")
    assert clean.findings == []
    _, weights, report = _fit(Net(nan_data=(2, 1)), max_steps=4, precision="bf16-mixed")
    assert [f.evidence["step"] for f in report.by_name("nonfinite-loss")] == [2]
    assert report.by_name("deterministic-nonfinite")
    assert same(weights.before[2], weights.before[3])


def _fp16(init_scale: float = 2.0**12):
    from lightning.pytorch.plugins.precision import MixedPrecision

    # fp16 autocast and a GradScaler on the CPU: the CPU twin of "16-mixed" on a GPU
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


@pytest.mark.parametrize("kind", ["adamw", "fused"])
def test_an_fp16_overflow_is_an_amp_skip_not_a_fault(kind):
    # fused: Lightning leaves the unscaling to the optimizer, so the callback sees scaled gradients
    plugin = _fp16()
    _, weights, report = _fit(Net(scale_data=(3, 1000.0), optimizer=kind), max_steps=6, plugins=[plugin])
    # the scaler's business: no NaN finding, no replay; the batch scaled 1000x is a loss spike
    assert [f.name for f in report.findings] == ["loss-spike"]
    amp = report.data["amp"]
    assert amp["skipped_steps"] == 1 and amp["skip_rate"] == pytest.approx(1 / 6)
    assert report.data["nonfinite_steps"] == 0 and report.data["timeline"]["amp_skipped"] == [3]
    assert same(weights.before[3], weights.before[4])  # skipped by the scaler
    assert plugin.scaler.get_scale() == 2.0**11


@pytest.mark.parametrize("kind", ["adamw", "fused"])
def test_an_fp16_nan_loss_is_a_fault_and_the_loss_curve_is_unscaled(kind):
    _, weights, report = _fit(Net(nan_data=(3, 1), optimizer=kind), max_steps=5, plugins=[_fp16()])
    assert [f.evidence["step"] for f in report.by_name("nonfinite-loss")] == [3]
    assert report.by_name("deterministic-nonfinite")
    assert report.data["amp"]["skipped_steps"] == 0
    finite = [v for v in report.data["timeline"]["loss"] if math.isfinite(v)]
    assert finite and max(finite) < 10  # divided by the scale (4096) again
    assert same(weights.before[3], weights.before[4])


def test_a_collapsing_fp16_scale_is_reported_with_the_op_that_overflows():
    # every step overflows: scale 4 -> 2 -> 1 -> 0.5, below 1 after the third skip in a row
    class Overflowing(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x * 1000).float(), y)

    _, _, report = _fit(Overflowing(), max_steps=4, plugins=[_fp16(4.0)])
    (collapse,) = report.by_name("amp-scale-collapse")
    assert collapse.evidence["step"] == 3 and collapse.evidence["scale"] == 0.5
    assert report.data["amp"]["skipped_steps"] >= 3 and report.data["nonfinite_steps"] == 0
    (culprit,) = [f for f in report.findings if f.name in ("deterministic-nonfinite", "nonfinite-produced")]
    assert culprit.where["phase"] == "backward"  # the replay names the op whose fp16 gradient overflows


def test_batch_norm_statistics_of_a_skipped_step_are_put_back():
    module = Net(nan_data=(3, 1), batch_norm=True)
    stats: dict[int, torch.Tensor] = {}

    class Stats(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            stats[trainer.global_step + 1] = pl_module.net[1].running_mean.clone()

    run = trainer([FpDoctorCallback(), Stats()], max_steps=5)
    run.fit(module, data())
    assert torch.isfinite(module.net[1].running_mean).all()
    assert torch.equal(stats[3], stats[4])  # the NaN batch's statistics were undone


def test_training_under_the_callback_is_bitwise_training_without_it():
    def fit(callbacks):
        module = Net(dropout=0.3)
        torch.manual_seed(123)
        trainer(callbacks, max_steps=6).fit(module, data())
        return [p.detach().clone() for p in module.parameters()]

    assert same(fit([]), fit([FpDoctorCallback()]))


def test_the_reference_and_replays_leave_the_modules_own_state_as_training_set_it():
    """A training_step that keeps its own state on the module: a running loss made from the first loss
    (bf16 under bf16-mixed), a list of the step's losses. The callback's fp32 reference step at step 1
    ran training_step first, so the running loss was made in fp32 and the bug it holds in bf16 was gone
    under the callback; the replay of a bad step appended to the list."""

    class Stateful(Net):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.loss_ema = None
            self.seen: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            level = self.net[0](batch[0]).detach().mean()  # bf16 under bf16-mixed's autocast, fp32 without
            self.loss_ema = level if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * level
            self.seen.append(float(loss))
            return loss

    def fit(callbacks, **kwargs):
        module = Stateful(**kwargs)
        torch.manual_seed(123)
        trainer(callbacks, max_steps=6, precision="bf16-mixed").fit(module, data())
        return module

    plain, watched = fit([]), fit([FpDoctorCallback()])  # the reference step at step 1 ran training_step
    assert watched.loss_ema.dtype == plain.loss_ema.dtype == torch.bfloat16
    assert torch.equal(watched.loss_ema, plain.loss_ema)
    callback = FpDoctorCallback()
    replayed = fit([callback], nan_data=(3, 1))  # step 3 replayed: training_step ran again
    assert callback.report.data["verdicts"] == {3: "deterministic-nonfinite"}
    assert len(replayed.seen) == 6


def test_the_replay_leaves_the_run_as_a_plain_skip_would():
    """A bad step replayed (its RNG draws, buffer writes and gradients undone) and skipped ends
    where a plain skip without any replay ends, bit for bit - dropout draws included."""

    class PlainSkip(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step + 1 == 3:
                for p in pl_module.parameters():
                    p.grad = None

    def fit(callback):
        module = Net(nan_data=(3, 1), dropout=0.3)
        torch.manual_seed(123)
        trainer([callback], max_steps=6).fit(module, data())
        return [p.detach().clone() for p in module.parameters()]

    callback = FpDoctorCallback()
    assert same(fit(PlainSkip()), fit(callback))
    assert callback.report.data["verdicts"] == {3: "deterministic-nonfinite"}


def test_the_replay_does_not_log():
    class Counting(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("seen", float(self.trainer.global_step), reduce_fx="sum", on_step=False, on_epoch=True)
            return loss

    module = Counting(nan_data=(2, 1))
    callback = FpDoctorCallback()
    trainer([callback], max_steps=4).fit(module, data(n=32))  # one epoch of four steps
    assert callback.report.by_name("deterministic-nonfinite")
    # 0 + 1 + 2 + 3, one per training_step the Trainer ran; the replay's call added nothing
    assert float(module.trainer.callback_metrics["seen"]) == 6.0


def test_manual_optimization_is_checked_and_skipped_but_not_replayed():
    class Manual(Net):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    module = Manual(nan_data=(2, 1))
    callback = FpDoctorCallback()
    weights = Weights()
    trainer([callback, weights], max_steps=4).fit(module, data())
    report = callback.report
    (loss,) = report.by_name("nonfinite-loss")
    assert loss.evidence["replay"].startswith("not replayed: manual optimization")
    assert report.data["verdicts"] == {2: "not-replayed"} and not report.by_name("deterministic-nonfinite")
    assert same(weights.before[2], weights.before[3])


def test_replay_false_reports_and_skips_only():
    callback = FpDoctorCallback(replay=False)
    weights = Weights()
    trainer([callback, weights], max_steps=4).fit(Net(nan_data=(2, 1)), data())
    assert _names(callback.report) == ["nonfinite-loss"]
    assert same(weights.before[2], weights.before[3])


def test_an_exception_in_training_still_writes_the_report(tmp_path):
    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                raise RuntimeError("the user's own error")
            return super().training_step(batch, batch_idx)

    path = tmp_path / "r.md"
    run = trainer([FpDoctorCallback(report_path=str(path))], max_steps=8)
    with pytest.raises(RuntimeError, match="the user's own error"):
        run.fit(Failing(nan_data=(2, 1)), data())
    text = path.read_text()
    assert "nonfinite-loss" in text and "Step 2" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"replay": "yes"}, "replay must be True or False"), ({"report_path": "/no/such/dir/r.json"}, "does not exist")],
)
def test_bad_settings_are_refused_when_the_callback_is_made(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        FpDoctorCallback(**kwargs)
    with pytest.raises(ValueError, match="is a directory"):
        FpDoctorCallback(report_path=str(tmp_path))


def test_the_callback_report_is_empty_before_fit():
    report = FpDoctorCallback().report
    assert report.findings == [] and report.data["steps"] == 0


def test_it_is_a_lightning_callback():
    assert isinstance(FpDoctorCallback(), pl.Callback)


def test_a_failure_of_the_callbacks_own_never_stops_training(monkeypatch):
    from fpdoctor.integrations import _watch

    def broken(*args, **kwargs):
        raise RuntimeError("the check broke")

    monkeypatch.setattr(_watch, "nonfinite_flag", broken)
    _, weights, report = _fit(Net(), max_steps=4)
    (error,) = report.by_name("sentinel-error")
    assert "the check broke" in error.message
    assert report.data["steps"] == 4
    assert not same(weights.before[3], weights.before[4])  # the steps went on, unguarded


def test_pure_bf16_weights_whose_updates_round_away_are_named():
    module = Net(optimizer="adamw")
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=1e-5)  # a typical fp32 lr
    callback = FpDoctorCallback()
    trainer(callbacks=[callback], max_steps=12, precision="bf16-true").fit(module, data())
    (found,) = callback.report.by_name("update-rounded-away")
    assert found.evidence["dtype"] == "bfloat16"
    assert any(p["rounded_share"] > 0.5 for p in found.evidence["parameters"])
    tried = found.evidence["what_if"]  # the fix tried on copies, as the sentinel tries it
    assert tried["tried"] and tried["steps"] == 8 and tried["moved_fp32_master"] > tried["moved_as_is"], tried
    assert "Tried: with fp32 master weights" in found.message
    # Lightning steps the optimizer: its own switch comes first, and as printed it is no such finding
    assert found.fix.startswith("1. in Lightning: the module in fp32") and 'precision="bf16-mixed"' in found.fix
    fixed, callback = Net(optimizer="adamw"), FpDoctorCallback()
    fixed.configure_optimizers = lambda: torch.optim.AdamW(fixed.parameters(), lr=1e-5)
    trainer(callbacks=[callback], max_steps=12, precision="bf16-mixed").fit(fixed, data())
    assert not callback.report.by_name("update-rounded-away"), callback.report.findings


def test_a_compiled_module_s_graph_check_comes_off_when_training_ends():
    """Dynamo's class is patched while the callback watches compiled graphs, and put back after fit."""
    from torch._dynamo.output_graph import OutputGraph

    module = Net()
    module.net = torch.compile(module.net, backend="eager")
    callback = FpDoctorCallback()
    seen: list[str] = []

    class During(pl.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            seen.append(OutputGraph.call_user_compiler.__module__)

    trainer([callback, During()], max_steps=2).fit(module, data())
    assert callback.report.findings == []
    assert seen and all("fpdoctor" in m for m in seen)
    assert "fpdoctor" not in OutputGraph.call_user_compiler.__module__


class _Scheduled(Net):
    """AdamW with a linear decay to 0 over `decay` steps, stepped by Lightning after every optimizer step."""

    def __init__(self, decay: int) -> None:
        super().__init__()
        self.decay = decay

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / self.decay))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_schedule_that_ends_early_is_named_by_the_callback_and_one_sized_to_the_run_is_not():
    """A decay sized in epochs (5) and stepped per optimizer step holds every weight still from step 5 of
    60 (the callback said OK: the recipe's checks ran under `watch` only); sized to the run's 60 steps the
    rate reaches 0 at the last step, and nothing is said."""
    _, _, report = _fit(_Scheduled(decay=5), max_steps=60)
    (found,) = [f for f in report.findings if f.name == "lr-zero-group"]
    assert found.evidence["zero_since"] == 6 and found.evidence["steps"] == 60, found.evidence
    assert found.evidence["scheduler"] == "LambdaLR" and "estimated_stepping_batches" in found.fix
    _, _, report = _fit(_Scheduled(decay=60), max_steps=60)
    assert "lr-zero-group" not in _names(report), _names(report)


def test_the_frameworks_own_switch_follows_the_weights_format():
    """fp16 weights (precision="16-true", a T4 without bf16) get the fp16 switch, not bf16's."""
    from fpdoctor.numerics.updates.findings import framework_switch

    half = framework_switch("lightning", "float16")
    assert half is not None and 'precision="16-mixed"' in half and "bf16" not in half, half
    trainer_half = framework_switch("transformers", "float16")
    assert trainer_half is not None and "fp16=True" in trainer_half and "bf16" not in trainer_half
    assert 'precision="bf16-mixed"' in (framework_switch("lightning", "bfloat16") or "")
    assert framework_switch(None, "bfloat16") is None
