"""The Hugging Face callback in real `Trainer.train` runs on the CPU (a tiny GPT-2 from a config):
the NaN that `logging_nan_inf_filter` hides named, skips and verdicts, accumulation, clipping,
bf16 and fp16 (a CPU GradScaler), a loss computed outside the model."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from tests.integrations.common import logged, same
from tests.integrations.hf import (
    FpDoctorCallback,
    Tokens,
    Weights,
    arguments,
    poison_activation,
    poison_gradient,
    tiny_gpt2,
    transformers,
)

LOGGER = "transformers.fpdoctor"
C_FC = "transformer.h.0.mlp.c_fc.weight"


def _trainer(tmp_path, model, callbacks, **kwargs):
    trainer_class = kwargs.pop("trainer_class", transformers.Trainer)
    return trainer_class(model=model, args=arguments(tmp_path, **kwargs), train_dataset=Tokens(), callbacks=callbacks)


def _at(trainer_box: list, step: int, micro: int | None = None):
    """A condition that holds during optimizer step `step` (from 1), optionally only in micro-batch
    `micro` of it; the same during the step's replay, as a fault in the data would be."""
    seen: dict[int, int] = {}

    def when() -> bool:
        now = trainer_box[0].state.global_step + 1
        if micro is None:
            return now == step
        seen[now] = seen.get(now, 0) + 1
        return now == step and seen[now] == micro

    return when


def _train(tmp_path, *, fault=None, report_path=None, **kwargs):
    model = tiny_gpt2(dropout=kwargs.pop("dropout", 0.0))
    # a fault comes at a count of forwards, which the reference step's two extra ones would move
    every = kwargs.pop("reference_every", 0 if fault is not None else 500)
    callback = FpDoctorCallback(report_path=report_path, reference_every=every)
    weights = Weights()
    box: list = []
    if fault is not None:
        fault(model, box)
    trainer = _trainer(tmp_path, model, [callback, weights], **kwargs)
    box.append(trainer)
    trainer.train()
    return callback.report, weights, trainer


def test_a_clean_run_has_no_findings_and_says_one_line(tmp_path):
    path = tmp_path / "fpdoctor.json"
    with logged(LOGGER) as lines:
        report, _, _ = _train(tmp_path, report_path=str(path))
    assert report.findings == []
    assert report.data["steps"] == 6 and report.data["nonfinite_steps"] == 0 and report.data["last_good_step"] == 6
    assert all(math.isfinite(v) for v in report.data["timeline"]["loss"])
    assert lines == ["fpdoctor: 6 optimizer steps checked, 0 non-finite, 0 skipped (transformers)"]
    assert json.loads(path.read_text())["data"]["framework"] == "transformers"


def test_a_nan_loss_hidden_from_the_logs_is_named_skipped_and_replayed(tmp_path):
    with logged(LOGGER) as lines:
        report, weights, trainer = _train(tmp_path, fault=lambda model, box: poison_activation(model, _at(box, 3)))
    # what the Trainer logs: a finite loss at step 3 (logging_nan_inf_filter), and our count beside it
    entry = next(h for h in trainer.state.log_history if h.get("step") == 3 and "loss" in h)
    assert math.isfinite(entry["loss"]) and entry["nonfinite_steps"] == 1
    (loss,) = report.by_name("nonfinite-loss")
    assert loss.evidence["step"] == 3 and loss.evidence["kind"] == "nan"
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.evidence["step"] == 3
    # the replay's trace names the NaN written by the test's forward hook as the culprit, not the
    # backward matmul it reaches
    assert verdict.where["op"] == "aten.copy_.default" and "written into a tensor" in verdict.message
    assert report.by_name("nonfinite-produced") == []
    assert report.data["verdicts"] == {3: "deterministic-nonfinite"} and report.data["skipped_steps"] == 1
    assert same(weights.after[2], weights.after[3]) and not same(weights.after[3], weights.after[4])
    (warning,) = [line for line in lines if line.startswith("fpdoctor: step 3:")]
    assert "logging_nan_inf_filter" in warning


