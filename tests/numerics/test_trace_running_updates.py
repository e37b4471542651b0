"""An in-place running update outside the optimizer that a low-precision tensor rounds away: an
EMA of the weights kept in bf16 (decay 0.998: each step's change is below half a bf16 spacing, and
the EMA model never leaves its first weights), a running statistic in fp16 with momentum 0.001
(lerp_). trace said OK on both; it now names the line (TRN010, a running update) with the share of
the exact update lost and the fix checked (an fp32 copy keeps it). An EMA in fp32, and a bf16
accumulator whose steps are large, are not named."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import fpdoctor


def _train_with_ema(dtype: torch.dtype, decay: float = 0.998, *, frozen: bool = True) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 1))
    ema = copy.deepcopy(model).to(dtype).requires_grad_(not frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with fpdoctor.Trace(model) as tr:
        for _ in range(4):
            x = torch.randn(32, 16)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.mul_(decay).add_(p.to(pe.dtype), alpha=1 - decay)  # the EMA update
    assert tr.report is not None
    return tr.report


EMA_LINE = _train_with_ema.__code__.co_firstlineno + 13


def test_an_ema_of_the_weights_kept_in_bf16_is_named_with_its_line_and_the_fix_checked() -> None:
    report = _train_with_ema(torch.bfloat16)
    (found,) = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert found.name == "update-rounded-away" and found.evidence["location"].endswith(f":{EMA_LINE}"), found
    assert min(found.evidence["lost"]) > 0.9, found.evidence
    assert "fp32" in found.fix
    # evaluated through a copy: `.to` on the EMA module itself would cast it back to bf16 in place
    assert "copy.deepcopy(ema).to(torch.bfloat16)" in found.fix, found.fix
    assert found.trial is not None and found.trial.tried, found.trial
    # an EMA that keeps none of its updates stands still: its evaluation is wrong, an error (exit 1)
    assert found.severity == "error" and report.verdict == "error", found.severity


class _RMSprop:
    """A hand-written RMSprop, its square averages made with zeros_like (bf16 on a bf16 model), or
    in fp32 as the fix prints."""

    def __init__(self, params, fp32_state: bool) -> None:
        self.params = list(params)
        dtype = {"dtype": torch.float32} if fp32_state else {}
        self.avg = [torch.zeros_like(p, **dtype) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        for p, avg in zip(self.params, self.avg, strict=True):
            avg.mul_(0.995).addcmul_(p.grad.to(avg.dtype), p.grad.to(avg.dtype), value=0.005)
            p.add_((p.grad / (avg.sqrt() + 1e-6).to(p.dtype)) * -1e-3)


SQUARE_AVG = inspect.unwrap(_RMSprop.step).__code__.co_firstlineno + 3


def _rmsprop(fp32_state: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(torch.bfloat16)
    opt = _RMSprop(model.parameters(), fp32_state)
    with fpdoctor.trace(model) as t:
        for step in range(300):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(64, 8, generator=g)
            loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), 5 + x[:, :1])
            loss.backward()
            opt.step()
            for p in model.parameters():
                p.grad = None
    return [f for f in t.report.findings if str(f.evidence.get("location", "")).endswith(f":{SQUARE_AVG}")]


def test_a_hand_written_optimizers_state_in_bf16_is_named_as_a_state_with_a_fix_that_works_as_printed() -> None:
    (found,) = _rmsprop(fp32_state=False)
    assert found.name == "update-rounded-away" and "hand-written optimizer's moments" in found.message
    assert "torch.zeros_like(p, dtype=torch.float32)" in found.fix, found.fix
    assert not _rmsprop(fp32_state=True)  # as printed: the state made in fp32


def test_an_ema_in_fp32_is_not_named() -> None:
    report = _train_with_ema(torch.float32)
    assert not [f for f in report.findings if f.evidence.get("kind") == "running-update"], str(report)


@pytest.mark.parametrize(("momentum", "named"), [(0.001, True), (0.5, False)])
def test_a_running_statistic_in_fp16_is_named_only_where_its_steps_round_away(momentum: float, named: bool) -> None:
    torch.manual_seed(0)
    stat = torch.full((256,), 3.0, dtype=torch.float16)
    with fpdoctor.Trace() as tr:
        for _ in range(4):
            batch_mean = (3.5 + 0.05 * torch.randn(256)).half()  # the batch means: near the running one
            stat.lerp_(batch_mean, momentum)  # the running mean a normalisation keeps
    assert tr.report is not None
    found = [f for f in tr.report.findings if f.evidence.get("kind") == "running-update"]
    assert bool(found) is named, str(tr.report)


def _train_with_norm(
    dtype: torch.dtype, offset: float, *, norms_fp32: bool = False, two_d: bool = False, steps: int = 130
):  # fmt: skip
    """A classifier whose first layer is a BatchNorm over raw readings (feature mean `offset`), cast
    whole to `dtype`; `norms_fp32`: the fix as printed. The report, and the eval-mode error of the
    first norm's output against fp64's normalisation with the true statistics."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(8) if two_d else nn.BatchNorm1d(8)
    model = nn.Sequential(norm, nn.Flatten(), nn.Linear(8 * (9 if two_d else 1), 2)).to(dtype)
    if norms_fp32:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.float()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    shape = (64, 8, 3, 3) if two_d else (64, 8)

    def batch() -> torch.Tensor:
        return torch.randn(*shape) * 3 + offset

    with fpdoctor.Trace(model) as tr:
        for _ in range(steps):  # the statistic's calls checked: 1, 2, 4, ..., 128; the latest three judged
            opt.zero_grad()
            model(batch().to(dtype)).float().pow(2).mean().backward()
            opt.step()
    model.eval()
    x = batch()
    with torch.no_grad():
        got = model[0](x.to(dtype)).double()
    exact = (x.double() - offset) / 3.0  # what a settled norm makes of the readings
    assert tr.report is not None
    return tr.report, float((got - exact).abs().mean())


