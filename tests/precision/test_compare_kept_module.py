"""`compare` where a module with no parameters of its own diverges (a peak-hold envelope follower: its decay,
0.9995, rounds to 1 in bf16 and the envelope never falls): the fix "keep `envelope` in fp32" was printed
untried, and the obvious reading of it, `model.envelope.float()`, changes nothing on a module that holds no
parameters. The fix now says how (its inputs .float(), its output cast back) and is checked by a run of the
model with the module in fp32; applied as printed, the error at the longest input falls and no longer grows."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fpdoctor


class Envelope(nn.Module):
    """A peak-hold envelope follower (no parameters): holds the largest |x| and lets it decay slowly."""

    def __init__(self, decay: float = 0.9995) -> None:
        super().__init__()
        self.decay = decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            env = torch.maximum(x[:, t].abs(), env * self.decay)
            out.append(env)
        return torch.stack(out, 1)


class Meter(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.inp = nn.Linear(4, 8)
        self.envelope = Envelope()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        e = self.envelope(h.float()).to(h.dtype) if self.fixed else self.envelope(h)
        return self.out(e)


def _bursts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    bursts = torch.randn(2, 2048, 4, generator=g) * (torch.rand(2, 2048, 1, generator=g) < 0.01)
    return [bursts[:, :256], bursts]


def _meter(fixed: bool) -> Meter:
    torch.manual_seed(0)
    return Meter(fixed).eval()


def test_a_module_without_parameters_kept_in_fp32_is_checked_and_works_as_printed() -> None:
    result = fpdoctor.compare(_meter(False), _bursts(), candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "envelope", first
    assert "self.envelope(x.float()).to(x.dtype)" in first.fix, first.fix
    assert "it holds no parameters" in first.fix and "load_state_dict" not in first.fix and "p.dtype" not in first.fix
    trial = first.trial
    assert trial is not None and trial.tried and trial.after * 4 <= trial.before, trial

    fixed = fpdoctor.compare(_meter(True), _bursts(), candidate="bf16")  # as printed
    assert not [f for f in fixed.report.findings if f.severity == "error"], fixed.report.findings
    assert "error_grows_with_input_size" not in fixed.report.data
    assert fixed.rows[-1].propagated * 4 <= result.rows[-1].propagated


class Memory(nn.Module):
    """A 2-layer GRU whose update gates open slowly (biases near log(T): units that keep their state for
    hundreds of steps, as a chrono initialisation sets them): in bf16 the gate's sigmoid rounds to 1
    and those units never update. `fixed`: the GRU kept in fp32 as compare prints it, its input cast
    to its parameters' dtype (a fixed .float() broke the model's fp64 run: compare refused the fix)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.inp, self.rnn, self.head = (
            nn.Linear(3, 32),
            nn.GRU(32, 64, num_layers=2, batch_first=True),
            nn.Linear(64, 2),
        )
        with torch.no_grad():
            for name, b in self.rnn.named_parameters():
                if name.startswith("bias"):
                    b.zero_()
                if name.startswith("bias_ih"):
                    b[64:128] = torch.log(torch.linspace(2.0, 1500.0, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        if self.fixed:  # as printed
            p = next(self.rnn.parameters())
            h = torch.utils._pytree.tree_map(
                lambda t: t.to(x.dtype) if torch.is_tensor(t) and t.is_floating_point() else t, self.rnn(x.to(p.dtype))
            )[0]
        else:
            h, _ = self.rnn(x)
        return self.head(h)


def test_a_recurrent_module_kept_in_fp32_as_printed_runs_in_every_precision() -> None:
    torch.manual_seed(0)
    model = Memory().eval()
    x = torch.randn(2, 2048, 3, generator=torch.Generator().manual_seed(1))
    first = fpdoctor.compare(model, x, candidate="bf16").report.findings[0]
    assert first.where["module"] == "rnn" and "`model.get_submodule('rnn').float().load_state_dict(saved)`" in first.fix
    assert "self.rnn(x.to(p.dtype))" in first.fix and first.trial is not None and first.trial.tried

    fixed = Memory(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        copy.deepcopy(fixed).double()(x.double())  # the fp64 run compare makes of the changed model: it runs
        kept = copy.deepcopy(fixed)
        saved = {k: v.clone() for k, v in kept.get_submodule("rnn").state_dict().items()}  # as printed
        kept.to(torch.bfloat16)
        kept.get_submodule("rnn").float().load_state_dict(saved)
        out = kept(x.to(torch.bfloat16))
    rel = float((out.double() - exact).norm() / exact.norm())
    assert rel <= 1.05 * float(first.trial.after), (rel, first.trial.after)
