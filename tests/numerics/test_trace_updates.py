"""`trace` measures what the traced optimizer steps did to bf16/fp16 trainable weights, as the sentinel does.

The reproductions: a pure-bf16 model trained by a script under `fpdoctor trace` (its AdamW updates
round away), bf16 gradients accumulated over many micro-batches (the .grad sum stops growing), and
the clean twins, fp32 master weights and autocast over fp32 weights.
"""

from __future__ import annotations

import json
import textwrap

import torch
from torch import nn

import fpdoctor

_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).bfloat16()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)  # a typical fp32 learning rate
g = torch.Generator().manual_seed(1)
for _ in range(3):
    x, y = torch.randn(16, 32, generator=g).bfloat16(), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()
"""


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1)).to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 32, generator=gen)
    return x, torch.sin(x[:, :4] * 2).sum(dim=1, keepdim=True)


def test_a_pure_bf16_script_under_trace_has_its_updates_rounded_away(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    out = tmp_path / "report.json"
    result = cli("trace", "-o", str(out), "--", str(script))
    assert out.exists(), result.err
    report = json.loads(out.read_text())
    (found,) = [f for f in report["findings"] if f["name"] == "update-rounded-away"]
    assert found["code"] == "TRN010" and found["where"]["phase"] == "optimizer"
    names = {p["name"]: p for p in found["evidence"]["parameters"]}
    assert set(names) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # the model's own names
    assert names["0.weight"]["rounded_share"] > 0.9 and names["0.weight"]["update_over_spacing"] < 0.5
    assert found["evidence"]["what_if"] == {"tried": False, "why_not": found["evidence"]["what_if"]["why_not"]}
    assert "trace does not run the step again" in found["message"]
    assert found["fix"].startswith("1. fp32 master weights") and "torch.optim.AdamW(masters" in found["fix"]
    summary = dict(report["data"]["summary"])
    assert summary["optimizer steps"] == "3"  # the shadow step on the sample is not a step of the script
    assert summary["training updates"].startswith("judged on 1 step(s) (every 10th")


def test_fp32_master_weights_under_trace_give_no_finding_and_say_why():
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01)
    x, y = _data()
    with fpdoctor.trace() as t:
        for _ in range(3):
            loss = ((model(x.bfloat16()).float() - y) ** 2).mean()
            loss.backward()
            for p, m in zip(params, masters, strict=True):
                m.grad, p.grad = p.grad.float(), None
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
    assert t.report.findings == []
    line = dict(t.report.data["summary"])["training updates"]
    assert line.startswith("nothing to judge: the 3 optimizer step(s) stepped no bf16/fp16 parameter")


def test_autocast_over_fp32_weights_under_trace_gives_no_finding():
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x, y = _data()
    with fpdoctor.trace() as t:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            ((out.float() - y) ** 2).mean().backward()
            opt.step()
    assert t.report.findings == []
    assert "training updates" not in dict(t.report.data["summary"])  # no low-precision weight to judge


def test_a_backward_without_an_optimizer_step_says_the_updates_were_not_judged():
    model = _model(torch.bfloat16)
    x, y = _data()
    with fpdoctor.trace() as t:
        ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
    assert dict(t.report.data["summary"])["training updates"] == "not judged: no optimizer stepped in the traced block"


def test_bf16_gradient_accumulation_under_trace_stalls():
    micro = 256
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = _data()
    with fpdoctor.trace() as t:
        for step in range(2):  # the second step's window is the first the trace sees whole
            for _ in range(micro if step else 1):
                ((model(x[:16].bfloat16()).float() - y[:16]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    (found,) = [f for f in t.report.by_name("accumulation-stalled") if f.evidence["kind"] == "gradient-accumulation"]
    assert found.code == "TRN011" and found.where["phase"] == "backward"
    assert found.evidence["micro_batches"] == micro and found.evidence["step"] == 2
    assert "0.weight" in [p["name"] for p in found.evidence["parameters"]]
    assert "fp32" in found.fix


def test_a_grad_the_code_divides_again_is_no_stall():
    """8 micro-batches, the loss divided by 8 and then `p.grad /= 8` as well: .grad is 1/8 of the sum
    the backward handed in, far more than rounding 8 additions in bf16 can lose (~3%), so it is the
    code's write, not a stall; with 256 micro-batches the sum itself stalls, as above."""
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = _data()
    with fpdoctor.trace() as t:
        for _ in range(3):
            for micro in range(8):
                rows = slice(16 * micro, 16 * micro + 16)
                (((model(x[rows].bfloat16()).float() - y[rows]) ** 2).mean() / 8).backward()
            for prm in model.parameters():
                prm.grad /= 8
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not [f for f in t.report.by_name("accumulation-stalled") if f.evidence["kind"] == "gradient-accumulation"]


def test_the_checks_leave_the_trace_and_the_training_as_they_were(monkeypatch):
    """The same traced training with and without the update checks: the same records, the same steps
    and bitwise the same weights (the check's own ops and shadow step are not the script's)."""
    from fpdoctor.numerics.updates.under_trace import TraceUpdates

    def run() -> tuple[fpdoctor.Trace, list[torch.Tensor]]:
        model = _model(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        x, y = _data()
        with fpdoctor.trace() as t:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                for _ in range(2):
                    ((model(x[:32].bfloat16()).float() - y[:32]) ** 2).mean().backward()
                opt.step()
        return t, [p.detach().clone() for p in model.parameters()]

    checked, weights = run()
    assert checked.report.by_name("update-rounded-away")
    monkeypatch.setattr(TraceUpdates, "__enter__", lambda self: self)  # trace without its update hooks
    plain, plain_weights = run()
    assert dict(plain.report.data["summary"])["training updates"].startswith("not judged")
    assert checked.records.count == plain.records.count
    assert dict(checked.report.data["summary"])["optimizer steps"] == "2"
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))


def test_an_optimizer_that_cannot_be_shadowed_is_said_not_judged_under_trace():
    class Mine(torch.optim.SGD):
        pass

    model = _model(torch.bfloat16)
    opt = Mine(model.parameters(), lr=1e-2)
    x, y = _data()
    with fpdoctor.trace() as t:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
            opt.step()
    assert t.report.by_name("update-rounded-away") == []
    assert dict(t.report.data["summary"])["training updates"].startswith("not judged: Mine's update")
