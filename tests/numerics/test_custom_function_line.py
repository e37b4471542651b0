"""An op run inside a custom torch.autograd.Function's backward is the user's own code: trace names
its line in that backward, not the forward's line that the autograd node was made at. A softplus
whose backward writes the sigmoid as exp(x) / (1 + exp(x)) makes inf / inf = NaN in fp16 under
autocast, and every step is skipped; the fix names the exp's line, and applied there as printed
(its operand .float()), the run trains."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

SOFTPLUS = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
class Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.softplus(x)
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        return g * e / (1 + e)
class Act(nn.Module):
    def forward(self, x):
        return Softplus.apply(x)
X = torch.randn(2048, 32) * torch.linspace(1, 20, 32)
Y = (X[:, :4].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(32, 128), Act(), nn.Linear(128, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    idx = torch.randint(0, 2048, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(X[idx]), Y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("SCALE", scaler.get_scale())
"""


def _trace(tmp_path: Path, script: Path) -> dict:
    return report_of(tmp_path, "trace", "--", str(script))


def test_an_op_in_a_custom_functions_backward_is_named_at_its_own_line_and_the_fix_there_works(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SOFTPLUS)
    lines = SOFTPLUS.splitlines()
    exp_line = next(n for n, text in enumerate(lines, 1) if "torch.exp(x)" in text)
    report = _trace(tmp_path, script)
    first = report["findings"][0]
    assert f"train.py:{exp_line} in backward" in first["message"], first["message"]
    assert f"train.py:{exp_line} in fp32" in first["fix"], first["fix"]
    script.write_text(SOFTPLUS.replace("e = torch.exp(x)", "e = torch.exp(x.float())"))
    fixed = _trace(tmp_path, script)
    assert not [f for f in fixed["findings"] if f["severity"] == "error"], [f["name"] for f in fixed["findings"]]


