"""compare's compiled candidates: Inductor's fused fp32 intermediates told apart from a compiled
program that computes something else (a pass of the test's own that changes one op)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.names import CANDIDATES, check_name
from tests.numerics.compiled_faults import DriftAfterTanh


class Chain(nn.Module):
    """60 multiplications by 1.001: eager bf16 rounds each product back to its input (1.001 is
    below half a bf16 spacing), Inductor fuses them and rounds once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(60):
            x = x * 1.001
        return x


def test_spellings():
    assert check_name("compiled_bfloat16", CANDIDATES, "candidate") == "compiled-bf16"
    assert check_name("compiled-half", CANDIDATES, "candidate") == "compiled-fp16"
    with pytest.raises(ValueError, match="takes no module"):
        fpdoctor.compare(nn.Linear(2, 2), torch.ones(1, 2), candidate="compiled", module="x")


class Blocks(nn.Module):
    """Blocks in a ModuleList, which is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), Chain()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_fused_intermediates_where_eager_loses_it_say_eager_is_wrong_not_compiled():
    """Compiled departs from eager because eager rounds each product away and compiled does not (eager
    0.058 off fp64, compiled 0.0023): the finding said "Nothing is wrong" and advised
    emulate_precision_casts, which makes compiled as wrong as eager. It now says eager is the one that
    loses it, not to emulate its casts, and where to look: a warning, not an error."""
    torch.manual_seed(0)
    model = Blocks()
    result = fpdoctor.compare(model, torch.randn(4, 16), candidate="compiled-bf16")
    (finding,) = result.report.findings
    assert finding.name == "compiled-fused-precision" and finding.severity.value == "warning"
    assert finding.evidence["eager_broken"] and "Eager bfloat16 is the one that is wrong" in finding.message
    assert finding.fix.startswith("Do not set torch._inductor.config.emulate_precision_casts")
    assert "--candidate bf16" in finding.fix and finding.trial is not None and not finding.trial.tried
    assert finding.where["module"] == "blocks.1" and finding.evidence["path"] == ["<root>", "blocks.1"]
    evidence = finding.evidence
    assert evidence["ratio"] > 16 and evidence["emulated_departure_rel"] <= evidence["floor_rel"]
    # the compiled program is the closer one to fp64; eager's rounding of each product is the loss
    assert finding.evidence["compiled_rel"] < finding.evidence["eager_rel"] / 10
    assert result.report.exit_code == 0 and result.first_divergent is None
    judged = {j["module"]: j["departs"] for j in result.report.data["compiled"]}
    assert judged == {"<root>": True, "blocks.0": False, "blocks.1": True}
    # no compile of compare's is left in Dynamo's cache, to count towards the user's recompile limit
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    assert not _debug_get_cache_entry_list(Chain.forward.__code__)
    assert not _debug_get_cache_entry_list(Blocks.forward.__code__)


def test_a_pass_that_changes_an_op_is_an_error_naming_the_module():
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    with inductor_config.patch(post_grad_custom_post_pass=DriftAfterTanh()):
        result = fpdoctor.compare(model, torch.randn(4, 16), candidate="compiled-bf16")
    (finding,) = result.report.findings
    assert finding.name == "compiled-departure" and finding.severity.value == "error"
    assert finding.where["module"] == "1" and "`1`" in finding.message
    assert finding.evidence["emulated_departure_rel"] > 16 * finding.evidence["floor_rel"]
    # the pass runs in Inductor after the decompositions: they alone leave the module as eager computes it
    assert finding.evidence["decomposed_departure_rel"] <= 16 * finding.evidence["floor_rel"]
    assert "Inductor's lowering, fusion or a graph pass changes it" in finding.message
    assert result.first_divergent == "1" and result.report.exit_code == 1
    assert not inductor_config.emulate_precision_casts  # patched for one compile, never left set


class _HalfScores(nn.Module):
    """Scores sharpened in fp16 inside the forward (a memory saving): eager makes NaN; a fixed .float()
    after it makes the fp64 copy fail on a dtype mismatch."""

    def __init__(self, dtype_generic: bool) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 4)
        self.dtype_generic = dtype_generic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(1, 2)
        s = (s.half() * 5000.0).to(x.dtype) if self.dtype_generic else (s.half() * 5000.0).float()
        return self.o((torch.softmax(s, -1) @ x).mean(1))


@pytest.mark.parametrize("dtype_generic", [False, True])
def test_a_reference_that_fails_or_is_nan_eagerly_is_a_one_line_error_before_any_compile(dtype_generic):
    """A forward whose fp64 copy raises, or is NaN eagerly: compare --candidate compiled raised a
    traceback, or named a Linear with every ratio NaN and advised bisecting the compiler."""
    from fpdoctor.precision.profile import ReferenceFailed

    torch.manual_seed(0)
    model, x = _HalfScores(dtype_generic).eval(), torch.randn(4, 8, 16) * 4
    with pytest.raises(ReferenceFailed, match="NaN values in its fp64 run" if dtype_generic else "fails in the"):
        fpdoctor.compare(model, x, candidate="compiled")


class Scale(nn.Module):
    """x * 300 * 300 / 90000: past fp16's 65504 in eager, an fp32 intermediate compiled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 300.0
        y = y * 300.0
        return y / 90000.0


class Wrap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = Scale(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_eager_that_overflows_where_compiled_does_not_is_eager_s_to_fix():
    """Eager fp16 overflows (Inf), compiled keeps the fused intermediate in fp32: TRN013 said "a
    decomposition changes it" (an error) and pointed at compiled, whose output is the right one."""
    torch.manual_seed(0)
    result = fpdoctor.compare(Wrap(), torch.randn(4, 16), candidate="compiled-fp16")
    (finding,) = result.report.findings
    assert finding.name == "compiled-fused-precision" and finding.severity.value == "warning", finding
    assert finding.evidence["eager_broken"] and "its error against fp64 is non-finite" in finding.message
    assert finding.fix.startswith("Do not set torch._inductor.config.emulate_precision_casts")