@pytest.mark.parametrize(
    ("dtype", "offset", "two_d", "steps"), [(torch.bfloat16, 300.0, False, 130), (torch.float16, 2000.0, True, 260)]
)
def test_a_norms_running_statistics_cast_to_low_precision_are_named_and_fp32_norms_work_as_printed(
    dtype: torch.dtype, offset: float, two_d: bool, steps: int
) -> None:
    """BatchNorm's running mean near 300 in bf16 (spacing 2) or 2000 in fp16 (spacing 1): once it
    settles, every momentum update is lost, and eval mode normalises with it. The statistics are
    named by their buffers, the fix (the norms in fp32) checked; applied as printed, eval mode's
    normalisation is right."""
    report, broken = _train_with_norm(dtype, offset, two_d=two_d, steps=steps)
    (found,) = [f for f in report.findings if f.evidence.get("buffers")]
    assert found.name == "update-rounded-away" and "BatchNorm's running statistics" in found.title
    assert "0.running_mean" in found.evidence["buffers"] and min(found.evidence["lost"]) >= 0.5
    assert found.trial is not None and found.trial.tried and "m.float()" in found.fix
    fixed_report, fixed = _train_with_norm(dtype, offset, norms_fp32=True, two_d=two_d, steps=steps)
    assert not [f for f in fixed_report.findings if f.evidence.get("buffers")]
    assert fixed < broken / 4, (broken, fixed)


def test_a_norm_over_centred_features_in_bf16_is_not_named() -> None:
    report, _ = _train_with_norm(torch.bfloat16, 0.0)
    assert not [f for f in report.findings if f.evidence.get("buffers")], str(report)


