"""compare's op ranges: op outputs inside modules near the candidate's max, with the fp64 run's value."""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fpdoctor.numerics.trace.headroom import MAX_OP_FINDINGS
from fpdoctor.precision.candidates import make_run
from fpdoctor.precision.compare.first_overflow import first_overflow
from fpdoctor.precision.compare.near_limit import AT_RISK, OpRanges, findings, near_limit
from fpdoctor.precision.compare.passes import hooked
from fpdoctor.precision.metrics import flat_sample, l2_norm
from fpdoctor.preserve import RngState

FP16_MAX = 65504.0


class Attention(nn.Module):
    """Unscaled attention: the q·kᵀ scores, made in this forward, are the model's largest values."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # (batch, tokens, tokens)
        return torch.softmax(scores, dim=-1) @ self.v(x)


_SOURCE, _FIRST = inspect.getsourcelines(Attention.forward)
SCORES_LINE = _FIRST + next(n for n, text in enumerate(_SOURCE) if "scores =" in text)


def model_at(share: float) -> tuple[nn.Module, torch.Tensor]:
    """embed -> attn -> head, with the attention's scores at `share` of fp16's max in fp64."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), attn=Attention(), head=nn.Linear(64, 16)))
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        h = model.embed(x).double()
        attn = model.attn
        q, k = nn.functional.linear(h, attn.q.weight.double()), nn.functional.linear(h, attn.k.weight.double())
        top = float((q @ k.transpose(-1, -2)).abs().max())
        # scaling both weights (and zeroing the biases) scales the scores by factor**2
        factor = math.sqrt(share * FP16_MAX / top)
        for lin in (attn.q, attn.k):
            lin.weight.mul_(factor)
            lin.bias.zero_()
    return model, x


def passes(
    model: nn.Module, x: torch.Tensor, candidate: str = "fp16", busy: bool = False
) -> tuple[OpRanges, OpRanges, nn.Module, nn.Module]:
    """The fp64 pass and the candidate's, each hooked as compare hooks them, with op ranges.
    `busy`: the hook callbacks do what compare's do (samples, errors, an isolated re-run)."""
    rng = RngState.capture()
    truth_run, cand_run = make_run(model, "fp64").eval(), make_run(model, candidate).eval()
    cand_modules = dict(cand_run.named_modules())
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[candidate]

    def pre(name, index, mod, args, kwargs):
        if busy:
            flat_sample((args, kwargs))

    def post(name, index, args, output):
        if busy:
            l2_norm(flat_sample(output))

    def truth_post(name, index, args, output):
        post(name, index, args, output)
        if busy and name == "attn":  # the candidate's copy of the module re-run on the fp64 inputs
            cand_modules[name](*(a.to(dtype) for a in args))

    # fp16: the candidate's recorder as compare wires it, taking the outputs that are judged;
    # bf16 (not wired): every floating output, to show that a bf16 range is no risk
    truth, cand = OpRanges(), OpRanges(AT_RISK) if candidate == "fp16" else OpRanges()
    with truth:
        hooked(truth_run, x, torch.float64, pre=truth.pre(pre), post=truth.post(truth_post), rng=rng)
    with cand:
        hooked(cand_run, x, dtype, pre=cand.pre(pre), post=cand.post(post), rng=rng)
    return truth, cand, truth_run, cand_run


def test_scores_at_62_percent_are_named_with_the_fp64_runs_value_and_their_line():
    truth, cand, _, _ = passes(*model_at(0.62))
    rows = near_limit(cand.read(), truth.read())
    assert [(r["module"], r["op"], r["call"], r["occurrence"]) for r in rows] == [("attn", "aten.bmm.default", 0, 0)]
    (finding,) = findings(rows, label="fp16")
    assert finding.name == "overflow-risk" and finding.severity.value == "warning"
    assert finding.where == {
        "module": "attn", "op": "aten.bmm.default", "phase": "forward", "iteration": 1,
        "file": __file__, "line": SCORES_LINE,
    }  # fmt: skip
    e = finding.evidence
    assert e["target"] == "fp16" and e["candidate"] == "fp16" and e["dtype"] == "torch.float16"
    assert e["reference"] == "fp64" and e["reference_absmax"] == pytest.approx(0.62 * FP16_MAX, rel=1e-6)
    assert e["absmax"] == pytest.approx(0.62 * FP16_MAX, rel=2e-3) and 0.61 < e["share"] < 0.63
    assert e["shape"] == [2, 16, 16] and e["numel"] == 512 and e["location"].startswith(f"{__file__}:{SCORES_LINE}")
    assert "in the fp16 run" in finding.message and "in the fp64 run" in finding.message


