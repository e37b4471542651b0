"""A printed fix is the fix that was tried, and applied as printed it works (SPEC 3.2, section 4).

Each class is run on models the shared cases do not contain: a GradScaler run whose step_fn never
zeroes the gradients (the replay must run the step as it ran, with what .grad held), an eps that
rounds to 0 in fp16 behind a norm's backward (the fix names the literal and a value that was tried),
and a custom op that makes an Inf its inputs cannot explain (no arithmetic advice, no "the math")."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
from torch import nn

import fpdoctor
from tests.conftest import run_fpdoctor


def _names(report: fpdoctor.Report) -> list[str]:
    return [f.name for f in report.sorted_findings()]


# -- a replay that runs the step as it ran: gradients carried from a skipped step ---------------
class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).logsumexp(-1).mean()


def _train_under_sentinel(zero_grads: bool, steps: int = 24) -> tuple[fpdoctor.Sentinel, list[float]]:
    torch.manual_seed(3)
    model = _Scorer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")  # init_scale 2**16: the first backward overflows fp16
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)
    x = torch.randn(16, 32)
    losses = []

    def step(batch: torch.Tensor) -> torch.Tensor:
        if zero_grads:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch).float()
        scaler.scale(loss).backward()
        return loss

    for _ in range(steps):
        losses.append(float(guard.step(step, x).detach()))
    return guard, losses


def test_gradients_left_in_grad_by_a_skipped_step_are_the_codes_fault_and_zeroing_them_works():
    guard, losses = _train_under_sentinel(zero_grads=False)
    report = guard.report
    first = report.sorted_findings()[0]
    assert first.name == "deterministic-nonfinite" and "never zeroes the gradients" in first.title
    assert first.evidence["carried_from_step"] == 1 and first.evidence["carried_from_scale"] == 65536.0
    assert "transient-fault-suspected" not in _names(report)  # never "suspect the machine" for the code's fault
    assert "optimizer.zero_grad(set_to_none=True)" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after == "finite"
    assert len(set(losses)) == 1  # as it was: the optimizer never ran

    # the fix as printed: zero the gradients at the start of step_fn
    fixed, losses = _train_under_sentinel(zero_grads=True)
    assert fixed.report.verdict == "ok", str(fixed.report)
    assert losses[-1] < losses[0]


# -- a constant that rounds to zero in fp16, behind a backward --------------------------------
class _Pooler(nn.Module):
    """Mean-pools token embeddings and L2-normalises them by hand; padding rows are all zero."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(24, 24)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(tokens)
        h = h * mask[..., None].type_as(h)
        norm = torch.sqrt(h.pow(2).sum(-1) + self.eps)  # the padding rows: sqrt(0 + eps)
        return (norm - 1.0).pow(2).mean()