def test_an_ema_written_as_two_ops_on_a_state_far_from_zero_is_judged_as_one_update_once_it_settles() -> None:
    """A per-feature running mean of readings near 1000 in fp16 (spacing 0.5), `mean.mul_(1 - m)
    .add_(m * mu)`: each op alone moves it by about 10 and keeps that; together they move it by less
    than 0.25 once it nears 1000, which fp16 loses, so it stops at about 975. The pair is checked as
    one update on calls spread over the run, and the line named."""
    torch.manual_seed(0)
    mean = torch.zeros(8, dtype=torch.float16)
    m = 0.01
    with fpdoctor.Trace() as tr:
        for _ in range(600):
            mu = (1000.0 + 20.0 * torch.randn(128, 8)).mean(0)
            mean.mul_(1 - m).add_(m * mu.to(mean.dtype))  # the update
    line = test_an_ema_written_as_two_ops_on_a_state_far_from_zero_is_judged_as_one_update_once_it_settles
    at = line.__code__.co_firstlineno + 11
    (found,) = [f for f in tr.report.findings if f.evidence.get("kind") == "running-update"]
    assert found.evidence["location"].endswith(f":{at}"), found.evidence
    assert "aten.mul_" in found.message and "aten.add_" in found.message
    assert float(mean.float().mean()) < 990  # the state it names did stop short
    # the fix says what its check measured in fp32: all of it kept, or the share fp32 still loses
    assert found.trial is not None and found.trial.tried
    worst = float(str(found.trial.after).split("%")[0])
    assert ("keeps all of it (checked)" in found.fix) == (worst < 0.5), (found.fix, found.trial.after)
    assert "keeps all of it" in found.fix or f"loses at most {round(worst)}% of it (checked)" in found.fix


