"""compare, plan, audit and harmonize leave what the user owns as it was: every module's own
train/eval flag, the RNG, attributes on modules and tensors, the inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.norm(self.lin(x)))
        with torch.no_grad():  # a running average kept in place: an op whose output is the user's buffer
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Block(), nn.GELU(), nn.Linear(8, 4)).train()
    model[1].norm.eval()  # a frozen BatchNorm inside a model that trains
    return model


def _flags(model: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def _attributes(model: nn.Module, *tensors: torch.Tensor) -> list[object]:
    modules = [(name, sorted(vars(m))) for name, m in model.named_modules()]
    owned = [*model.parameters(), *model.buffers(), *tensors]
    return [modules, [sorted(vars(t)) for t in owned]]


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(lambda m, x: fpdoctor.compare(m, x, candidate="fp16"), id="compare"),
        pytest.param(lambda m, x: fpdoctor.compare(m, x, candidate="bf16", module="1"), id="compare-module"),
        pytest.param(lambda m, x: fpdoctor.plan(m, x, candidate="fp16"), id="plan"),
        pytest.param(fpdoctor.audit, id="audit"),
        pytest.param(lambda m, x: fpdoctor.audit(m.half(), x), id="audit-mismatch"),
    ],
)
def test_every_modules_own_flag_the_rng_and_attributes_are_left_as_they_were(run):
    model, x = _model(), torch.randn(16, 8)
    flags, attributes, rng = _flags(model), _attributes(model, x), torch.get_rng_state()
    x_before = x.clone()
    run(model, x)
    assert _flags(model) == flags  # the frozen BatchNorm is still in eval, the rest still trains
    assert _attributes(model, x) == attributes
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, x_before)


def test_audit_tags_no_tensor_it_sees():
    """Where an operand came from lives in audit's own side table: the user's buffer (updated in
    place, so an op's output), parameters and inputs carry no attribute afterwards."""
    model, x = _model(), torch.randn(16, 8)
    fpdoctor.audit(model, x)
    for t in [*model.parameters(), *model.buffers(), x]:
        assert vars(t) == {}, vars(t)


def test_audit_still_traces_a_dtype_through_the_users_buffer():
    """The side table still follows an odd dtype through op outputs: a float64 running buffer
    folded into the activations is named as the source of the mismatch."""

    class Drifts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.out = nn.Linear(8, 4)
            self.register_buffer("shift", torch.zeros(8, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.lin(x) + self.shift)

    finding = fpdoctor.audit(Drifts(), torch.randn(2, 8)).report.by_name("dtype-mismatch")[0]
    assert finding.evidence["entered_at"] == "buffer shift"
    assert finding.fix.startswith("model.to(torch.float32)")


def test_harmonize_changes_only_dtype_and_device():
    model = _model()
    flags, rng = _flags(model), torch.get_rng_state()
    names = [(name, sorted(vars(m))) for name, m in model.named_modules()]
    fpdoctor.harmonize(model, "cpu", dtype=torch.bfloat16)
    assert _flags(model) == flags and torch.equal(torch.get_rng_state(), rng)
    assert [(name, sorted(vars(m))) for name, m in model.named_modules()] == names
    assert model[0].weight.dtype == torch.bfloat16


class _ScalesItsInput(nn.Module):
    """Writes into its input, as image models do with `x.div_(255)`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.lin(x)


@pytest.mark.parametrize(
    ("run", "dtype"),
    [
        pytest.param(lambda m, x: fpdoctor.compare(m, x, candidate="fp32"), torch.float32, id="compare-fp32"),
        pytest.param(lambda m, x: fpdoctor.compare(m, x, candidate="fp16", module="lin"), torch.float32, id="module"),
        pytest.param(lambda m, x: fpdoctor.plan(m, x, candidate="fp16"), torch.float16, id="plan-fp16-inputs"),
        pytest.param(fpdoctor.audit, torch.float32, id="audit"),
    ],
)
def test_a_forward_that_writes_into_its_input_leaves_the_users_tensor_alone(run, dtype):
    torch.manual_seed(0)
    model, x = _ScalesItsInput(), torch.randn(16, 8).to(dtype)
    before = x.clone()
    run(model, x)
    assert torch.equal(x, before)


def test_every_pass_of_compare_sees_the_same_input_when_the_forward_writes_into_it():
    torch.manual_seed(0)
    model, x = _ScalesItsInput(), torch.randn(16, 8)
    first = fpdoctor.compare(model, x, candidate="fp32")
    again = fpdoctor.compare(model, x, candidate="fp32")
    assert [r.propagated for r in first.rows] == [r.propagated for r in again.rows]
    assert first.first_divergent is None


_CUDA_DRAWS = """
import sys
import torch
from torch import nn
import fpdoctor

class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 0.01 * torch.randn_like(x)

torch.manual_seed(0)  # CUDA is not started yet: torch applies the seed when it starts
model, x = Noisy(), torch.randn(4, 8)
if sys.argv[1] == "compare":
    fpdoctor.compare(model, x, candidate="fp32", device="cuda")
print(torch.randn(4, device="cuda").tolist())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compare_on_cuda_leaves_the_cuda_rng_where_the_users_seed_put_it(tmp_path):
    """In a fresh process, so that CUDA starts inside compare: the user's next CUDA draws are the
    ones they would have been without it."""
    import subprocess
    import sys

    script = tmp_path / "draws.py"
    script.write_text(_CUDA_DRAWS)

    def draws(mode: str) -> str:
        argv = [sys.executable, str(script), mode]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip().splitlines()[-1]

    assert draws("compare") == draws("plain")
