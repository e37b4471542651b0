"""A candidate the user makes from the model (`candidate=fn`, `--candidate file.py:fn`): int8 dynamic
quantization whose one layer reads a few outlier channels, a language model's head quantized, a layer
swapped for a low-rank approximation. The relative error stays modest while the decisions change:
compare judges them against fp64 beside the fp32 model's own, names the modules to leave out of the
transform, checked, and the fix applied as printed (quantize_dynamic's qconfig_spec) gives the
decisions back. A transform that costs nothing is OK, and says what it judged."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
from torch import nn
from torch.ao.quantization import quantize_dynamic

import fpdoctor
from fpdoctor.precision.decide import top1
from tests.conftest import run_fpdoctor
from tests.precision.factories import loads_strict

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")


class Intent(nn.Module):
    """A ticket classifier whose middle layer reads a few feature channels 40x the others (outliers)."""

    def __init__(self, outliers: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 12)
        if outliers:
            with torch.no_grad():
                self.fc1.weight[:4] *= 40.0
                self.fc1.bias[:4] += 30.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def int8(model: nn.Module) -> nn.Module:
    return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def _agreement(model: nn.Module, quantized: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        got = top1(model.double()(x.double()), quantized(x))
    assert got is not None
    return got


def test_int8_that_changes_the_decisions_names_the_layer_and_its_qconfig_spec_gives_them_back() -> None:
    model, x = Intent().eval(), torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model, x, candidate=int8)
    report = result.report
    assert report.verdict == "error", str(report)
    (found,) = report.findings
    assert found.name == "decisions-changed" and found.trial is not None and found.trial.tried, found
    spec = re.search(r"quantize_dynamic\(model, (\{.*?\}), dtype=torch\.qint8\)", found.fix)
    assert spec is not None, found.fix
    assert "fc2" not in spec.group(1)  # the layer that reads the outliers stays float
    rows = dict(report.data["summary"])
    assert (
        "DynamicQuantized" in str(report.data["transformed"])
        or "quantized.dynamic" in rows["modules the transform changed"]
    )
    # as printed: quantize_dynamic with that qconfig_spec
    before = _agreement(model, int8(Intent().eval()), x)
    after = _agreement(model, quantize_dynamic(Intent().eval(), ast.literal_eval(spec.group(1)), dtype=torch.qint8), x)
    assert after > before and after >= 0.99, (before, after, found.trial)


def test_leaving_out_every_module_the_transform_changed_is_never_printed_as_its_fix() -> None:
    """Only the layer that reads the outliers is quantized: putting it back gives the decisions back, and
    leaves nothing quantized. That is no fix of the transform: the next step is a milder one."""
    model, x = Intent().eval(), torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))

    def only_fc2(m: nn.Module) -> nn.Module:
        return quantize_dynamic(m, {"fc2"}, dtype=torch.qint8)

    found = fpdoctor.compare(model, x, candidate=only_fc2).report.findings[0]
    assert found.name == "decisions-changed" and not found.fix.startswith("Leave"), found.fix
    assert "leaves nothing transformed" in found.fix and "per-channel scales" in found.fix, found.fix
    assert found.trial is not None and not found.trial.tried, found.trial


class TinyLM(nn.Module):
    """Token ids in, next-token logits out over a vocabulary; its head reads a hidden state with an
    outlier dimension (what LLM activations have), which per-tensor int8 rounds the rest of away."""

    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab)
        with torch.no_grad():
            self.mix.weight[0] *= 60.0  # one hidden dimension 60x the others

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))) * torch.tensor([8.0] + [1.0] * 63))


def test_a_language_models_int8_is_judged_by_its_next_token_decisions() -> None:
    model = TinyLM().eval()
    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(2))
    result = fpdoctor.compare(model, ids, candidate=int8)
    decisions = result.report.data["decisions"]
    assert decisions["rows"] == 16 * 64 and decisions["classes"] == 256, decisions
    if result.report.verdict == "ok":  # the premise: int8 changes the next token somewhere
        pytest.fail(f"int8 kept every decision: {decisions}")
    (found,) = result.report.findings
    assert found.name == "decisions-changed" and found.where["module"] in ("head", "mix"), found
    assert found.trial is not None and found.trial.tried


class LowRank(nn.Module):
    """A Linear approximated by two smaller ones (rank r): a compression of the user's own."""

    def __init__(self, linear: nn.Linear, rank: int) -> None:
        super().__init__()
        u, s, v = torch.linalg.svd(linear.weight.detach(), full_matrices=False)
        self.down = nn.Linear(linear.in_features, rank, bias=False)
        self.up = nn.Linear(rank, linear.out_features)
        with torch.no_grad():
            self.down.weight.copy_(v[:rank] * s[:rank, None])
            self.up.weight.copy_(u[:, :rank])
            self.up.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def compress(model: nn.Module) -> nn.Module:
    model.fc1 = LowRank(model.fc1, 4)  # the layer whose rank the outliers need
    model.fc2 = LowRank(model.fc2, 128)  # full rank: the same layer in two factors
    return model