RMSNORM = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        xf = x.float()
        ctx.save_for_backward(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        ms = (x * x).sum(-1, keepdim=True) / x.shape[-1] + 1e-6
        inv = torch.rsqrt(ms)
        return inv * inv * inv * (ms * g - x * (g * x).sum(-1, keepdim=True) / x.shape[-1])
class Norm(nn.Module):
    def forward(self, h):
        return RMSNormFn.apply(h)
gen = torch.Generator().manual_seed(0)
x = torch.randn(2048, 64, generator=gen) * torch.logspace(0, 3, 64)  # raw readings, up to 1000s
y = x[:, :8].sum(1, keepdim=True) / 1000
model = nn.Sequential(nn.Linear(64, 128), Norm(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    idx = torch.randint(0, 2048, (64,), generator=gen)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x[idx]).float(), y[idx])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""

SQRT = """
import torch
from torch import nn
torch.manual_seed(0)
class MySqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.sqrt(x)
        ctx.save_for_backward(y)
        return y
    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g / (2 * y)
fc, out = nn.Linear(8, 8), nn.Linear(8, 1)
with torch.no_grad():
    fc.bias.zero_()
opt = torch.optim.SGD([*fc.parameters(), *out.parameters()], lr=1e-2)
x = torch.randn(64, 8)
x[0] = 0
y = torch.randn(64, 1)
for step in range(3):
    loss = (out(MySqrt.apply(fc(x).pow(2))) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_custom_functions_backward_op_is_never_the_backward_of_a_cast_but_keeps_a_real_forward_op(tmp_path):
    """An RMSNorm under fp16 autocast that casts in its forward and sums squares in fp16 in its backward
    (raw readings up to 1000s: the sum overflows, the scaler skips): the sum is the user's own op, not
    "the backward of aten._to_copy". A sqrt whose backward divides by 2 sqrt(x) at 0:
    still the backward of aten.sqrt, with sqrt's own advice."""
    script = tmp_path / "rmsnorm.py"
    script.write_text(RMSNORM)
    findings = _trace(tmp_path, script)["findings"]
    said = " ".join(f["title"] + " " + f["message"] for f in findings)
    assert "rmsnorm.py:15 in backward" in said, [f["title"] for f in findings]  # the overflow is its own line
    assert "the backward of aten._to_copy" not in said, said
    script = tmp_path / "sqrt.py"
    script.write_text(SQRT)
    first = _trace(tmp_path, script)["findings"][0]
    assert "the backward of aten.sqrt.default" in first["title"] + first["message"], first["title"]


GELU = """
import math, torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
K = math.sqrt(2 / math.pi)
class TanhGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        t = torch.tanh(K * (x + 0.044715 * x.pow(3)))
        ctx.save_for_backward(x, t)
        return 0.5 * x * (1 + t)
    @staticmethod
    def backward(ctx, grad):
        x, t = ctx.saved_tensors
        dinner = K * (1 + 3 * 0.044715 * x.pow(2))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner)
class Act(nn.Module):
    def forward(self, x):
        return TanhGELU.apply(x)
model = nn.Sequential(nn.Linear(8, 32), Act(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-6)
scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
x, y = 255 * torch.rand(64, 8), torch.randn(64, 1)  # raw pixel units: x ** 2 of the hidden values is past 65504
for step in range(6):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_a_power_in_a_custom_backward_that_overflows_is_told_as_an_overflow_not_a_fractional_power(tmp_path):
    """A tanh-GELU whose hand-written backward squares its input: on values past 256 the square overflows
    fp16. Its op is the user's own pow, told by what it is (its line in fp32, checked), never "the backward
    of" the forward's last op with the advice for x ** p, 0 < p < 1, at 0 (a clamp at eps that changes
    nothing)."""
    script = tmp_path / "gelu.py"
    script.write_text(GELU)
    line = next(n for n, text in enumerate(GELU.splitlines(), 1) if "x.pow(2)" in text)
    first = _trace(tmp_path, script)["findings"][0]
    said = first["title"] + " " + first["message"] + " " + first["fix"]
    assert f"gelu.py:{line} in backward" in first["message"], first["message"]
    assert "0 < p < 1" not in said and "clamp_min" not in first["fix"], first["fix"]
    assert f"gelu.py:{line} in fp32" in first["fix"], first["fix"]


TWO_ORIGINS = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
class FastSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + torch.exp(-x))
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        e = torch.exp(-x)
        sig = 1 / (1 + e)
        return grad * (sig + x * e / (1 + e) ** 2)
class Swish(nn.Module):
    def forward(self, x):
        return FastSwish.apply(x)
model = nn.Sequential(nn.Linear(1, 8), Swish(), nn.Linear(8, 1))
with torch.no_grad():
    model[0].weight.fill_(-1.0)
    model[0].bias.zero_()
opt = torch.optim.SGD(model.parameters(), lr=0.0)
scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
for step in range(24):
    level = 12.0 if step % 3 == 2 else 10.0  # -10: x * e and (1 + e) ** 2 overflow; -12: exp(12) itself does
    x = torch.full((4, 1), level)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_skipped_steps_a_second_line_starts_on_are_named_with_that_lines_own_checked_change(tmp_path):
    """A hand-written swish backward: at -10 its product and square overflow (NaN at the division), at -12
    its exp already does. The recurring origin's fix (the division's line in fp32) leaves the steps whose
    first Inf is the exp's: the finding says how many and gives that line's change, checked."""
    script = tmp_path / "two.py"
    script.write_text(TWO_ORIGINS)
    lines = TWO_ORIGINS.splitlines()
    exp_line = next(n for n, text in enumerate(lines, 1) if "e = torch.exp(-x)" in text)
    first = _trace(tmp_path, script)["findings"][0]
    assert first["name"] == "grad-scaler-stalled", first["title"]
    # its ops are the user's own: a division after the forward's neg is no "backward of aten.neg"
    assert "starts at aten.div.Tensor" in first["message"] and "the backward of" not in first["message"]
    assert "On 8 of those steps the first non-finite value is made earlier" in first["message"], first["message"]
    second = first["evidence"]["second_origin"]
    assert second["steps"] == 8 and second["fix_trial"]["status"] == "checked", second
    assert f"on 8 others the value is made first at {script}:{exp_line} in backward" in first["fix"], first["fix"]
    assert f"line {exp_line} of {script} in fp32, aten.exp.default's output is finite (checked" in first["fix"]
