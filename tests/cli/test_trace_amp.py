"""`fpdoctor trace` under torch.amp.GradScaler: calibration is a note, a scaler that never steps is the error."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import run_fpdoctor, run_python

pytestmark = pytest.mark.timeout(120)

LOOP = """
    opt = torch.optim.{opt}
    scaler = torch.amp.GradScaler("cpu"{enabled})
    for step in range({steps}):
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""

HEALTHY = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def batch():
        return torch.randn(64, 64) * 4, torch.randint(0, 64, (64,))

    def loss_of(model, x, y):
        return nn.functional.cross_entropy(model(x).float(), y, reduction="sum")
"""

SQRT = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))

    def batch():
        return torch.randn(16, 16), None

    def loss_of(model, x, y, eps=1e-12):
        z = model(x)
        d2 = (z[:, None, :] - z[None, :, :]).pow(2).sum(-1)
        d = torch.sqrt(d2 + eps)
        return (d / d.mean()).var()
"""

ATTENTION = """
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-2, -1)
            return self.out(scores.softmax(-1) @ v)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Attention(64), nn.Linear(64, 4))
    with torch.no_grad():
        model[1].qkv.weight.mul_(40.0)

    def batch():
        return torch.randn(4, 16, 32) * 4, torch.randint(0, 4, (4,))

    def loss_of(model, x, y):
        return nn.functional.cross_entropy(model(x).mean(1).float(), y)
"""


def _write(tmp_path, model: str, steps: int = 10, opt: str = "SGD(model.parameters(), lr=1e-2)", enabled: str = ""):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(model) + textwrap.dedent(LOOP.format(opt=opt, steps=steps, enabled=enabled)))
    return path


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _trace(path) -> tuple[int, dict]:
    result = run_fpdoctor("trace", "--format", "json", "--", str(path))
    return result.code, json.loads(result.err[result.err.index('{\n  "schema"') :])


def test_a_healthy_amp_loop_calibrating_its_scale_is_ok(tmp_path):
    path = _write(tmp_path, HEALTHY, steps=12, opt="AdamW(model.parameters(), lr=1e-3)")
    code, doc = _trace(path)
    assert code == 0 and doc["verdict"] != "error"
    assert [f["name"] for f in doc["findings"]] == ["grad-scaler-calibrated"]
    (note,) = doc["findings"]
    assert note["severity"] == "info" and note["evidence"]["steps"] == 12
    assert note["evidence"]["skipped_steps"][0] == 1 and 0 < note["evidence"]["skipped"] < 12
    assert note["evidence"]["scale_first"] == 65536.0 and note["evidence"]["scale_last"] < 65536.0


def test_a_scaler_that_skips_every_step_names_the_sqrt_not_the_div(tmp_path):
    path = _write(tmp_path, SQRT)
    code, doc = _trace(path)
    assert code == 1
    first = doc["findings"][0]
    assert first["name"] == "grad-scaler-stalled" and first["severity"] == "error"
    assert first["title"] == "GradScaler skipped 10 of 10 steps: the optimizer never ran"
    origin = first["evidence"]["origin"]
    assert origin["forward_op"] == "aten.sqrt.default" and origin["phase"] == "backward"
    assert origin["location"].startswith(f"{path}:{_line(path, 'torch.sqrt(')} ")
    assert f"{path}:{_line(path, 'torch.sqrt(')} in loss_of" in first["message"]
    # one finding per cause: the producers on the skipped steps are that error's, not errors of their own
    assert not [f for f in doc["findings"] if f["name"] == "nonfinite-produced"]


def test_an_unscaled_attention_that_overflows_every_step_names_the_matmul(tmp_path):
    path = _write(tmp_path, ATTENTION)
    code, doc = _trace(path)
    assert code == 1
    first = doc["findings"][0]
    assert first["name"] == "grad-scaler-stalled" and "the optimizer never ran" in first["title"]
    origin = first["evidence"]["origin"]
    assert origin["op"] == "aten.bmm.default" and origin["phase"] == "forward" and origin["module"] == "1"
    assert origin["location"].startswith(f"{path}:{_line(path, 'q @ k.transpose')} ")
    assert "1/sqrt(d)" in first["fix"] and "every scale it tried" in first["fix"]


TEACHER = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    teacher = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        teacher[2].weight.mul_(40.0)  # a confident teacher: logits past 11, where exp overflows fp16

    def batch():
        return torch.randn(64, 32), None

    def loss_of(model, x, y):
        with torch.no_grad():  # the soft targets: no gradient, yet every gradient reads them
            e = torch.exp(teacher(x))
            target = e / e.sum(-1, keepdim=True)
        return -(target * torch.log_softmax(model(x), -1)).sum(-1).mean()
"""


def test_a_target_made_under_no_grad_that_is_nan_every_step_is_the_scalers_recurring_cause(tmp_path):
    """Soft targets a teacher makes under torch.no_grad() in fp16 are NaN on every step (exp overflows,
    Inf / Inf): every step skipped. The recurring cause named was the scaler's own first cast of 65536
    (once), as the target's forward ran without gradients, which was read as an evaluation; a forward
    under no_grad whose values reach the gradients is the training step's."""
    path = _write(tmp_path, TEACHER)
    code, doc = _trace(path)
    assert code == 1
    first = doc["findings"][0]
    assert first["name"] == "grad-scaler-stalled", [f["name"] for f in doc["findings"]]
    origin = first["evidence"]["origin"]
    assert origin["location"].startswith(f"{path}:{_line(path, 'torch.exp(teacher(x))')} "), origin
    assert origin["phase"] == "forward"


