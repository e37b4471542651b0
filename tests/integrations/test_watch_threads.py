"""Two models trained in worker threads at once under `fpdoctor watch` (a service that trains in the
background): one makes an Inf at its log by a cross-entropy written by hand, and each bad step is
replayed under trace, whose hooks come and go while the other thread steps. torch iterates its global
optimizer-hook dicts at every step of every thread: a dict changed under that iteration raises
"OrderedDict mutated during iteration" in the other thread's `opt.step()`. Neither thread is ever
killed by the watch and the healthy one trains to the end. The watch judges the thread that trained
first (the other's forwards, backward and steps, interleaved with its own, would be judged as its):
its cause is named, no machine is blamed, and the report says the other thread was not checked."""

from __future__ import annotations

import json

from tests.conftest import run_fpdoctor

SCRIPT = """
import threading
import torch
from torch import nn

torch.set_num_threads(1)


def mlp(n_in):
    return nn.Sequential(nn.Linear(n_in, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


first_step = threading.Event()


def clicks(steps):
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    x = torch.randn(4096, 32, generator=gen)
    y = (x[:, :4].sum(1) > 0).float()
    model = mlp(32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(steps):
        idx = torch.randint(0, 4096, (128,), generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = torch.sigmoid(model(x[idx]).squeeze(-1))
            loss = -(y[idx] * torch.log(p) + (1 - y[idx]) * torch.log(1 - p)).mean()
        loss.backward()
        opt.step()
        first_step.set()
    print("clicks done", flush=True)


def demand(steps):
    first_step.wait()
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    x = torch.randn(4096, 16, generator=gen)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
    model = mlp(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        idx = torch.randint(0, 4096, (128,), generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(x[idx]).squeeze(-1)
        loss = nn.functional.mse_loss(pred.float(), y[idx])
        loss.backward()
        opt.step()
    print("demand done", flush=True)


workers = [threading.Thread(target=clicks, args=(200,)), threading.Thread(target=demand, args=(600,))]
for w in workers:
    w.start()
for w in workers:
    w.join()
"""


def test_threads_that_train_at_once_are_never_killed_by_the_watch(tmp_path):
    script = tmp_path / "service.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", "python", str(script), timeout=300)
    assert "Exception in thread" not in result.err and "mutated during iteration" not in result.err, result.err
    assert "clicks done" in result.out and "demand done" in result.out, (result.out, result.err)
    data = json.loads(report.read_text())
    findings = data["findings"]
    said = [(f["code"], f["title"]) for f in findings]
    assert findings[0]["name"] == "nonfinite-produced" and "aten.log" in findings[0]["title"], said
    assert not any(f["name"] in ("transient-fault-suspected", "update-departs-from-reference") for f in findings), said
    assert "training in thread 'Thread-2 (demand)'" in data["data"]["not_checked"], data["data"]


def test_the_scripts_own_global_optimizer_hooks_come_and_go_as_they_would_without_the_watch(tmp_path):
    """While the watch is on, torch's hook dicts are read as snapshots through views of them: a hook
    the script registered before and removes inside stops firing at once, one it registers inside and
    removes after is gone, and torch's own dicts are in place after."""
    import torch
    from torch import nn
    from torch.optim import optimizer as optimizer_mod

    import fpdoctor

    fired: list[str] = []
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()

    tables = (optimizer_mod._global_optimizer_pre_hooks, optimizer_mod._global_optimizer_post_hooks)
    sizes = [len(t) for t in tables]
    before = optimizer_mod.register_optimizer_step_pre_hook(lambda *a: fired.append("before"))
    with fpdoctor.watch(report=str(tmp_path / "watch.json")):
        train(2)
        before.remove()
        fired.clear()
        train(2)
        assert fired == []  # removed inside: no more calls
        inside = optimizer_mod.register_optimizer_step_pre_hook(lambda *a: fired.append("inside"))
        train(1)
        assert fired == ["inside"]
    inside.remove()
    fired.clear()
    train(2)
    assert fired == []  # removed after: gone
    assert optimizer_mod._global_optimizer_pre_hooks is tables[0]  # torch's own dicts, in place again
    assert optimizer_mod._global_optimizer_post_hooks is tables[1]
    assert [len(t) for t in tables] == sizes


SEQUENTIAL = """
import threading
import torch
from torch import nn

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(1)
torch.manual_seed(1)
x = torch.randn(4096, 32, generator=gen)
y = (x[:, :4].sum(1) > 0).float()
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
print("output shape", tuple(model(x[:2]).shape))  # a sanity forward in the main thread, gradients on


def trial(bad, steps=150):
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(steps):
        idx = torch.randint(0, 4096, (128,), generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x[idx]).squeeze(-1)
            if bad:
                p = torch.sigmoid(out)
                loss = -(y[idx] * torch.log(p) + (1 - y[idx]) * torch.log(1 - p)).mean()
            else:
                loss = nn.functional.binary_cross_entropy_with_logits(out.float(), y[idx])
        loss.backward()
        opt.step()


for bad in (False, True):  # a sweep: one trial after another, a thread each
    worker = threading.Thread(target=trial, args=(bad,))
    worker.start()
    worker.join()
    print("trial done", bad, flush=True)
"""


def test_trials_run_one_after_another_in_threads_are_each_judged(tmp_path):
    """The thread judged is the first to step an optimizer (a forward in the main thread does not
    claim it), and the next to step once that one has ended: the second trial's NaN is named."""
    script = tmp_path / "sweep.py"
    script.write_text(SEQUENTIAL)
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", "python", str(script), timeout=300)
    assert "Exception in thread" not in result.err and "trial done True" in result.out, result.err
    data = json.loads(report.read_text())
    said = [(f["code"], f["title"]) for f in data["findings"]]
    assert any(f["name"] == "deterministic-nonfinite" for f in data["findings"]), said
    assert not any(k.startswith("training in thread") for k in data["data"].get("not_checked", {})), data["data"]


def test_a_run_whose_other_training_thread_was_not_judged_is_never_ok(tmp_path):
    """The healthy model steps first and is the thread judged; the broken one trains beside it: the
    report finds nothing in the thread it judged, and says "not checked", never OK, naming the other."""
    script = tmp_path / "service.py"
    source = SCRIPT.replace("def clicks(steps):\n    gen", "def clicks(steps):\n    first_step.wait()\n    gen")
    source = source.replace("def demand(steps):\n    first_step.wait()\n    gen", "def demand(steps):\n    gen")
    source = source.replace("        opt.step()\n        first_step.set()\n", "        opt.step()\n")
    source = source.replace(
        '        opt.step()\n    print("demand done", flush=True)',
        '        opt.step()\n        first_step.set()\n    print("demand done", flush=True)',
    )
    assert source.count("first_step.wait()") == 1 and source.count("first_step.set()") == 1
    script.write_text(source)
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", "python", str(script), timeout=300)
    assert "clicks done" in result.out and "demand done" in result.out, (result.out, result.err)
    data = json.loads(report.read_text())
    assert not [f for f in data["findings"] if f["severity"] != "info"], [f["title"] for f in data["findings"]]
    assert data["data"]["status"] == "not checked", data["data"]
    assert "training in thread 'Thread-1 (clicks)'" in data["data"]["not_checked"], data["data"]["not_checked"]