def _pool_training(eps: float, *, traced: bool, steps: int = 12) -> tuple[fpdoctor.Report | None, list[float]]:
    torch.manual_seed(5)
    model = _Pooler(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    tokens = torch.randn(4, 10, 24)
    mask = torch.ones(4, 10)
    mask[:, 7:] = 0  # padding
    losses = []
    trace = fpdoctor.trace(model) if traced else None
    with trace if trace is not None else contextlib.nullcontext():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(tokens, mask).float()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return (trace.report if trace is not None else None), losses


def test_an_eps_that_fp16_rounds_to_zero_is_named_with_a_tried_replacement_that_trains():
    report, losses = _pool_training(1e-10, traced=True)
    assert report is not None
    first = report.sorted_findings()[0]
    assert first.name == "grad-scaler-stalled", str(report)
    assert first.fix.startswith("Replace the constant 1e-10 at ") and "(it is 0 in float16)" in first.fix
    assert "clamp_min(0) + torch.finfo" not in first.fix  # "add eps" with the user's own eps is no fix
    assert first.trial is not None and first.trial.tried and "replaced by" in first.trial.changed
    assert len(set(losses)) == 1  # nothing trained

    value = float(re.search(r"with ([0-9.e+-]+), which float16 holds", first.fix).group(1))
    _, fixed = _pool_training(value, traced=False, steps=40)  # the fix as printed
    assert fixed[-1] < 0.5 * fixed[0]


# -- a mask constant past fp16's range: its nearest value fp16 holds, not a small one ----------
class _Policy(nn.Module):
    """Action logits with the invalid actions masked by a large negative constant, written for fp32."""

    def __init__(self, fill: float | None) -> None:
        super().__init__()
        self.fill = fill  # None: torch.finfo(logits.dtype).min, as the fix prints it
        self.body = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 6))

    def forward(self, state: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        logits = self.body(state)
        fill = torch.finfo(logits.dtype).min if self.fill is None else self.fill
        return torch.log_softmax(logits + (1 - valid.to(logits.dtype)) * fill, -1)


def _policy_training(fill: float | None, *, traced: bool) -> tuple[fpdoctor.Report | None, list[float], float]:
    """Losses of a policy-gradient-like objective in fp16 autocast, one state with no valid action
    per batch; and the probability the trained policy puts on invalid actions where some are valid."""
    torch.manual_seed(2)
    model = _Policy(fill)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state, valid = torch.randn(16, 12), (torch.rand(16, 6) > 0.4).float()
    valid[3] = 0  # a terminal state: no action is valid
    losses = []
    trace = fpdoctor.trace(model) if traced else None
    with trace if trace is not None else contextlib.nullcontext():
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                logp = model(state, valid)
                loss = -(logp.float().exp() * valid).sum(-1).mean()  # the mass on valid actions, raised
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        probs = model(state, valid).float().exp()
    some = valid.sum(-1) > 0
    return (trace.report if trace is not None else None), losses, float((probs * (1 - valid))[some].sum(-1).max())


def test_a_mask_constant_past_fp16s_range_is_replaced_by_the_formats_limit_and_still_masks():
    """A mask fill written for fp32 (-1e9) is -inf in fp16: a state with no valid action is all -inf,
    and its log_softmax NaN. The fix was the constant replaced by fp16's smallest normal (6.1e-05):
    finite, and every invalid action unmasked. The constant's nearest value fp16 holds is its limit:
    torch.finfo(x.dtype).min, which applied as printed trains and keeps the invalid actions masked."""
    report, losses, _ = _policy_training(-1e9, traced=True)
    assert report is not None and all(math.isnan(v) for v in losses)
    first = report.sorted_findings()[0]
    assert first.fix.startswith("Replace the constant -1e+09 at "), first.fix
    assert "with torch.finfo(logits.dtype).min (-65504 in float16)" in first.fix, first.fix
    _, fixed, leaked = _policy_training(None, traced=False)  # the fix as printed
    assert all(math.isfinite(v) for v in fixed) and fixed[-1] < fixed[0]
    assert leaked < 1e-3  # the invalid actions stay masked


# -- a custom op that makes an Inf its inputs cannot explain ----------------------------------
@torch.library.custom_op("fpdoctor_tests::fused_bias_gelu", mutates_args=())
def _fused_bias_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A fused GEMM + bias + GELU epilogue whose kernel writes Inf for rows with a large input."""
    out = torch.nn.functional.gelu(x @ w.t() + b)
    out[x.abs().amax(-1) > 3.0] = float("inf")
    return out


@_fused_bias_gelu.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_fused_bias_gelu(x, self.fc1.weight, self.fc1.bias)).squeeze(-1)


def test_an_inf_from_a_custom_op_gets_no_arithmetic_advice_and_ops_after_it_point_back():
    torch.manual_seed(0)
    model = _Fused()
    x = torch.rand(8, 16) * 7.2 - 3.9  # in [-3.9, 3.3]
    with fpdoctor.trace(model) as t:
        model(x).logsumexp(0)
    assert t.report is not None
    first, *rest = t.report.by_name("nonfinite-produced")
    assert first.where["op"] == "fpdoctor_tests.fused_bias_gelu.default"
    assert "custom op" in first.title and "epsilon" not in first.fix.replace("Not an epsilon", "")
    assert first.evidence["experiment"]["verdict"] == "opaque" and not first.trial.tried
    for later in rest:  # made from the Inf it was handed: the fix is upstream, not a guard here
        if later.title.split(": ", 1)[1].find(" turned ") > 0:
            assert later.fix.startswith("Fix what made its input non-finite")


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_a_nan_beside_a_passed_on_inf_is_cured_when_the_nan_is_gone(kind: str):
    """0/0 on the diagonal beside an Inf the op was handed: the experiment judges the NaN it made."""
    from fpdoctor.numerics.engine.reruns import Experiment

    experiment = Experiment("aten.div.Tensor", "float16", "origin", symptom=frozenset({kind}), handed=True)
    assert experiment.clean == ("free of NaN" if kind == "nan" else "free of Inf")
    experiment.handed = False  # nothing non-finite came in: cured means finite
    assert experiment.clean == "finite"


# -- a consequence after its cause ------------------------------------------------------------
class _Buggy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.fc(x)
        if step == 6:
            h = h / (h - h)  # a bug on one batch: divides by zero
        return self.out(torch.relu(h)).mean()


def test_an_update_handed_nan_gradients_is_a_consequence_not_a_learning_rate_to_lower():
    torch.manual_seed(0)
    model = _Buggy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for step in range(1, 9):
            opt.zero_grad()
            model(torch.randn(16, 8), step).backward()
            opt.step()
    assert t.report is not None
    ordered = t.report.sorted_findings()
    assert ordered[0].name == "nonfinite-produced" and ordered[0].where["op"] == "aten.div.Tensor"
    (blown,) = t.report.by_name("update-blew-up")
    assert blown.evidence["consequence_of_step"] == 6 and blown.severity.value == "warning"
    assert "lower the learning rate" not in blown.fix.lower() and "does not change" in blown.fix
    assert "made the largest weight NaN" in blown.message and "by Inf" not in blown.message, blown.message


# -- when the origin is the data, which data --------------------------------------------------
def test_a_nan_made_in_some_rows_of_the_batch_names_those_rows_and_what_differs_in_them():
    torch.manual_seed(0)
    emb = torch.randn(8, 16)
    emb[[2, 5]] = 0.0  # two empty rows: a padded sample
    with fpdoctor.trace() as t:
        (emb / emb.norm(dim=-1, keepdim=True)).sum()
    assert t.report is not None
    (first,) = t.report.by_name("nonfinite-produced")
    rows = first.evidence["experiment"]["rows"]
    assert rows["indices"] == [2, 5] and rows["of"] == 8
    assert "all zero" in rows["differs"] and "rows 2, 5 of the 8" in first.message


# -- one verdict, whichever front end ran it ---------------------------------------------------
POOL_SCRIPT = """
import torch
from torch import nn


class Pooler(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(24, 24)

    def forward(self, tokens, mask):
        h = self.proj(tokens)
        h = h * mask[..., None].type_as(h)
        norm = torch.sqrt(h.pow(2).sum(-1) + 1e-10)
        return (norm - 1.0).pow(2).mean()


torch.manual_seed(5)
model = Pooler()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
tokens, mask = torch.randn(4, 10, 24), torch.ones(4, 10)
mask[:, 7:] = 0
for _ in range(30):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens, mask).float()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_trace_the_sentinel_and_watch_print_the_same_checked_constant(tmp_path):
    import json
    import os
    from pathlib import Path

    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    line = next(i for i, text in enumerate(POOL_SCRIPT.splitlines(), start=1) if "1e-10" in text)
    expected = f"Replace the constant 1e-10 at {script}:{line} (it is 0 in float16) with 6.10352e-05"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for command in ("trace", "watch"):
        out = tmp_path / f"{command}.json"
        run_fpdoctor(command, "-o", str(out), "--", str(script), timeout=240, cwd=tmp_path, env=env)
        first = json.loads(out.read_text())["findings"][0]
        assert first["fix"].startswith(expected), (command, first)
        assert first["fix_trial"]["status"] == "checked", (command, first)

    # the Sentinel, on the same model in-process
    report, _ = _sentinel_pool_run()
    first = report.sorted_findings()[0]
    assert first.fix.startswith("Replace the constant 1e-10 at ") and first.trial is not None and first.trial.tried


def _sentinel_pool_run() -> tuple[fpdoctor.Report, list[float]]:
    torch.manual_seed(5)
    model = _Pooler(1e-10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)
    tokens, mask = torch.randn(4, 10, 24), torch.ones(4, 10)
    mask[:, 7:] = 0

    def step(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(tokens, mask).float()
        scaler.scale(loss).backward()
        return loss

    losses = [float(guard.step(step, tokens, mask).detach()) for _ in range(30)]
    return guard.report, losses


@torch.library.custom_op("fpdoctor_tests::scale_in_place", mutates_args=("x",))
def _scale_in_place(x: torch.Tensor, factor: float) -> None:
    """An in-place fused kernel whose bug writes Inf: it cannot be re-run on what it read."""
    x.mul_(factor)
    x[0, 0] = float("inf")


def test_a_custom_op_that_cannot_be_re_run_says_so_and_gives_no_arithmetic_advice():
    x = torch.rand(4, 8)
    with fpdoctor.trace() as t:
        _scale_in_place(x, 0.5)
        x.sum()
    assert t.report is not None
    found = [f for f in t.report.findings if f.fix and f.where.get("op", "").startswith("fpdoctor_tests.")]
    assert found, str(t.report)
    for finding in found:
        assert finding.fix.startswith("Test fpdoctor_tests.scale_in_place") and "0/0" not in finding.fix
        assert finding.trial is not None and not finding.trial.tried


class _HandRMSNorm(nn.Module):
    """An RMSNorm written by hand with the eps of an fp32 codebase; padded rows are all zero."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj, self.head = nn.Linear(24, 24), nn.Linear(24, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h * mask[..., None].type_as(h)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.head(h).pow(2).mean()


def _rms_training(eps: float, *, traced: bool, steps: int = 20) -> tuple[fpdoctor.Report | None, list[float], int]:
    torch.manual_seed(0)
    model = _HandRMSNorm(eps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, mask = torch.randn(4, 12, 24), torch.ones(4, 12)
    mask[:, 9:] = 0
    losses, skipped = [], 0
    trace = fpdoctor.trace(model) if traced else None
    with trace if trace is not None else contextlib.nullcontext():
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, mask).float()
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            losses.append(loss.item())
    return (trace.report if trace is not None else None), losses, skipped


def test_a_hand_written_rmsnorms_eps_is_replaced_by_a_value_fp16_holds_and_then_it_trains():
    report, _, skipped = _rms_training(1e-12, traced=True)
    assert report is not None and skipped == 20
    first = report.sorted_findings()[0]
    assert first.fix.startswith("Replace the constant 1e-12 at ") and first.trial is not None and first.trial.tried
    value = float(re.search(r"with ([0-9.e+-]+), which float16 holds", first.fix).group(1))
    _, fixed, skipped = _rms_training(value, traced=False, steps=60)  # the fix as printed
    assert skipped < 20 and fixed[-1] < 0.5 * fixed[0]


NO_ZERO_GRAD = """
import torch
from torch import nn

torch.manual_seed(3)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(16, 32)
for step in range(30):
    ZERO
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).logsumexp(-1).mean().float()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_watch_replays_with_the_gradients_a_step_began_with_and_the_printed_fix_trains(tmp_path):
    import json
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    reports = {}
    for name, zero in (("as_is", "pass"), ("fixed", "opt.zero_grad(set_to_none=True)")):
        script = tmp_path / f"{name}.py"
        script.write_text(NO_ZERO_GRAD.replace("ZERO", zero))
        out = tmp_path / f"{name}.json"
        run_fpdoctor("watch", "-o", str(out), "--", str(script), timeout=240, cwd=tmp_path, env=env)
        reports[name] = json.loads(out.read_text())
    first = reports["as_is"]["findings"][0]
    assert "never zeroes the gradients" in first["title"] and first["evidence"]["carried_from_step"] == 1
    assert all(f["name"] != "transient-fault-suspected" for f in reports["as_is"]["findings"])
    assert reports["fixed"]["verdict"] == "ok", reports["fixed"]["findings"]


# -- an origin inside a module's forward, lines before the op that made the Inf ---------------
SOFTPLUS_SCRIPT = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.raw_var = nn.Linear(4, 32), nn.Linear(32, 1)
        with torch.no_grad():
            self.raw_var.bias.fill_(-12.0)  # a precise sensor: a small variance
    def forward(self, x):
        h = torch.tanh(self.body(x))
        return torch.log(1 + torch.exp(self.raw_var(h)))  # softplus by hand

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.rand(64, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        var = model(x)
        nll = torch.log(var).mean()
    opt.zero_grad()
    nll.backward()
    opt.step()
"""


def test_an_origin_inside_a_modules_forward_is_named_by_its_line_and_the_fix_applied_as_printed_works(tmp_path):
    """1 + exp(s) rounds to 1 in bf16 inside the model's forward and the loss's log(var) makes -inf:
    the fix names the forward's line (its stable form there, checked through the loss's line), and
    applied as printed the trace is clean."""
    import json
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}

    def trace(text: str) -> dict:
        script, out = tmp_path / "softplus.py", tmp_path / "trace.json"
        script.write_text(text)
        run_fpdoctor("trace", "-o", str(out), "--", str(script), timeout=240, cwd=tmp_path, env=env)
        return json.loads(out.read_text())

    lines = SOFTPLUS_SCRIPT.splitlines()
    forward = next(i for i, text in enumerate(lines, start=1) if "1 + torch.exp" in text)
    loss = next(i for i, text in enumerate(lines, start=1) if "torch.log(var)" in text)
    first = trace(SOFTPLUS_SCRIPT)["findings"][0]
    assert first["name"] == "nonfinite-produced"
    assert f"at line {forward} of {tmp_path / 'softplus.py'}:" in first["fix"], first["fix"]
    assert "Write torch.log1p(x)" in first["fix"] and first["fix_trial"]["status"] == "checked"
    assert f"softplus.py:{loss}" in first["evidence"]["location"]  # where it showed: the loss's log
    # as printed
    fixed = SOFTPLUS_SCRIPT.replace("torch.log(1 + torch.exp(", "torch.log1p(torch.exp(")
    assert fixed != SOFTPLUS_SCRIPT
    assert not [f for f in trace(fixed)["findings"] if f["severity"] == "error"]


# -- a fix checked on the step's loss: the whole fix, or not ------------------------------------
class _TwoFaults(nn.Module):
    """Attention weights by hand whose exp overflows fp16, and a log of a difference that is 0 at any
    precision (a bug of the math): the first's fix cures its op, not the loss."""

    def __init__(self, with_bug: bool) -> None:
        super().__init__()
        self.with_bug = with_bug
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        w = torch.exp(h)
        w = w / w.sum(-1, keepdim=True)
        loss = (w * h).sum(-1).mean()
        if self.with_bug:
            loss = loss + torch.log(h.detach() - h.detach()).mean()
        return loss.float()


@pytest.mark.parametrize(
    ("with_bug", "metric", "scaled"),
    [(False, False, False), (True, False, False), (False, True, False), (False, True, True)],
)
def test_the_first_fix_is_checked_on_the_steps_loss_and_says_when_it_is_not_the_whole_fix(with_bug, metric, scaled):
    """`metric`: a one-value figure computed from the same values after the loss (a logged accuracy):
    the loss checked is the one the backward starts from, not the last one-value op; `scaled`: the
    backward starts from the loss times a scale, as GradScaler.scale(loss) makes it: the loss is the one
    before it."""
    torch.manual_seed(0)
    model = _TwoFaults(with_bug).half()
    x = (8 * torch.randn(32, 16)).half()
    with fpdoctor.trace(model) as trace:
        loss = model(x)
        if metric:
            logged = loss.detach() * 100  # noqa: F841  (a percentage logged after the loss, from it)
        (loss * torch.tensor(65536.0) if scaled else loss).backward()
    assert not math.isfinite(float(loss.detach()))
    first = trace.report.sorted_findings()[0]
    assert first.fix.startswith("Write torch.softmax(x, dim)"), first.fix
    assert first.trial is not None and first.trial.tried
    if with_bug:  # log(0) stays: the softmax is not the whole fix, and the trial stays the op's
        assert "Not the whole fix: with torch.softmax(x, dim) at " in first.fix and " is still " in first.fix
        assert not first.trial.metric.startswith("the step's loss")
    else:
        assert "On the step's loss: with torch.softmax(x, dim) at " in first.fix, first.fix
        assert first.trial.metric.startswith("the step's loss") and first.trial.before == "nan"
        with torch.no_grad():  # the fix as printed, on the same step
            h = model.proj(x)
            expected = float((torch.softmax(h, -1) * h).sum(-1).mean().float())
        assert first.trial.after == pytest.approx(expected, rel=1e-2)


# -- a softmax by hand with a guard before its log; a guard whose replacement clips the loss ---------------
def _smoothed(logits: torch.Tensor, y: torch.Tensor, fixed: bool) -> torch.Tensor:
    """A label-smoothed cross-entropy by hand, with a temperature and a guard against log(0)."""
    z = logits / 0.05
    if fixed:  # as printed
        logp = torch.nn.functional.log_softmax(z, -1)
    else:
        e = torch.exp(z)
        logp = torch.log(e / e.sum(-1, keepdim=True) + 1e-8)
    return (0.9 * -logp.gather(1, y[:, None]).squeeze(1) - 0.1 * logp.mean(-1)).mean()


def test_a_softmax_by_hand_with_a_guard_before_its_log_gets_log_softmax_checked_against_fp64():
    """exp overflows fp16 at a temperature of 0.05, and the 1e-8 before the log is 0 in fp16: the fix
    was torch.softmax, 'not the whole fix' (log(0) stays), and the constant's replacement a second
    trace later made the loss finite but 35% off. log(softmax + eps) is one form, F.log_softmax,
    checked on the step's loss against the same ops as written in fp64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).half()
    x, y = torch.randn(64, 32).half(), torch.randint(0, 16, (64,))
    with fpdoctor.trace(model) as trace:
        loss = _smoothed(model(x), y, fixed=False)
        loss.backward()
    first = trace.report.sorted_findings()[0]
    assert first.fix.startswith("Write F.log_softmax(x, dim) instead of log(exp(x) / exp(x).sum(dim) + eps)")
    assert first.trial is not None and first.trial.metric.startswith("the step's loss"), first.trial
    exact = float(re.search(r"the same ops as written give ([0-9.e+-]+) in fp64", first.fix).group(1))
    with torch.no_grad():  # as printed, in fp16: the fp64 loss of the same ops, within the format's rounding
        printed = float(_smoothed(model(x), y, fixed=True).float())
    assert printed == pytest.approx(first.trial.after, rel=1e-2) and printed == pytest.approx(exact, rel=2e-2)


def test_a_finite_loss_that_is_not_the_losss_value_is_not_printed_as_the_fix():
    """log(|h| + 1e-8) of activations with exact zeros: 1e-8 is 0 in fp16 and the loss -inf. The
    replacement fp16 holds whose derivative fits (1e-3) makes the loss finite, and moves it: the
    same ops as written give another value in fp64, and the fix says the change alters the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU()).half()
    x = torch.randn(32, 16).half()
    with fpdoctor.trace(model) as trace:
        loss = torch.log(model(x).abs() + 1e-8).mean()
        loss.backward()
    first = trace.report.sorted_findings()[0]
    assert first.fix.startswith("Replace the constant 1e-08"), first.fix
    assert "Not the fix as it stands:" in first.fix and "alters what the loss computes" in first.fix, first.fix
    assert not first.trial.metric.startswith("the step's loss")


def test_an_update_handed_nan_gradients_from_a_compiled_backward_is_a_consequence_too():
    """The NaN made inside a torch.compile'd graph: the trace sees the gradient arrive non-finite at the
    optimizer (nonfinite-input, from a backward it did not see op by op), not the op's step; the update
    that carried it was still called a learning rate too large."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    @torch.compile(backend="aot_eager")
    def loss_of(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = model(x)
        return ((h * m).sum(1) / m.sum(1)).mean()  # 0/0 on a batch whose mask is empty

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for step in range(1, 6):
            opt.zero_grad()
            mask = torch.zeros(16, 1) if step == 3 else torch.ones(16, 1)
            loss_of(torch.randn(16, 8), mask).backward()
            opt.step()
    assert t.report is not None
    (blown,) = t.report.by_name("update-blew-up")
    assert blown.severity.value == "warning" and "does not change" in blown.fix, blown
    assert "lower the learning rate" not in blown.fix.lower()