TOWERS = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(32, 128), "b": nn.Linear(32, 128)})
    with torch.no_grad():
        for tower in model.values():
            tower.weight.mul_(60.0)  # embeddings of magnitude ~25: their squares sum past 65504
    FP32 = "--fix" in sys.argv

    def batch():
        return torch.randn(64, 32), None

    def loss_of(model, x, y):
        a, b = model["a"](x), model["b"](x + 0.1)
        na = (a * a).sum(-1, keepdim=True, dtype=torch.float32 if FP32 else None).sqrt()
        nb = (b * b).sum(-1, keepdim=True, dtype=torch.float32 if FP32 else None).sqrt()
        logits = (a @ b.t()) / (na * nb.t()) * 10
        return nn.functional.cross_entropy(logits.float(), torch.arange(64))
"""


def test_two_norms_by_hand_that_overflow_in_the_same_step_are_one_fix_over_both_lines(tmp_path):
    """A cosine similarity by hand in fp16 whose two norms' sums of squares overflow: every step skipped.
    The scaler's finding named the first sum's line only; applied alone, every step is still skipped.
    It now names both lines, and with the change on both the scaler steps."""
    path = _write(tmp_path, TOWERS)
    code, doc = _trace(path)
    assert code == 1
    first = doc["findings"][0]
    assert first["name"] == "grad-scaler-stalled", [f["name"] for f in doc["findings"]]
    na, nb = _line(path, "na = (a * a)"), _line(path, "nb = (b * b)")
    assert first["evidence"]["location"].startswith(f"{path}:{na} "), first["evidence"]
    assert f"make the same change on lines {na} and {nb}" in first["fix"], first["fix"]
    # the loss stays finite (the cosine is 0), its backward does not: the change is checked on the backward
    trial = first["fix_trial"]
    assert trial["metric"].startswith("the gradients from the step's loss"), trial
    assert (trial["before"], trial["after"]) == ("non-finite", "finite")
    assert f"lines {min(na, nb)} and {max(na, nb)} of " in trial["changed"], trial["changed"]  # one set, said once
    fixed = path.with_name("fixed.py")
    fixed.write_text(path.read_text() + "\nprint('scale', scaler.get_scale(), file=sys.stderr)\n")
    run = run_python(str(fixed), "--fix", check=True)
    assert float(run.stderr.split("scale ")[-1]) >= 1024.0, run.stderr  # the scaler steps again


def test_a_disabled_scaler_is_no_scaler_for_a_model_built_in_the_script(tmp_path):
    path = _write(tmp_path, HEALTHY.replace("* 4", ""), steps=3, enabled=", enabled=False")
    code, doc = _trace(path)
    assert [f["name"] for f in doc["findings"]] == ["fp16-without-grad-scaler"]
    enabled = _write(tmp_path, HEALTHY.replace("* 4", ""), steps=3)
    code, doc = _trace(enabled)
    assert code == 0 and "fp16-without-grad-scaler" not in [f["name"] for f in doc["findings"]]


# every other batch overflows in fp32 (a loss scaled by 1e30 and squared): each halves the scale,
# which starts low, so that it leaves float32's normal range within the run
ALTERNATING = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    calls = [0]

    def batch():
        return torch.randn(16, 16), None

    def loss_of(model, x, y):
        calls[0] += 1
        z = model(x).float()
        return (z * (1e30 if calls[0] % 2 else 1.0)).pow(2).mean()
"""


@pytest.mark.parametrize("consecutive", [False, True])
def test_a_scale_below_float32s_range_is_the_scalers_story_not_a_cast_to_fix(tmp_path, consecutive):
    """Once the scale is below float32's normal range, 1/scale overflows and unscaling turns zero
    gradients into NaN without the scaler skipping: the stalled scaler's finding says so, and no
    finding of its own tells the user to fix the cast inside GradScaler."""
    model = ALTERNATING.replace("calls[0] % 2", "calls[0] < 12") if consecutive else ALTERNATING
    path = _write(tmp_path, model, steps=30 if consecutive else 20)
    path.write_text(path.read_text().replace('GradScaler("cpu"', 'GradScaler("cpu", init_scale=2.0**-120'))
    code, doc = _trace(path)
    assert code == 1
    first = doc["findings"][0]
    assert first["name"] == "grad-scaler-stalled" and first["severity"] == "error"
    out = first["evidence"]["scale_out_of_range"]
    assert out["scale"] < 1.2e-38 and out["applied_steps"] and "1/scale overflowed to inf" in first["message"]
    assert "the optimizer applied NaN gradients" in first["message"] and "are not finite" in first["message"]
    # the origin stays the user's line that overflowed, with its fix
    assert first["evidence"]["location"].startswith(f"{path}:{_line(path, '.pow(2)')} ")
    assert not [f for f in doc["findings"] if f["name"] == "nonfinite-produced"]


def test_skips_to_the_traces_end_after_steps_that_stepped_are_a_stopped_run_not_calibration():
    """A run that stepped, then overflowed at every step to the trace's end (its gradients grew past
    fp16 256-fold), is a scaler that stopped stepping; skips at the start, or one at a time after a
    growth, are calibration."""
    from fpdoctor.numerics.trace.scaler_skips import MIN_ALL_SKIPPED, ScalerRun

    def run(pattern: str) -> ScalerRun:
        return ScalerRun(
            tuple((k + 1, c == "x", 65536.0 / 2 ** pattern[: k + 1].count("x")) for k, c in enumerate(pattern))
        )

    assert MIN_ALL_SKIPPED == 8
    assert run("x" * 5 + "." * 6 + "x" * 9).collapsed  # stepped, then skipped to the end
    assert not run("x" * 9 + "." * 11).collapsed  # calibrating at the start
    assert not run("x" * 4 + "." * 8 + "x" + "." * 7).collapsed  # one skip after a growth
    assert not run("." * 13 + "x" * 7).collapsed  # too few to tell from a scale recalibrating