def test_a_fault_that_does_not_come_back_is_suspected_as_the_machine(tmp_path):
    forwards = {"n": 0}

    def third_forward() -> bool:
        forwards["n"] += 1
        return forwards["n"] == 3  # the run's third training forward only: the replay's is the fourth

    report, weights, _ = _train(tmp_path, fault=lambda model, box: poison_activation(model, third_forward))
    assert [f.evidence["step"] for f in report.by_name("nonfinite-loss")] == [3]
    (verdict,) = report.by_name("transient-fault-suspected")
    assert verdict.evidence["step"] == 3
    assert same(weights.after[2], weights.after[3])


def test_a_nonfinite_gradient_is_named_before_the_trainers_clipping_spreads_it(tmp_path):
    report, weights, _ = _train(
        tmp_path, fault=lambda model, box: poison_gradient(model, _at(box, 4), math.inf), max_grad_norm=1.0
    )
    (grad,) = report.by_name("nonfinite-gradient")
    # read at the end of the backward: only the parameter that held it, and its own kind
    assert grad.evidence["parameters"] == [C_FC] and grad.evidence["kind"] == "+inf"
    assert "spread" not in grad.evidence
    assert report.by_name("deterministic-nonfinite")
    assert same(weights.after[3], weights.after[4])


def _in_batch(model, box, step: int, micro: int):
    """A fault carried by the batch that step `step`, micro-batch `micro` trains on: wherever that
    batch goes (its replay included), the NaN goes with it."""
    first = _at(box, step, micro)
    seen: dict = {}

    def remember(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"]
        if module.training and torch.is_grad_enabled() and "key" not in seen and first():
            seen["key"] = kwargs["input_ids"].clone()

    model.register_forward_pre_hook(remember, with_kwargs=True)
    poison_activation(model, lambda: "key" in seen and torch.equal(seen["ids"], seen["key"]))


def test_gradient_accumulation_names_the_micro_batch(tmp_path):
    report, weights, _ = _train(
        tmp_path,
        fault=lambda model, box: _in_batch(model, box, 2, 2),
        gradient_accumulation_steps=2,
        max_steps=3,
    )
    (loss,) = report.by_name("nonfinite-loss")
    assert loss.evidence["step"] == 2 and loss.evidence["micro_batch"] == 2
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.evidence["micro_batch"] == 2
    assert report.data["micro_batches"] == 6
    assert same(weights.after[1], weights.after[2])
    losses = [v for v in report.data["timeline"]["loss"] if math.isfinite(v)]
    assert all(3.0 < v < 5.0 for v in losses)  # the step's loss as the Trainer logs it (~ln 64)


def test_bf16_autocast_runs_clean_and_names_a_nan_step(tmp_path):
    clean, _, _ = _train(tmp_path, bf16=True, max_steps=3)
    assert clean.findings == []
    report, weights, _ = _train(
        tmp_path, fault=lambda model, box: poison_activation(model, _at(box, 2)), bf16=True, max_steps=3
    )
    assert [f.evidence["step"] for f in report.by_name("nonfinite-loss")] == [2]
    assert report.by_name("deterministic-nonfinite")
    assert same(weights.after[1], weights.after[2])


class CpuGradScalerTrainer(transformers.Trainer):
    """The CPU twin of fp16 on a GPU: accelerate's own backward and optimizer wrapper with a
    torch.amp.GradScaler("cpu") (accelerate refuses fp16 on the CPU)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)


def test_an_fp16_overflow_is_an_amp_skip_not_a_fault(tmp_path):
    report, weights, trainer = _train(
        tmp_path,
        fault=lambda model, box: poison_gradient(model, _at(box, 3), math.inf),
        trainer_class=CpuGradScalerTrainer,
        max_grad_norm=0.0,
    )
    assert report.findings == []
    assert report.data["amp"]["skipped_steps"] == 1 and report.data["timeline"]["amp_skipped"] == [3]
    assert report.data["nonfinite_steps"] == 0
    assert same(weights.after[2], weights.after[3])  # the scaler skipped it
    assert trainer.accelerator.scaler.get_scale() == 2.0**11


def test_an_fp16_nan_loss_is_a_fault(tmp_path):
    report, weights, _ = _train(
        tmp_path,
        fault=lambda model, box: poison_activation(model, _at(box, 3)),
        trainer_class=CpuGradScalerTrainer,
        max_grad_norm=0.0,
    )
    assert [f.evidence["step"] for f in report.by_name("nonfinite-loss")] == [3]
    assert report.by_name("deterministic-nonfinite")
    assert report.data["amp"]["skipped_steps"] == 0
    assert same(weights.after[2], weights.after[3])


class OwnLoss(transformers.Trainer):
    """A loss computed outside the model's forward: the callback cannot see it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits) if return_outputs else loss


def test_a_loss_outside_the_model_is_replayed_from_the_gradients_at_its_outputs(tmp_path):
    report, weights, _ = _train(
        tmp_path, fault=lambda model, box: poison_activation(model, _at(box, 3)), trainer_class=OwnLoss
    )
    (grad,) = report.by_name("nonfinite-gradient")
    assert grad.evidence["step"] == 3
    # it never saw the loss: it does not say the loss was finite
    assert "the loss was finite" not in grad.message and "computed outside the model's forward" in grad.message
    # replayed as it ran: the model's forward, and the backward from the gradients at its outputs
    assert report.data["verdicts"] == {3: "deterministic-nonfinite"}
    (verdict,) = report.by_name("deterministic-nonfinite")
    assert verdict.where["module"].startswith("transformer.h.0.mlp")  # where the hook wrote the NaN
    assert same(weights.after[2], weights.after[3])


class SubmoduleLoss(transformers.Trainer):
    """A loss from the model's submodules called directly (the body, then the head), never its forward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        hidden = model.transformer(input_ids=inputs["input_ids"]).last_hidden_state
        logits = model.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits) if return_outputs else loss


def test_a_step_whose_loss_calls_the_submodules_is_not_replayed_and_never_blamed_on_the_machine(tmp_path):
    """No micro-batch went through the model's forward: the replay ran nothing, which read as a finite
    replay, and every bad step was transient-fault-suspected: 'suspect cpu, not the model'."""
    report, _, _ = _train(
        tmp_path, fault=lambda model, box: poison_activation(model, _at(box, 3)), trainer_class=SubmoduleLoss
    )
    assert not report.by_name("transient-fault-suspected"), [f.name for f in report.findings]
    (said,) = report.by_name("step-not-replayed")
    assert said.evidence["step"] == 3 and "fpdoctor trace" in said.fix


def test_training_under_the_callback_is_bitwise_training_without_it(tmp_path):
    def train(callbacks):
        model = tiny_gpt2(dropout=0.1)
        _trainer(tmp_path, model, callbacks, max_steps=4).train()
        return [p.detach().clone() for p in model.parameters()]

    assert same(train([]), train([FpDoctorCallback()]))


def test_the_hooks_leave_with_the_training(tmp_path):
    model = tiny_gpt2()
    callback = FpDoctorCallback()
    _trainer(tmp_path, model, [callback], max_steps=2).train()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert callback.report.data["steps"] == 2  # the report stays


def test_what_it_says_follows_transformers_verbosity(tmp_path):
    # under transformers' own logger: the user's verbosity applies (and its handler prints)
    assert logging.getLogger(LOGGER).parent is logging.getLogger("transformers")


def test_bad_settings_are_refused_when_the_callback_is_made(tmp_path):
    with pytest.raises(ValueError, match="replay must be True or False"):
        FpDoctorCallback(replay=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        FpDoctorCallback(str(tmp_path / "missing" / "r.json"))


def test_it_is_a_trainer_callback():
    assert isinstance(FpDoctorCallback(), transformers.TrainerCallback)
    assert FpDoctorCallback().report.data["steps"] == 0


FAILING_TRAIN = """
import sys
import transformers
from fpdoctor.integrations.hf import FpDoctorCallback
from tests.integrations.hf import Tokens, arguments, tiny_gpt2


class Boom(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise RuntimeError("the job failed at step 3")


model = tiny_gpt2()
callback = FpDoctorCallback(report_path=sys.argv[1])
args = arguments(__import__("pathlib").Path(sys.argv[2]))
trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback, Boom()])
trainer.train()
"""


def test_a_train_that_raises_still_writes_its_report_when_the_process_exits(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "fail.py"
    script.write_text(FAILING_TRAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "report.json"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=root,
        env=env,
    )
    assert run.returncode == 1 and "the job failed at step 3" in run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["data"]["steps"] == 3


def test_pure_bf16_weights_whose_updates_round_away_are_named(tmp_path):
    model = tiny_gpt2().to(torch.bfloat16)
    callback = FpDoctorCallback()
    _trainer(tmp_path, model, [callback], max_steps=12, learning_rate=1e-5, max_grad_norm=0.0).train()
    (found,) = callback.report.by_name("update-rounded-away")
    assert found.evidence["dtype"] == "bfloat16"
    assert any(p["rounded_share"] > 0.5 for p in found.evidence["parameters"])
    tried = found.evidence["what_if"]  # the fix tried on copies, as the sentinel tries it
    assert tried["tried"] and tried["steps"] == 8 and tried["moved_fp32_master"] > tried["moved_as_is"], tried
    assert "Tried: with fp32 master weights" in found.message
    # the Trainer steps the optimizer: its own switch comes first, and as printed it is no such finding
    assert found.fix.startswith("1. in the Trainer: the model loaded in fp32") and "bf16=True" in found.fix
    callback = FpDoctorCallback()
    _trainer(tmp_path, tiny_gpt2(), [callback], max_steps=12, learning_rate=1e-5, max_grad_norm=0.0, bf16=True).train()
    assert not callback.report.by_name("update-rounded-away"), callback.report.findings


def test_a_replayed_inf_loss_names_the_users_line_not_the_trainers(tmp_path):
    def fault(model, box):
        def hook(module, args, output):  # the user's own code writes the +inf, at step 3
            if module.training and torch.is_grad_enabled() and box and box[0].state.global_step + 1 == 3:
                output = output.clone()
                output[0, 0, 0] = float("inf")
                return output
            return None

        model.lm_head.register_forward_hook(hook)

    report, _, _ = _train(tmp_path, fault=fault)
    (verdict,) = report.by_name("deterministic-nonfinite")
    location = verdict.evidence["location"]
    assert "test_hf.py" in location and "in hook" in location
    assert "trainer_callback.py" not in verdict.message + location


def test_after_a_train_that_raised_the_next_forward_takes_the_hooks_off_and_writes_the_report(tmp_path):
    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("the job failed at step 2")

    model = tiny_gpt2()
    callback = FpDoctorCallback(report_path=str(tmp_path / "report.json"))
    trainer = _trainer(tmp_path, model, [callback, Boom()])
    with pytest.raises(RuntimeError, match="failed at step 2"):
        trainer.train()
    assert model._forward_hooks and model._forward_pre_hooks  # the Trainer said nothing: still on
    model.train()
    model(torch.randint(0, 64, (1, 12)))  # the user goes on with the model, outside any training
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert json.loads((tmp_path / "report.json").read_text())["data"]["steps"] == 2


class Readings(torch.utils.data.Dataset):
    """Sea-level pressure near 1013 hPa that varies by about 2, from six predictors."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(6, generator=torch.Generator().manual_seed(i))
        return {"x": x, "y": 1013.25 + 2.0 * torch.tanh(x[:1] - x[1:2])}


class Barometer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        with torch.no_grad():
            self.net[-1].bias.fill_(1013.25)
        self.half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.half())


class RegressionLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(inputs["x"]).float()
        loss = torch.nn.functional.mse_loss(out, inputs["y"])
        return (loss, out) if return_outputs else loss


def test_a_regression_output_too_coarse_for_fp16_is_named_by_the_callback(tmp_path):
    """The Trainer computes the loss outside the model, so the callback replays from the gradients at
    the model's output, which cannot show what rounding that output costs: read from the output itself."""
    callback = FpDoctorCallback()
    args = arguments(
        tmp_path, max_steps=20, per_device_train_batch_size=32, learning_rate=1e-4, optim="sgd",
        remove_unused_columns=False,
    )  # fmt: skip
    trainer = RegressionLoss(model=Barometer(), args=args, train_dataset=Readings(), callbacks=[callback])
    trainer.train()
    (found,) = callback.report.by_name("output-too-coarse-in-training")
    assert found.evidence["dtype"] == "float16" and found.evidence["share_of_spread"] >= 0.05
