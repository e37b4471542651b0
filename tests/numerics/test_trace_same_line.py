"""One line, one cause (numerics/trace/same_line.py): a gradient norm written by hand in fp16,
sqrt of the sum of each gradient's (g * g).sum(). Its first overflow is one op of the line; as the
gradients grow, the line's other op reaches the limit too. The trace's fix takes the whole line
(every op of it in fp32), the later repeats of the same line are not findings of their own, and
the fix as printed trains where the script did not."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_fpdoctor, run_python

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    FIX = "--fix" in sys.argv

    def clip_(params, max_norm):
        grads = [p.grad for p in params if p.grad is not None]
        if FIX:
            total = torch.stack([(g.float() * g.float()).sum() for g in grads]).sum().sqrt()
        else:
            total = torch.stack([(g * g).sum() for g in grads]).sum().sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))

    torch.manual_seed(0)
    X = torch.randn(1024, 8); y = X @ torch.randn(8) * 3
    model = nn.Sequential(nn.Linear(8, 96), nn.ReLU(), nn.Linear(96, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    first = None
    for step in range(60):
        idx = torch.randint(0, 1024, (256,))
        loss = F.mse_loss(model(X[idx].half()).squeeze(-1).float(), y[idx], reduction="sum")
        opt.zero_grad(); loss.backward(); clip_(model.parameters(), 1.0); opt.step()
        first = first or loss.item()
    print(first, loss.item(), file=sys.stderr)
    """
)


def test_a_hand_written_fp16_gradient_norm_is_one_finding_whose_fix_takes_the_whole_line(tmp_path: Path) -> None:
    script = tmp_path / "clip.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    findings = json.loads(report.read_text())["findings"]
    first = findings[0]
    assert first["name"] in ("nonfinite-zeroed", "nonfinite-produced"), [f["name"] for f in findings]
    line = first["evidence"]["location"].split(" in ")[0]
    assert line.endswith(":10")  # the line of (g * g).sum()
    near = first["evidence"]["same_line_near_limit"]
    assert near["op"] != first["where"]["op"] and near["share"] > 0.5
    assert "every op of line 10 in fp32" in first["fix"] and ".sum(dtype=torch.float32)" not in first["fix"]
    # the same line later, masked or near the limit, is this finding's, not one of its own
    same = [f for f in findings[1:] if (f["evidence"].get("location") or "").split(" in ")[0] == line]
    assert not same, [f["name"] for f in same]

    # as printed: every op of the line in fp32 (the operands .float()); it trains, the script does not
    def losses(*flag: str) -> tuple[float, float]:
        out = run_python(str(script), *flag, check=True)
        first_loss, last = out.stderr.split()
        return float(first_loss), float(last)

    before, after = losses(), losses("--fix")
    assert after[1] < after[0] / 10 and before[1] > before[0] / 2