def test_an_overflow_at_110_percent_is_first_overflows_not_a_near_limit_finding():
    model, x = model_at(1.10)
    truth, cand, truth_run, cand_run = passes(model, x)
    scores = next(r for r in truth.read() if (r.module, r.op, r.occurrence) == ("attn", "aten.bmm.default", 0))
    assert scores.absmax == pytest.approx(1.10 * FP16_MAX, rel=1e-6)
    # in fp16 the scores are Inf and what follows them NaN: nothing finite near the limit
    assert near_limit(cand.read(), truth.read()) == []
    with torch.no_grad():
        inputs = (truth_run.embed(x.double()),)
    overflow = first_overflow(
        cand_run.attn, None, inputs, {}, dtype=torch.float16, reference_dtype=torch.float32, device=None
    )
    assert overflow is not None and overflow["op"] == "aten.bmm.default"
    assert overflow["location"] == f"{__file__}:{SCORES_LINE}"


def test_an_op_that_overflowed_in_another_call_is_left_to_first_overflow():
    truth, cand, _, _ = passes(*model_at(0.62))
    assert near_limit(cand.read(), truth.read(), exclude={("attn", "aten.bmm.default")}) == []


def test_no_finding_at_40_percent_nor_in_bf16():
    truth, cand, _, _ = passes(*model_at(0.40))
    assert near_limit(cand.read(), truth.read()) == []
    truth, cand, _, _ = passes(*model_at(0.62), candidate="bf16")
    assert near_limit(cand.read(), truth.read()) == []  # bf16 has fp32's range


def test_compares_own_work_in_its_hooks_is_neither_recorded_nor_counted():
    model, x = model_at(0.62)
    quiet = passes(model, x)
    busy = passes(model, x, busy=True)
    for plain, loaded in zip(quiet[:2], busy[:2], strict=True):
        assert [r.key for r in plain.read()] == [r.key for r in loaded.read()]
    truth, cand = quiet[0].read(), quiet[1].read()
    # op for op, the two passes line up: every candidate output has its fp64 twin
    assert {r.key for r in cand} == {r.key for r in truth}
    assert {r.module for r in truth} == {"embed", "attn.q", "attn.k", "attn.v", "attn", "head"}