def _ema_written(form: str, dtype: torch.dtype, steps: int = 64) -> tuple[fpdoctor.Report, int]:
    """An EMA of the weights kept in `dtype` (decay 0.999), its update written as users write it
    outside `mul_().add_()`: `form` "copy" (timm's ModelEmaV2: ema.copy_(d * ema + (1 - d) * w) over
    state_dict values), "data" (the same through .data, a new tensor object on every read), "foreach"
    (torch._foreach_lerp_, as swa_utils' multi-tensor EMA), "rebind" (a dict entry bound again each
    step, no in-place op), "lerp_out" (torch.lerp(..., out=ema)), "add_out" (torch.add(ema * d, w,
    out=ema): out= a tensor the statement reads). The report and the update's line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 1))
    ema = copy.deepcopy(model).to(dtype).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    d = 0.999
    shadow = {n: p for n, p in ema.named_parameters()}
    with fpdoctor.Trace(model) as tr:
        for _ in range(steps):
            x = torch.randn(32, 16)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                if form == "copy":
                    for e, w in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                        e.copy_(d * e + (1.0 - d) * w)  # the update: copy_
                elif form == "data":
                    for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                        pe.data.copy_(pe.data * d + p.data.to(dtype) * (1.0 - d))  # the update: data
                elif form == "rebind":
                    for n, p in model.named_parameters():
                        shadow[n] = shadow[n] * d + p.to(dtype) * (1.0 - d)  # the update: rebind
                elif form == "lerp_out":
                    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                        torch.lerp(e, p.to(dtype), 1.0 - d, out=e)  # the update: lerp_out
                elif form == "add_out":
                    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                        torch.add(e * d, p.to(dtype), alpha=1.0 - d, out=e)  # the update: add_out
                else:
                    params = [p.to(dtype) for p in model.parameters()]
                    torch._foreach_lerp_(list(ema.parameters()), params, 1.0 - d)  # the update: foreach
    assert tr.report is not None
    source = inspect.getsource(_ema_written).splitlines()
    at = _ema_written.__code__.co_firstlineno + next(i for i, s in enumerate(source) if f"the update: {form}" in s)
    return tr.report, at


@pytest.mark.parametrize("form", ["copy", "data", "foreach", "add_out"])
def test_an_ema_in_bf16_written_as_a_copy_or_a_foreach_lerp_is_named_at_its_line(form: str) -> None:
    """trace said OK on these forms (only add_, mul_, lerp_ ... were watched): the statement a copy_
    writes back is redone from the same values exactly and in fp32, and a foreach update per tensor."""
    report, at = _ema_written(form, torch.bfloat16)
    found = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert len(found) == 1 and found[0].evidence["location"].endswith(f":{at}"), str(report)
    assert min(found[0].evidence["lost"]) > 0.5 and found[0].trial is not None and found[0].trial.tried
    assert report.verdict != "ok"


@pytest.mark.parametrize("form", ["copy", "foreach", "rebind", "lerp_out", "add_out"])
def test_the_same_emas_in_fp32_are_not_named(form: str) -> None:
    report, _ = _ema_written(form, torch.float32, steps=16)
    assert not [f for f in report.findings if f.evidence.get("kind") == "running-update"], str(report)


def test_a_running_statistic_rewritten_by_copy_in_fp16_is_named_and_a_plain_copy_is_not() -> None:
    """A class of the same kind that the EMA tests do not hold: a running mean of readings near 300
    kept in fp16 and rewritten whole (stat.copy_(stat * 0.999 + batch.mean(0) * 0.001)); and a
    load-style copy of new values into an fp16 buffer, which no statement reads the buffer for."""
    torch.manual_seed(0)
    stat = torch.full((32,), 300.0, dtype=torch.float16)
    buf = torch.zeros(32, dtype=torch.float16)
    with fpdoctor.Trace() as tr:
        for _ in range(64):
            batch = (310.0 + torch.randn(64, 32)).half()
            stat.copy_(stat * 0.999 + batch.mean(0) * 0.001)  # the running mean
            buf.copy_(batch.mean(0) * 0.5)
    assert tr.report is not None
    (found,) = [f for f in tr.report.findings if f.evidence.get("kind") == "running-update"]
    test = test_a_running_statistic_rewritten_by_copy_in_fp16_is_named_and_a_plain_copy_is_not
    source = inspect.getsource(test).splitlines()
    at = test.__code__.co_firstlineno + next(i for i, s in enumerate(source) if s.endswith("# the running mean"))
    assert found.evidence["location"].endswith(f":{at}"), found.evidence


def test_an_ema_kept_in_bf16_by_rebinding_a_dict_of_tensors_is_named_at_its_line() -> None:
    """The EMA of many callbacks: `shadow[n] = shadow[n] * d + p * (1 - d)`, no in-place op, the dict's
    entry bound again each step. trace said OK; the line reads what its previous visit made, and that
    value is judged as a copy_'s statement is (fp32: test_the_same_emas_in_fp32_are_not_named)."""
    report, at = _ema_written("rebind", torch.bfloat16)
    found = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert len(found) == 1 and found[0].evidence["location"].endswith(f":{at}"), str(report)
    assert min(found[0].evidence["lost"]) > 0.5 and "in place" not in found[0].message


def test_an_ema_in_bf16_written_with_lerp_out_is_named_and_fp32_is_not() -> None:
    """torch.lerp(ema, w, 1 - d, out=ema): the in-place update by another name (aten.lerp with out=),
    which trace did not watch (OK on a bf16 EMA whose evaluation stayed at its first weights)."""
    report, at = _ema_written("lerp_out", torch.bfloat16)
    found = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert len(found) == 1 and "aten.lerp_" in found[0].message and min(found[0].evidence["lost"]) > 0.5, found
    assert found[0].evidence["location"].endswith(f":{at}"), found[0].evidence