def test_a_transform_of_the_users_own_names_the_module_to_leave_out_checked() -> None:
    model, x = Intent().eval(), torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model, x, candidate=compress)
    (found,) = result.report.findings
    assert found.fix.startswith("Leave `fc1` out of compress"), found.fix
    assert found.trial is not None and found.trial.tried, found.trial


def test_a_transform_that_costs_nothing_is_ok_and_says_what_it_judged() -> None:
    def identity(model: nn.Module) -> nn.Module:
        return model

    result = fpdoctor.compare(Intent(outliers=False).eval(), torch.randn(256, 64), candidate=identity)
    assert result.report.verdict == "ok", str(result.report)
    rows = dict(result.report.data["summary"])
    assert rows["modules the transform changed"].startswith("none")
    assert "top-1 agreement 100.0%" in next(v for k, v in rows.items() if k.startswith("decisions"))


def test_a_function_that_returns_no_model_and_options_it_cannot_take_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="must return the model it made"):
        fpdoctor.compare(Intent().eval(), torch.randn(8, 64), candidate=lambda m: None)
    with pytest.raises(ValueError, match="takes no reference"):
        fpdoctor.compare(Intent().eval(), torch.randn(8, 64), candidate=int8, reference="fp64")


FACTORY = """
import torch
from torch import nn
from torch.ao.quantization import quantize_dynamic
INTENT

def make():
    return Intent().eval(), torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))

def quantize(model):
    return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
"""


def test_the_command_line_takes_a_function_as_the_candidate(tmp_path) -> None:
    (tmp_path / "deploy.py").write_text(FACTORY.replace("INTENT", inspect.getsource(Intent)))
    done = run_fpdoctor("compare", "deploy.py:make", "--candidate", "deploy.py:quantize", cwd=tmp_path)
    assert done.code == 1, done.err[-2000:]
    assert "NUM018" in done.out and "quantize_dynamic(model, {" in done.out, done.out[-2000:]
    refused = run_fpdoctor("compare", "deploy.py:make", "--candidate", "deploy.py:quantize", "--reference", "fp64",
                           cwd=tmp_path)  # fmt: skip
    assert refused.code == 2 and "takes no --reference" in refused.err and len(refused.err.strip().splitlines()) == 1
    missing = run_fpdoctor("compare", "deploy.py:make", "--candidate", "deploy.py:nothing", cwd=tmp_path)
    assert missing.code == 2 and "has no function 'nothing'" in missing.err
    plan = run_fpdoctor("plan", "deploy.py:make", "--candidate", "deploy.py:quantize", cwd=tmp_path)
    assert plan.code == 2 and "fpdoctor compare deploy.py:make --candidate deploy.py:quantize" in plan.err, plan.err


def test_a_transform_that_draws_random_numbers_leaves_the_callers_rng_as_it_was() -> None:
    def prune(model: nn.Module) -> nn.Module:  # a random 10% of each weight set to 0
        with torch.no_grad():
            for p in model.parameters():
                p.mul_((torch.rand_like(p) > 0.1).to(p.dtype))
        return model

    model = Intent(outliers=False).eval()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    result = fpdoctor.compare(model, torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), candidate=prune)
    assert torch.equal(torch.get_rng_state(), before)
    assert "none (no module's class changed" in dict(result.report.data["summary"])["modules the transform changed"]


def test_the_error_of_an_output_larger_than_the_sample_is_the_whole_outputs() -> None:
    """An output of more values than the strided sample (16 x 64 x 256 logits): the error is measured on
    the sample against the sample's own norm, as on the whole output."""
    model = TinyLM().eval()
    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(2))
    result = fpdoctor.compare(model, ids, candidate=int8)
    rel = result.report.data["end_to_end"]["rel"]
    with torch.no_grad():
        truth, got = model.double()(ids), int8(TinyLM().eval())(ids).double()
    whole = float((got - truth).norm() / truth.norm())
    assert 0.5 * whole < rel < 2 * whole, (rel, whole)
    assert "quantized.dynamic" in result.report.data["transformed"]["modules"][0]["to"]