def _traced_and_fixed(script: Path, text: str, *, symptom: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    """The script run plain (its symptom printed), traced (the first finding), and run with --fix."""
    script.write_text(text)
    plain = run_python(str(script), check=True)
    assert symptom in plain.stderr, plain.stderr
    report = script.with_suffix(".json")
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    fixed = run_python(str(script), "--fix", check=True)
    return json.loads(report.read_text())["findings"][0], fixed


SYMMETRIC = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv

    def two_way_loss(a, b, scale):
        logits = scale * a @ b.t()
        if FIX:
            rows = torch.logsumexp(logits, 1)
            cols = torch.logsumexp(logits, 0)
        else:
            rows = torch.log(torch.exp(logits).sum(1))
            cols = torch.log(torch.exp(logits).sum(0))
        return (rows + cols - 2 * logits.diagonal()).float().mean()

    torch.manual_seed(0)
    enc_a, enc_b = nn.Linear(32, 32).half(), nn.Linear(24, 32).half()
    z = torch.randn(64, 8)
    xa, xb = (z @ torch.randn(8, 32)).half(), (z @ torch.randn(8, 24)).half()
    bad = 0
    for step in range(4):
        a = nn.functional.normalize(enc_a(xa), dim=-1)
        b = nn.functional.normalize(enc_b(xb), dim=-1)
        loss = two_way_loss(a, b, 20.0)
        bad += not bool(torch.isfinite(loss))
        enc_a.zero_grad(); enc_b.zero_grad(); loss.backward()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_the_same_overflow_of_the_same_values_on_two_lines_is_one_fix_over_both(tmp_path: Path) -> None:
    """A contrastive loss in both directions written by hand in fp16 (log(exp(logits).sum(1)) and
    .sum(0) on two lines): exp overflows on both in the same step. The first finding's fix named one
    line, as exp in fp32 (which overflows too at a larger scale), and applied alone the loss stayed
    Inf; it now names both lines and the stable form, torch.logsumexp, checked on what the exp read
    (the log that completes the form runs after the exp's experiment), and applied as printed the
    loss is finite."""
    first, fixed = _traced_and_fixed(tmp_path / "two_way.py", SYMMETRIC, symptom="non-finite losses 4")
    assert first["evidence"]["location"].split(" in ")[0].endswith(":11"), first
    assert first["evidence"]["same_values_at"] == [f"{first['evidence']['location'].split(':')[0]}:12"], first
    assert "lines 11 and 12" in first["fix"], first["fix"]
    assert first["fix"].startswith("Write torch.logsumexp(x, dim) instead of log(exp(x).sum(dim))"), first["fix"]
    assert "non-finite losses 0" in fixed.stderr  # both lines in fp32, as printed


TWO_HEADS = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    a, b = nn.Linear(16, 8).half(), nn.Linear(16, 8).half()
    x = (3 * torch.randn(64, 16)).half()
    bad = 0
    for step in range(3):
        la, lb = a(x), b(x)
        if FIX:
            za = torch.exp(la.float() / 0.1).mean(-1)
            zb = torch.exp(lb.float() / 0.1).mean(-1)
        else:
            za = torch.exp(la / 0.1).mean(-1)
            zb = torch.exp(lb / 0.1).mean(-1)
        loss = torch.log(za.float() + zb.float()).mean()
        bad += not bool(torch.isfinite(loss))
        a.zero_grad(); b.zero_grad(); loss.backward()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_the_same_op_overflowing_on_two_lines_from_their_own_values_is_named_on_both(tmp_path: Path) -> None:
    """Two heads, each with its own exp on its own line, overflow fp16 in the same step: the trace
    experiments on the first producer only, and the other was listed as another producer without a
    line. The first finding's fix now names both lines (the second said not experimented on)."""
    first, fixed = _traced_and_fixed(tmp_path / "two_heads.py", TWO_HEADS, symptom="non-finite losses 3")
    assert first["evidence"]["location"].split(" in ")[0].endswith(":14"), first["evidence"]
    assert [x.rpartition(":")[2] for x in first["evidence"]["same_op_lines"]] == ["15"], first["evidence"]
    assert "make the same change on lines 14 and 15" in first["fix"], first["fix"]
    # the second head's exp is among the first producers experimented on: its own fix was checked too
    assert "the same change checked there on them too" in first["fix"], first["fix"]
    assert first["evidence"]["same_op_checked"] == first["evidence"]["same_op_lines"]
    assert "non-finite losses 0" in fixed.stderr  # both lines in fp32


MUTUAL = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    a, b = nn.Linear(16, 10).half(), nn.Linear(16, 10).half()
    x = (3 * torch.randn(64, 16)).half()
    bad = 0
    for step in range(3):
        la, lb = a(x), b(x)
        if FIX:
            log_pa, log_pb = F.log_softmax(la / 0.1, -1), F.log_softmax(lb / 0.1, -1)
        else:
            pa = torch.exp(la / 0.1); pa = pa / pa.sum(-1, keepdim=True)
            pb = torch.exp(lb / 0.1); pb = pb / pb.sum(-1, keepdim=True)
            log_pa, log_pb = pa.log(), pb.log()
        kl = (log_pa.exp() * (log_pa - log_pb)).sum(-1).mean() + (log_pb.exp() * (log_pb - log_pa)).sum(-1).mean()
        loss = kl.float()
        bad += not bool(torch.isfinite(loss))
        a.zero_grad(); b.zero_grad(); loss.backward()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_a_softmax_by_hand_then_its_log_gets_log_softmax_on_both_heads(tmp_path: Path) -> None:
    """Mutual learning between two heads in fp16, each head's softmax by hand (exp, sum, div) and its
    log on a later line: exp overflows. The fix was exp in fp32 on the first head's line, and applied
    on both the run still went NaN (the probabilities underflow fp16 and their log is -inf); the form
    exp / sum then log is now completed when the log runs, and F.log_softmax checked on what the exp
    read: applied as printed on both heads, the run is finite."""
    first, fixed = _traced_and_fixed(tmp_path / "mutual.py", MUTUAL, symptom="non-finite losses 3")
    assert first["fix"].startswith(
        "Write F.log_softmax(x, dim) instead of log(exp(x) / exp(x).sum(dim)) at lines 13 and 15"
    ), first["fix"]
    assert "line 14 overflows too, in log(exp(x) / exp(x).sum(dim)): write F.log_softmax(x, dim) there" in first["fix"]
    assert "non-finite losses 0" in fixed.stderr


DISTILL = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    teacher, student = nn.Linear(32, 50).half(), nn.Linear(32, 50).half()
    with torch.no_grad():
        teacher.weight.mul_(12.0)
        if "--confident" in sys.argv:
            student.weight.mul_(12.0)
    x = torch.randn(64, 32).half()
    bad = 0
    for step in range(3):
        t, s = teacher(x).detach(), student(x)
        if FIX:
            p_t = torch.softmax(t, -1)
            log_p_t = t - torch.logsumexp(t, -1, keepdim=True)
            log_p_s = s - torch.logsumexp(s, -1, keepdim=True)
        else:
            p_t = torch.exp(t) / torch.exp(t).sum(-1, keepdim=True)
            log_p_t = t - torch.log(torch.exp(t).sum(-1, keepdim=True))
            log_p_s = s - torch.log(torch.exp(s).sum(-1, keepdim=True))
        loss = (p_t * (log_p_t - log_p_s)).sum(-1).mean().float()
        bad += not bool(torch.isfinite(loss))
        if step == 0:
            print("first loss", float(loss), file=sys.stderr)
        student.zero_grad(); loss.backward()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_a_distillation_loss_by_hand_gets_each_lines_stable_form_also_where_it_has_not_overflowed_yet(
    tmp_path: Path,
) -> None:
    """Knowledge distillation in fp16 with the teacher's softmax (its exp written twice) and both
    log-sum-exps by hand: the teacher's exps overflow. The fix was exp in fp32 on the teacher's two
    lines, which cured this run only: the student's line, the same form finite while the student is
    unsure, went NaN once it grew as confident as the teacher. Each line now gets its own stable form,
    the student's too, and applied as printed a confident student trains finite."""
    first, fixed = _traced_and_fixed(tmp_path / "distill.py", DISTILL, symptom="non-finite losses 3")
    at = first["evidence"]["location"].split(" in ")[0]
    assert at.endswith(":19"), first["evidence"]
    assert first["fix"].startswith("Write torch.softmax(x, dim) instead of exp(x) / exp(x).sum(dim) at line 19")
    assert "line 20 overflows too, in log(exp(x).sum(dim)): write torch.logsumexp(x, dim) there" in first["fix"]
    assert "line 21 writes log(exp(x).sum(dim)) too, finite in this step" in first["fix"], first["fix"]
    assert "make the same change" not in first["fix"], first["fix"]
    assert first["evidence"]["forms_at"][at[:-2] + "21"]["overflowed"] is False
    assert "non-finite losses 0" in fixed.stderr
    # checked on the step's loss: the forms at lines 19 and 20 put in place, the ops down to the loss re-run
    trial = first["fix_trial"]
    assert trial["metric"].startswith("the step's loss") and trial["before"] == "nan", trial
    printed = float(fixed.stderr.split("first loss ")[1].split()[0])
    assert abs(trial["after"] - printed) <= 1e-2 * abs(printed), (trial, printed)
    assert "On the step's loss: with these together (torch.softmax(x, dim) at line 19" in first["fix"]
    confident = subprocess.run(
        [sys.executable, str(tmp_path / "distill.py"), "--fix", "--confident"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert "non-finite losses 0" in confident.stderr, confident.stderr


ATTENTION = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            scores = q @ k.transpose(-2, -1)
            if FIX:
                w = torch.softmax(scores, -1)
            else:
                w = torch.exp(scores)
                w = w / w.sum(-1, keepdim=True)
            return self.out(w @ v)

    torch.manual_seed(0)
    model = nn.Sequential(Attention(), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    bad = 0
    for step in range(3):
        x = (2 * torch.randn(8, 16, 32)).half()
        loss = model(x).float().pow(2).mean()
        bad += not bool(torch.isfinite(loss))
        opt.zero_grad(); loss.backward(); opt.step()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_an_attention_softmax_by_hand_gets_torch_softmax_and_then_trains(tmp_path: Path) -> None:
    """Self-attention in fp16 with its softmax by hand (exp, then divided by its sum) and unscaled
    scores: exp overflows, Inf / Inf is NaN. The fix is torch.softmax, checked on the scores the exp
    read and on them scaled to fp16's range (exp in fp32 overflows there); applied as printed it trains."""
    first, fixed = _traced_and_fixed(tmp_path / "attention.py", ATTENTION, symptom="non-finite losses 3")
    assert first["fix"].startswith("Write torch.softmax(x, dim) instead of exp(x) / exp(x).sum(dim) at lines 16-17")
    assert "non-finite losses 0" in fixed.stderr


MIXTURE = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    # a mixture's log-likelihood by hand in fp16: 512 components whose log-weights reach ~9, so each exp
    # stays finite (exp(9) = 8103) while their sum passes fp16's 65504
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 512)).half()
    with torch.no_grad():
        net[2].bias.fill_(8.0)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    bad, first = 0, None
    for step in range(12):
        x = torch.randn(32, 16).half()
        scores = net(x)
        if FIX:
            total = torch.logsumexp(scores, -1)
        else:
            total = torch.log(torch.exp(scores).sum(-1))
        loss = -(total - scores[:, 0]).mean()
        first = float(loss) if first is None else first
        bad += not torch.isfinite(loss).item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("non-finite losses", bad, "first loss", first, file=sys.stderr)
    """
)


def test_a_log_sum_exp_by_hand_whose_sum_overflows_before_its_exps_gets_logsumexp_once(tmp_path: Path) -> None:
    """The exps stay finite and their sum overflows: the first Inf is the sum's. Its fix was the sum in
    fp32 (.sum(dtype=torch.float32)), which leaves the exps to overflow a few steps later; the composite
    is the same, and its stable form is the fix, said once (not again for the Inf zeroed in its backward)."""
    script = tmp_path / "mixture.py"
    first, fixed = _traced_and_fixed(script, MIXTURE, symptom="non-finite losses 12")
    assert first["where"]["op"].startswith("aten.sum"), first["where"]
    assert first["fix"].startswith("Write torch.logsumexp(x, dim) instead of log(exp(x).sum(dim))"), first["fix"]
    assert "non-finite losses 0" in fixed.stderr, fixed.stderr
    findings = json.loads(script.with_suffix(".json").read_text())["findings"]
    same = [f for f in findings if f["fix"] == first["fix"]]
    assert len(same) == 1, [(f["name"], f["message"][:80]) for f in findings]


INFONCE = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    # a contrastive loss by hand at temperature 0.01: exp(sim / T) reaches e^100, past fp32's range too;
    # the positives are picked from the diagonal of the exps before the division
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32)).half()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    bad = 0
    for step in range(6):
        x = torch.randn(64, 16).half()
        z1 = F.normalize(net(x), dim=-1)
        z2 = F.normalize(net(x + 0.01 * torch.randn_like(x)), dim=-1)
        if FIX:
            loss = -F.log_softmax(z1 @ z2.t() / 0.01, dim=1).diag().float().mean()
        else:
            sim = torch.exp(z1 @ z2.t() / 0.01)
            p = sim.diag() / sim.sum(dim=1)
            loss = -torch.log(p).float().mean()
        bad += not torch.isfinite(loss).item()
        opt.zero_grad(); loss.backward(); opt.step()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


@pytest.mark.parametrize("picked", ["after the exp", "before the exp"])
def test_a_contrastive_softmax_by_hand_whose_positives_are_picked_gets_log_softmax_then_the_pick(
    tmp_path: Path, picked: str
) -> None:
    """exp(s).diag() / exp(s).sum(1): the pick (diagonal) between the exp and the division is passed
    over, the form is the softmax's log, and fp32 is said to overflow too (e^100): the fix as printed,
    F.log_softmax(...).diag(), trains. The same where the code takes the diagonal first, exp(s.diag()) /
    exp(s).sum(1), as a CLIP loss is often written."""
    source = INFONCE
    if picked == "before the exp":
        source = source.replace(
            "sim = torch.exp(z1 @ z2.t() / 0.01)\n        p = sim.diag() / sim.sum(dim=1)",
            "s = z1 @ z2.t() / 0.01\n        p = torch.exp(s.diag()) / torch.exp(s).sum(dim=1)",
        )
        assert "torch.exp(s.diag())" in source
    first, fixed = _traced_and_fixed(tmp_path / "infonce.py", source, symptom="non-finite losses 6")
    assert first["fix"].startswith("Write F.log_softmax(x, dim) instead of log(exp(x) / exp(x).sum(dim))"), first["fix"]
    assert "then take its diagonal as your code does" in first["fix"]
    assert "more precision is no fix" in first["fix"]
    assert "non-finite losses 0" in fixed.stderr


GATHERED = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    # a cross-entropy by hand in fp16 whose target's probability is gathered before the division
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)).half()
    with torch.no_grad():
        net[2].weight.mul_(40.0)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    bad = 0
    for step in range(6):
        x, y = torch.randn(32, 16).half(), torch.randint(0, 10, (32,))
        logits = net(x)
        if FIX:
            loss = -F.log_softmax(logits, dim=-1).gather(1, y[:, None]).float().mean()
        else:
            e = torch.exp(logits)
            loss = -torch.log(e.gather(1, y[:, None]) / e.sum(-1, keepdim=True)).float().mean()
        bad += not torch.isfinite(loss).item()
        opt.zero_grad(); loss.backward(); opt.step()
    print("non-finite losses", bad, file=sys.stderr)
    """
)


def test_a_cross_entropy_by_hand_that_gathers_the_targets_probability_gets_log_softmax_then_the_gather(
    tmp_path: Path,
) -> None:
    first, fixed = _traced_and_fixed(tmp_path / "gathered.py", GATHERED, symptom="non-finite losses 6")
    assert first["fix"].startswith("Write F.log_softmax(x, dim) instead of log(exp(x) / exp(x).sum(dim))"), first["fix"]
    assert "then take its gather as your code does" in first["fix"]
    assert "non-finite losses 0" in fixed.stderr


SMOOTHED = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    # a label-smoothed cross-entropy by hand in fp16: probabilities, then their log on the next line
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)).half()
    with torch.no_grad():
        net[2].weight.mul_(40.0)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for step in range(4):
        x, y = torch.randn(32, 16).half(), torch.randint(0, 10, (32,))
        target = torch.full((32, 10), 0.01).half().scatter(1, y[:, None], 0.91)
        logits = net(x)
        probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
        loss = -(target * torch.log(probs)).sum(-1).float().mean()
        opt.zero_grad(); loss.backward(); opt.step()
    """
)


def test_the_inf_and_the_nan_of_one_softmax_by_hand_then_its_log_print_one_fix(tmp_path: Path) -> None:
    """exp overflows (the first Inf), Inf / Inf is NaN (the first NaN), the log a line later completes
    the form: both findings print log_softmax over both lines, the fix their shared check tried."""
    script = tmp_path / "smoothed.py"
    script.write_text(SMOOTHED)
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    produced = [f for f in json.loads(report.read_text())["findings"] if f["name"] == "nonfinite-produced"]
    assert len(produced) >= 2, [f["title"] for f in produced]
    for f in produced[:2]:
        assert f["fix"].startswith("Write F.log_softmax(x, dim) instead of log(exp(x) / exp(x).sum(dim))"), f["fix"]