def _bf16_weights_updated_by_hand(form: str, *, masters: bool = False, wd: float = 0.05, steps: int = 6):
    """A bf16 model whose weights a line updates by hand under no_grad, outside optimizer.step:
    a decoupled weight decay before Adam's step (AdamW written out, trial77), or a whole SGD step
    written by hand in fp16. `masters`: the fix as printed, the line applied to fp32 master copies."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if form == "decay" else torch.float16
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8)).to(dtype)
    params = list(model.parameters())
    held = [p.detach().float().requires_grad_() for p in params] if masters else params
    opt = torch.optim.Adam(held, lr=1e-4) if form == "decay" else None
    lr = 1e-4
    g = torch.Generator().manual_seed(1)
    with fpdoctor.Trace(model) as tr:
        for _ in range(steps):
            x = torch.randn(64, 32, generator=g).to(dtype)
            loss = model(x).float().pow(2).mean()
            for p in params:
                p.grad = None
            loss.backward()
            if masters:
                for p, m in zip(params, held, strict=True):
                    m.grad = p.grad.float()
            with torch.no_grad():
                for p in held:
                    if form == "decay":
                        p.mul_(1 - lr * wd)  # decoupled weight decay, as AdamW does it
                    else:
                        p.add_(p.grad, alpha=-lr)  # SGD by hand
            if opt is not None:
                opt.step()
            if masters:
                with torch.no_grad():
                    for p, m in zip(params, held, strict=True):
                        p.copy_(m)
    assert tr.report is not None
    return tr.report, held


HAND_LINE = _bf16_weights_updated_by_hand.__code__.co_firstlineno + 25


@pytest.mark.parametrize("form", ["decay", "sgd"])
def test_weights_updated_by_hand_under_no_grad_are_named_first_with_a_fix_for_weights(form: str) -> None:
    report, _ = _bf16_weights_updated_by_hand(form)
    first = report.findings[0]
    line = HAND_LINE if form == "decay" else HAND_LINE + 2
    assert first.evidence.get("kind") == "running-update", [f.name for f in report.findings]
    assert first.evidence["location"].endswith(f":{line}"), first.evidence
    assert "trainable weights, under no_grad" in first.message and "EMA" not in first.message
    assert "fp32 master copies" in first.fix and first.trial is not None and first.trial.tried


def test_the_decay_applied_to_fp32_masters_as_printed_acts_and_is_not_named() -> None:
    report, masters = _bf16_weights_updated_by_hand("decay", masters=True, steps=20)
    assert not [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    _, without = _bf16_weights_updated_by_hand("decay", masters=True, steps=20, wd=0.0)
    decayed = sum(float(m.detach().norm()) for m in masters)
    assert decayed < sum(float(m.detach().norm()) for m in without)  # the decay now moves the weights


def test_an_ema_copy_that_kept_requires_grad_is_still_an_ema_not_weights_updated_by_hand() -> None:
    """timm's ModelEmaV2 pattern: deepcopy(model) without requires_grad_(False). No optimizer steps
    the copy and it never gets a gradient: an EMA, worded and fixed as one (review54)."""
    report = _train_with_ema(torch.bfloat16, frozen=False)
    (found,) = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert "an EMA of weights" in found.message and "trainable weights" not in found.message
    assert "weight_decay" not in found.fix


def test_a_slow_statistic_that_stalls_after_its_256th_call_is_named_within_1100_calls() -> None:
    """momentum 0.01 over readings near 2500 in fp16 (spacing 2): the running mean climbs for some
    hundreds of calls, then every update is lost ~100 below the mean. Checked on the 1st, 2nd, 4th, ...
    calls alone, the latest three of 1100 (256, 512, 1024) hold one from the climb and it went unsaid;
    every 256th call is checked too, so 512, 768 and 1024 judge it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(8, momentum=0.01), nn.Linear(8, 2)).half()
    with fpdoctor.Trace(model) as tr, torch.no_grad():
        for _ in range(1100):
            model((torch.randn(32, 8) * 3 + 2500).half())
    assert tr.report is not None
    found = [f for f in tr.report.findings if f.evidence.get("buffers")]
    assert found and "0.running_mean" in found[0].evidence["buffers"], [f.title for f in tr.report.findings]