class _Syncs(TorchDispatchMode):
    """Counts reads of tensor values into Python (.item(), float(t)): each a host sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_ranges_stay_on_the_device_until_read_once():
    model, x = model_at(0.62)
    run = make_run(model, "fp16").eval()
    ranges, syncs = OpRanges(), _Syncs()
    with syncs, ranges:  # under the recorder: it sees the recorder's own reductions
        hooked(run, x, torch.float16, pre=ranges.pre(None), post=ranges.post(lambda *a: None), rng=RngState.capture())
    assert syncs.reads == 0 and len(ranges._values) == 2 * len(ranges._keys) > 0
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in ranges._values)
    assert ranges.read() and ranges.read() is ranges.read()  # read once, then kept


class Scales(nn.Module):
    """Fifteen children, each multiplying by its own factor inside its forward, twice each."""

    def __init__(self, factors: list[float]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Times(f) for f in factors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p(x) for p in self.parts) + sum(p(x * 0.5) for p in self.parts)


class Times(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.factor)


def test_findings_are_the_worst_call_per_module_and_op_largest_first_and_bounded():
    shares = [0.51 + 0.03 * n for n in range(15)]
    model = Scales([s * FP16_MAX for s in shares])
    truth, cand, _, _ = passes(model, torch.ones(4))
    rows = near_limit(cand.read(), truth.read(), prefix="encoder")
    assert len(rows) == MAX_OP_FINDINGS
    assert [r["module"] for r in rows] == [f"encoder.parts.{n}" for n in range(14, 4, -1)]
    assert all(r["call"] == 0 and r["op"] == "aten.mul.Tensor" for r in rows)  # x, not x * 0.5
    assert [r["share"] for r in rows] == sorted((r["share"] for r in rows), reverse=True)
    assert rows[0]["reference_absmax"] == pytest.approx(shares[-1] * FP16_MAX)


def test_modules_entered_by_name_alone_keep_their_own_lines():
    ranges, x = OpRanges(), torch.ones(4, dtype=torch.float16)
    with ranges:
        ranges.enter("a", 0)
        first = inspect.currentframe().f_lineno + 1
        x * 40000.0
        ranges.leave("a", 0)
        ranges.enter("b", 0)
        second = inspect.currentframe().f_lineno + 1
        x * 50000.0
        ranges.leave("b", 0)
        x * 60000.0  # outside any module: not recorded
    rows = near_limit(ranges.read())
    assert [(r["module"], r["location"][1]) for r in rows] == [("b", second), ("a", first)]
    assert "reference_absmax" not in rows[0]  # no fp64 pass given


def test_the_recorder_steps_off_the_dispatch_stack_in_hooks_and_back_under_the_noise_replay():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fpdoctor.precision.compare.noise import ReplayNoise

    model, x = model_at(0.62)
    run = make_run(model, "fp16").eval()
    ranges, noise, seen = OpRanges(), ReplayNoise([]), []

    def post(name, index, args, output):
        seen.append([type(m).__name__ for m in _get_current_dispatch_mode_stack()])
        flat_sample(output)  # compare's own work: not recorded, and not through the recorder at all

    with ranges:
        hooked(run, x, torch.float16, pre=ranges.pre(None), post=ranges.post(post), rng=RngState.capture(), noise=noise)
        assert _get_current_dispatch_mode_stack() == [ranges]  # the replay's `with` ended on top of it
    assert _get_current_dispatch_mode_stack() == []
    assert seen and all(stack == ["ReplayNoise"] for stack in seen)
    assert [r.key for r in ranges.read()] == [r.key for r in passes(model, x)[1].read()]


def test_compare_names_the_op_near_the_max_inside_a_module_with_its_fp64_value():
    import fpdoctor

    model, x = model_at(0.62)
    result = fpdoctor.compare(model, x, candidate="fp16")
    (risk,) = result.report.by_name("overflow-risk")
    assert risk.where["op"] == "aten.bmm.default" and risk.where["module"].endswith("attn")
    assert 0.60 < risk.evidence["share"] < 0.64 and 0.60 < risk.evidence["reference_share"] < 0.64
    assert risk.evidence["location"].startswith(f"{__file__}:")
    assert result.report.data["near_limit_ops"][0]["op"] == "aten.bmm.default"
    assert fpdoctor.compare(*model_at(0.62), candidate="bf16").report.by_name("overflow-risk") == []


def test_the_fp64_pass_takes_its_ranges_in_the_own_ops_dispatch_not_a_second_mode(monkeypatch):
    """A Python dispatch costs more than a tiny op: the fp64 pass runs one per op, the own-ops
    mode's, which hands each op to the ranges; they come out as a recorder of their own takes them."""
    import fpdoctor
    from fpdoctor.precision.compare import compare as compare_module

    passes_seen, comparisons = [], []
    dispatch, truth_pass = OpRanges.__torch_dispatch__, compare_module._Comparison.truth_pass

    def counting(self, func, types, args=(), kwargs=None):
        passes_seen[-1] += 1
        return dispatch(self, func, types, args, kwargs)

    def truth(self):
        comparisons.append(self)
        passes_seen.append(0)
        truth_pass(self)
        passes_seen.append(0)  # from here: the candidate's pass

    monkeypatch.setattr(OpRanges, "__torch_dispatch__", counting)
    monkeypatch.setattr(compare_module._Comparison, "truth_pass", truth)
    model, x = model_at(0.62)
    fpdoctor.compare(model, x, candidate="fp16")
    assert passes_seen[0] == 0 and passes_seen[1] > 0  # the fp64 pass: no ranges mode; the candidate's: one
    taken = comparisons[0].truth_ranges.read()
    alone = passes(model, x)[0].read()
    assert taken and [(r.key, r.shape, r.absmax) for r in taken] == [(r.key, r.shape, r.absmax) for r in alone]


class _Mixer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = (m(x) for m in (self.q, self.k))  # the same mm as the FFN's below, its values large too
        return torch.tanh(q / 1e4) * torch.tanh(k / 1e4)


class _FFN(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wi(x)))


class _Blocks(nn.Module):
    """A T5-style FFN whose output Linear comes near fp16's max, after a mixer whose Linears run the
    same op on the same shapes at another line: each op's line is the line that called its module."""

    def __init__(self, dim: int = 32, decoder: bool = False) -> None:
        super().__init__()
        self.mix, self.ffn, self.decoder = _Mixer(dim), _FFN(dim), decoder
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffn(self.mix(x))
        return self.out(h) if self.decoder else h


FFN_LINE = inspect.getsourcelines(_FFN.forward)[1] + 1
OUT_LINE = inspect.getsourcelines(_Blocks.forward)[1] + 2


@pytest.mark.parametrize("decoder", [False, True])
def test_an_op_of_a_torch_module_is_at_the_line_that_called_that_module_not_another_of_its_class(decoder):
    import fpdoctor

    torch.manual_seed(0)
    model = _Blocks(decoder=decoder).eval()
    with torch.no_grad():
        x = torch.randn(4, 16, 32)
        for m in (model.mix.q, model.mix.k):  # watched: outputs at a third of the max, below the finding's share
            m.weight.mul_(0.3 * FP16_MAX / float(m(x).abs().max()))
        target = model.out if decoder else model.ffn.wo
        target.weight.mul_(0.6 * FP16_MAX / float(model(x).abs().max()))
    result = fpdoctor.compare(model, x, candidate="fp16")
    risks = result.report.by_name("overflow-risk")
    assert risks, [f.name for f in result.report.findings]
    line = OUT_LINE if decoder else FFN_LINE
    assert risks[0].evidence["location"].startswith(f"{__file__}:{line} "), risks[0].evidence["location"]