class PerTensorFp8(nn.Module):
    """A Linear whose weight is stored in fp8 e4m3 with one scale for the whole tensor, as written by hand."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.scale = w.abs().max() / 448
        self.w8 = (w / self.scale).to(torch.float8_e4m3fn)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.w8.to(x.dtype) * self.scale.to(x.dtype), self.bias.to(x.dtype))


def fp8_per_tensor(model: nn.Module) -> nn.Module:
    for name in ("fc1", "fc2", "head"):
        setattr(model, name, PerTensorFp8(getattr(model, name)))
    return model


def test_a_per_tensor_fp8_scale_set_by_one_outlier_column_is_left_out_with_what_it_keeps_said() -> None:
    model = Intent(outliers=False)
    with torch.no_grad():  # one input column of fc2 far larger, what feeds it smaller: the same function in fp32
        model.head.weight.mul_(4.0)
        model.fc2.weight[:, 0] *= 3e5
        model.fc1.weight[0] /= 3e5
        model.fc1.bias[0] /= 3e5
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model.eval(), x, candidate=fp8_per_tensor)
    (found,) = result.report.findings
    assert found.name == "decisions-changed" and found.trial is not None and found.trial.tried, found
    assert found.fix.startswith("Leave `fc2`"), found.fix  # the layer whose scale the outlier sets comes first
    total = sum(p.numel() for p in model.parameters())
    kept = [m for m in ("fc2", "head", "fc1") if f"`{m}`" in found.fix.split(":")[0]]
    held = sum(p.numel() for m in kept for p in getattr(model, m).parameters())
    assert f"({held:,} of the model's {total:,} parameters, {held / total:.0%})" in found.fix, found.fix
    if len(kept) > 1:  # the best of them alone beside it
        assert "alone: " in found.fix, found.fix


class _Tried:
    def __init__(self, tried: list[tuple[list[str], float]]) -> None:
        self.changed, self.tried = ["fc1", "fc2", "head"], tried


@pytest.mark.parametrize(
    ("tried", "floor", "chosen"),
    [
        # the pair takes a sliver more off than fc2 alone (1.7% of the rows still flipped against 1.8%): fc2
        ([(["fc2"], 0.982), (["fc1"], 0.902), (["head"], 0.903), (["fc2", "head"], 0.983)], 1.0, ["fc2"]),
        # the pair leaves far fewer flipped (3.8% against 6%): the pair
        ([(["fc2"], 0.940), (["fc1"], 0.545), (["head"], 0.550), (["fc2", "head"], 0.962)], 1.0, ["fc2", "head"]),
        # fc2 alone is not half the way back from 50% (26% still flipped), though near the pair's 24%: the pair
        ([(["fc2"], 0.74), (["fc1"], 0.52), (["head"], 0.51), (["fc2", "head"], 0.76)], 1.0, ["fc2", "head"]),
        # the fp32 model flips 3% itself: what the transform adds is 1.5% with fc2 alone, 0.8% with the pair
        ([(["fc2"], 0.955), (["fc1"], 0.60), (["head"], 0.60), (["fc2", "head"], 0.962)], 0.97, ["fc2", "head"]),
    ],
)
def test_a_partial_fix_keeps_the_fewest_modules_that_leave_about_what_the_best_run_leaves(tried, floor, chosen):
    from fpdoctor.precision.compare.transformed import _unless_everything

    before = 0.5  # the candidate's top-1
    run = _Tried([*tried, (["fc2", "head", "fc1"], 1.0)])
    kept, everything = _unless_everything(
        run,  # type: ignore[arg-type]
        ["fc2", "head", "fc1"],
        lambda v: 1 - v <= (1 - before) / 2,
        lambda v: max(floor - v, 0.0),
    )
    assert kept == chosen and everything == ["fc2", "head", "fc1"]


class Rescaled(Intent):
    """fc2 reads one channel 1e5x larger in its weight and 1e5x smaller in what feeds it (a per-channel gain
    before it, as a norm's learned scale folds into the next layer): the same function in fp32, and fc1's
    weight as it was."""

    def __init__(self) -> None:
        super().__init__(outliers=False)
        gain = torch.ones(128)
        gain[0] = 1 / 1e5
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.head.weight.mul_(4.0)
            self.fc2.weight[:, 0] *= 1e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)) * self.gain)))


def test_an_fp8_layer_whose_weight_the_scale_flushes_is_said_to_make_its_error_itself() -> None:
    """Not "amplified from its inputs": re-run alone on the fp64 inputs it makes the same error, and fp8's
    statistics of its weight say why (the row's note, the summary's "why errors move")."""
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(Rescaled().eval(), x, candidate="fp8-e4m3")
    record = next(m for m in loads_strict(result.report.to_json())["data"]["modules"] if m["module"] == "fc2")
    assert record["note"] == "its weight", record
    assert record["why"][0].startswith("its own weight: in float8_e4m3fn with one scale for the tensor"), record
    assert "amplified" not in dict(result.report.data["summary"]).get("why errors move", "")