class _EpochLoss:
    """What a training loop prints: the epoch's losses summed into a tensor of the model's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.sum = torch.zeros((), dtype=dtype)
        self.count = 0

    def update(self, loss: torch.Tensor) -> None:
        self.sum.add_(loss.detach().to(self.sum.dtype))  # the running total
        self.count += 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_loss_total_kept_in_bf16_is_named_as_a_running_total(dtype: torch.dtype) -> None:
    """A bf16 total stops at 256 for losses near 0.6 (bf16's spacing there is 2): the printed epoch loss is
    flat and 2-4x low while the model trains. One value was never judged (a scalar was not a running state)."""
    torch.manual_seed(0)
    total = _EpochLoss(dtype)
    with fpdoctor.Trace() as tr:
        for _ in range(600):
            total.update(0.6 + 0.01 * torch.randn(()))
    assert tr.report is not None
    found = [f for f in tr.report.findings if f.evidence.get("kind") == "running-update"]
    if dtype == torch.float32:
        assert not found, str(tr.report)
        return
    line = inspect.getsourcelines(_EpochLoss.update)[1] + 1
    (named,) = found
    assert named.evidence["location"].endswith(f":{line}") and named.evidence["shape"] == [], named.evidence
    assert "a running total" in named.message and "dtype=torch.float32" in named.fix, named
    assert named.trial is not None and named.trial.tried


def test_a_step_count_kept_in_bf16_for_a_warm_up_is_named_as_a_counter_with_its_consequence() -> None:
    """A warm-up reads its step count from a bf16 tensor: past 256 the count stops (256 + 1 is 256 in bf16)
    and the learning rate stops rising; named as a counter, with the fix that keeps it a Python number."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    count = torch.zeros((), dtype=torch.bfloat16)
    with fpdoctor.trace(model) as t:
        for _ in range(600):
            count += 1
            opt.param_groups[0]["lr"] = 0.1 * min(float(count) / 1000, 1.0)
            model(torch.randn(8, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert float(count) == 256.0
    (named,) = [
        f for f in t.report.findings if f.evidence.get("kind") == "running-update" and f.evidence["shape"] == []
    ]
    assert "a step count a learning-rate warm-up reads" in named.message and "step += 1" in named.fix, named


class _Tracked(nn.Module):
    """A model that keeps a running loss of its own in bf16, rebound in a method the forward calls (a
    LightningModule's training_step runs so, through the module's call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.level: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.training_step(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        loss = (1.0 + self.lin(x).pow(2).mean()).to(torch.bfloat16)
        self.level = loss.detach().clone() if self.level is None else 0.995 * self.level + 0.005 * loss.detach()
        return loss.float()


def test_a_bf16_state_rebound_in_a_method_of_the_module_is_named_at_its_line() -> None:
    torch.manual_seed(0)
    model = _Tracked()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for _ in range(600):
            opt.zero_grad()
            model(torch.randn(8, 4) + 3).backward()
            opt.step()
    line = inspect.getsourcelines(_Tracked.training_step)[1] + 2
    found = [f for f in t.report.findings if str(f.evidence.get("location", "")).endswith(f":{line}")]
    assert found and found[0].name == "update-rounded-away", [f.evidence.get("location") for f in t.report.findings]


def _discounted(rewards: torch.Tensor, gamma: float, state_dtype: torch.dtype) -> torch.Tensor:
    running = torch.zeros(rewards.shape[0], dtype=state_dtype)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running  # the loop's body is this one line
    return running


def test_a_state_rebound_in_a_loop_whose_body_is_that_line_alone_is_named_and_the_fix_works() -> None:
    """trial137: discounted returns in bf16, `running = r[:, t] + gamma * running`, the loop's only line: no
    other line runs between its visits, which were therefore one visit, and the rebinding was not seen."""
    rewards = (torch.rand(4, 600, generator=torch.Generator().manual_seed(0)) < 0.5).to(torch.bfloat16) + 0.5
    exact = _discounted(rewards.double(), 0.999, torch.float64)
    with fpdoctor.trace() as tr:
        got = _discounted(rewards, 0.999, torch.bfloat16)
    assert float((got.double() - exact).abs().max() / exact.abs().max()) > 0.1  # the premise: it stalls
    (found,) = [f for f in tr.report.findings if f.name == "update-rounded-away"]
    assert "bound to it again" in found.message and "dtype=torch.float32" in found.fix, found
    fixed = _discounted(rewards, 0.999, torch.float32)  # as printed: the state created in fp32
    assert float((fixed.double() - exact).abs().max() / exact.abs().max()) < 0.01


def test_a_one_line_loop_whose_steps_the_format_holds_is_not_named() -> None:
    rewards = torch.rand(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with fpdoctor.trace() as tr:
        _discounted(rewards, 0.5, torch.bfloat16)  # each step halves the state: its changes are not rounded away
    assert not [f for f in tr.report.findings if f.name == "update-rounded-away"], tr.report


def _swa_ema(multi: bool, fixed: bool = False, steps: int = 200) -> tuple[fpdoctor.Report | None, float, float]:
    """A bf16 model and its EMA through torch.optim.swa_utils.AveragedModel (decay 0.999), the
    multi-tensor form (`multi`: a foreach lerp) or per parameter; `fixed`: the EMA as the fix prints it
    (`AveragedModel(model, avg_fn=get_ema_avg_fn(decay)).float()`, evaluated through a bf16 copy). The
    trace's report (None when `fixed`), and the EMA's distance from its first weights, and the model's."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 1)).to(torch.bfloat16)
    first = copy.deepcopy(model)
    if fixed:
        ema = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999)).float()
    elif multi:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    else:
        ema = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train() -> None:
        for _ in range(steps):
            x = torch.randn(32, 16, dtype=torch.bfloat16)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            ema.update_parameters(model)

    report = None
    if fixed:
        train()
    else:
        with fpdoctor.Trace(model) as tr:
            train()
        report = tr.report
    evaluated = copy.deepcopy(ema.module).to(torch.bfloat16)

    def moved(m: nn.Module) -> float:
        return sum(
            float((a.float() - b.float()).abs().sum()) for a, b in zip(m.parameters(), first.parameters(), strict=True)
        )

    return report, moved(evaluated), moved(model)


def test_an_ema_by_swa_utils_foreach_lerp_gets_a_fix_that_runs_as_printed() -> None:
    """torch.optim.swa_utils' multi-tensor EMA of bf16 weights: the fix said "keep that tensor in fp32",
    and AveragedModel(...).float() with get_ema_multi_avg_fn raised at its first update (lerp takes one
    dtype). The fix names what runs: avg_fn=get_ema_avg_fn(decay) on an fp32 AveragedModel."""
    report, ema_moved, model_moved = _swa_ema(multi=True)
    assert report is not None
    (found,) = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert "AveragedModel(model, avg_fn=get_ema_avg_fn(decay)).float()" in found.fix, found.fix
    assert "p.float()" in found.fix
    assert ema_moved < 0.2 * model_moved  # the bf16 EMA stays near its first weights
    _, fixed_moved, _ = _swa_ema(multi=True, fixed=True)  # as printed: it runs, and the EMA follows (6.9 vs 3.7)
    assert fixed_moved > 1.5 * ema_moved


def test_an_ema_by_swa_utils_per_parameter_is_named_without_the_lerp_clause() -> None:
    report, _, _ = _swa_ema(multi=False)
    assert report is not None
    found = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert len(found) == 1 and "get_ema_avg_fn" not in found[0].fix, [f.fix for f in found]
