"""A selection inside the model that the candidate's format changes (selections.py): a top-2 router
over 8 experts whose softmax sits near 1/8 (bf16 holds it in steps of 0.001), a Switch-style top-1
router that takes the argmax of its logits (fp16), a mixture-of-depths block that sends its top-k
tokens by a router score through the MLP (bf16: the same number of rows, other rows), and a token
pruning that keeps the tokens whose score passes a threshold (bf16: a comparison decides). No
module or op stands out; compare names the selection's line, its rows, and the lines that make
what it ranks in fp32, checked; the fix as printed gives an OK. Where the selection picks the same
elements, nothing is said."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


def _line(fn: object, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


class Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TopK(nn.Module):
    """Mixtral-style: softmax over the router's logits, the top-2 experts, their weights renormalised."""

    def __init__(self, fixed: bool = False, d: int = 64, experts: int = 8) -> None:
        super().__init__()
        self.fixed = fixed
        self.norm, self.router = nn.LayerNorm(d), nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, 2 * d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.fixed:  # the printed fix: lines 'probs = ' and 'topk' in fp32, what they make cast back
            probs = F.softmax(F.linear(h.float(), self.router.weight.float()), dim=-1)
            w, idx = probs.topk(2, dim=-1)
            w = w.to(x.dtype)
        else:
            probs = F.softmax(self.router(h), dim=-1)
            w, idx = probs.topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(h[tok]) * w[tok, slot, None])
        return x + out


class Switch(nn.Module):
    """Switch-style: the argmax of the router's logits picks one expert, scaled by its probability."""

    def __init__(self, fixed: bool = False, d: int = 64, experts: int = 16) -> None:
        super().__init__()
        self.fixed = fixed
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d, d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            logits = F.linear(x.float(), self.router.weight.float(), self.router.bias.float())
            best = logits.argmax(-1)
        else:
            logits = self.router(x)
            best = logits.argmax(-1)
        gate = logits.softmax(-1).gather(-1, best[:, None]).to(x.dtype)
        out = torch.empty_like(x)
        for e, expert in enumerate(self.experts):
            rows = (best == e).nonzero().squeeze(-1)
            out[rows] = expert(x[rows]) * gate[rows]
        return out


class Depths(nn.Module):
    """Mixture-of-depths: the half of the tokens with the highest router score go through the MLP."""

    def __init__(self, fixed: bool = False, d: int = 64) -> None:
        super().__init__()
        self.fixed = fixed
        self.score = nn.Linear(d, 1)
        self.mlp = Expert(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, n, d = x.shape
        if self.fixed:
            s = F.linear(x.float(), self.score.weight.float(), self.score.bias.float()).squeeze(-1)
            top = s.topk(n // 2, dim=-1).indices
        else:
            s = self.score(x).squeeze(-1)
            top = s.topk(n // 2, dim=-1).indices
        picked = x.gather(1, top[..., None].expand(-1, -1, d))
        return x.scatter_add(1, top[..., None].expand(-1, -1, d), self.mlp(picked))


class Prune(nn.Module):
    """Token pruning: a token whose importance score passes a threshold is kept, the others zeroed."""

    def __init__(self, fixed: bool = False, d: int = 64) -> None:
        super().__init__()
        self.fixed = fixed
        self.importance, self.mix = nn.Linear(d, 1), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            keep = F.linear(x.float(), self.importance.weight.float(), self.importance.bias.float()) > 2.0
        else:
            keep = self.importance(x) > 2.0
        return self.mix(x * keep.to(x.dtype))


def _prune(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(4)
    model = Prune(fixed).eval()
    with torch.no_grad():
        model.importance.weight.mul_(0.1)
        model.importance.bias.fill_(2.0)  # scores near the threshold: bf16 holds them in steps of 0.016
    return model, torch.randn(8, 128, 64)


def _topk(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TopK(fixed).eval()
    with torch.no_grad():
        model.router.weight.mul_(0.05)  # a lightly trained router: probabilities near 1/8
    return model, torch.randn(512, 64)


def _switch(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = Switch(fixed).eval()
    with torch.no_grad():
        model.router.weight.mul_(0.02)
        model.router.bias.fill_(30.0)  # logits near 30: fp16 holds them in steps of 0.016
    return model, torch.randn(512, 64)


def _depths(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(2)
    model = Depths(fixed).eval()
    with torch.no_grad():
        model.score.weight.mul_(0.05)
        model.score.bias.fill_(4.0)  # scores near 4: bf16 holds them in steps of 0.03
    return model, torch.randn(4, 256, 64)


CASES = [
    pytest.param(_topk, TopK.forward, "topk", "bf16", "probs = F.softmax(self.router", "self.router(h)",
                 id="top-2 router bf16"),
    pytest.param(_switch, Switch.forward, "argmax", "fp16", "logits = self.router", "self.router(x)",
                 id="switch argmax fp16"),
    pytest.param(_depths, Depths.forward, "topk", "bf16", "s = self.score", "self.score(x)",
                 id="mixture-of-depths bf16"),
    pytest.param(_prune, Prune.forward, "gt", "bf16", "keep = self.importance", "self.importance(x)",
                 id="a threshold bf16"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "forward", "op", "candidate", "scores", "call"), CASES)
def test_a_changed_selection_leads_with_its_line_and_the_fix_checked(
    make: object, forward: object, op: str, candidate: str, *, scores: str, call: str
) -> None:
    model, x = make()  # type: ignore[operator]
    report = fpdoctor.compare(model, x, candidate=candidate).report
    first = report.findings[0]
    assert first.name == "selection-changed", [f.name for f in report.findings]
    assert first.where["op"] == f"aten.{op}"
    ev = first.evidence
    assert ev["share_changed"] >= 0.02 and ev["floor_share"] * 4 <= ev["share_changed"]
    assert first.trial is not None and first.trial.tried, first.fix
    assert ev["rows_changed_after"] * 4 <= ev["rows_changed"]
    assert ev["error_after"] * 2 <= ev["error_before"]
    # the line that makes the scores is among the lines the fix raises, and the text says how, on the
    # module's own input as the line passes it
    assert _line(forward, scores) in ev["lines_raised"]
    arg = call.partition("(")[2].rstrip(")")
    assert f"F.linear({arg}.float(), {call.partition('(')[0]}.weight.float()" in first.fix, first.fix
    assert f"instead of {call}" in first.fix
    assert not any(f.evidence.get("kind") == "accumulation" for f in report.findings)


@pytest.mark.parametrize(
    ("make", "candidate"), [(_topk, "bf16"), (_switch, "fp16"), (_depths, "bf16"), (_prune, "bf16")]
)
def test_the_fix_as_printed_gives_an_ok(make: object, candidate: str) -> None:
    model, x = make(fixed=True)  # type: ignore[operator]
    report = fpdoctor.compare(model, x, candidate=candidate).report
    assert not [f for f in report.findings if f.severity in ("error", "warning")], [
        (f.name, f.message[:200]) for f in report.findings
    ]


def test_module_calls_of_other_shapes_are_named_not_dropped_silently() -> None:
    model, x = _topk()
    report = fpdoctor.compare(model, x, candidate="bf16").report
    notes = dict(report.data["summary"]) | {k: v for k, v in report.data.get("not_checked", {}).items()}
    text = " ".join(str(v) for v in notes.values())
    assert "experts.0" in text and "other shapes" in text, text


class Gated(nn.Module):
    """A cancellation (an offset of 30 taken away) that diverges, then a leaky ReLU by hand whose
    comparison flips near 0 with it: the divergence is the cause, not the comparison."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        c = h - h.mean(-1, keepdim=True)
        return self.down(torch.where(c > 0, c, 0.01 * c))


def test_a_comparison_after_a_divergence_is_not_named_before_it() -> None:
    torch.manual_seed(5)
    model = Gated().eval()
    with torch.no_grad():
        model.up.bias.fill_(30.0)
    report = fpdoctor.compare(model, torch.randn(256, 64), candidate="bf16").report
    names = [f.name for f in report.findings]
    assert names and names[0] == "precision-divergence" and "selection-changed" not in names, names


def test_a_selection_the_format_does_not_change_is_not_named() -> None:
    torch.manual_seed(0)
    model = TopK().eval()  # an untouched router: its probabilities far apart for bf16
    with torch.no_grad():
        model.router.weight.mul_(20.0)
    report = fpdoctor.compare(model, torch.randn(256, 64), candidate="bf16").report
    assert "selection-changed" not in [f.name for f in report.findings]


def test_a_selecting_line_several_blocks_share_is_named_with_the_block_that_changed() -> None:
    """Two top-2 routers of one class, one line of code: the finding names the block whose call changed."""
    torch.manual_seed(0)
    blocks = nn.Sequential(TopK(), TopK()).eval()
    with torch.no_grad():
        for block in blocks:
            block.router.weight.mul_(0.05)
    report = fpdoctor.compare(blocks, torch.randn(512, 64), candidate="bf16").report
    first = next(f for f in report.findings if f.name == "selection-changed")
    assert first.where["module"] in ("0", "1")
    assert f" in `{first.where['module']}` picks" in first.message, first.message


def test_a_selection_no_upstream_line_set_gives_back_prints_no_line_in_fp32_as_its_fix():
    """Every set of lines upstream in fp32 was tried and the picks stayed changed (a greedy loop feeding
    its picks back): the fix says so and where to look, never the tried change as the thing to do."""
    from fpdoctor.precision.compare.selections import Changed, Pick, finding

    pick = Pick("argmax", f"{__file__}:10", torch.zeros(64, 1, dtype=torch.int64), (f"{__file__}:9",))
    found = Changed(pick, changed=25, rows=64, floor=0.01, error_before=0.3, tried=[(1, 25), (2, 25), (3, 24)])
    said = finding(found, label="bf16", dtype=torch.bfloat16, reference="rounding the exact scores")
    assert said.trial is not None and not said.trial.tried and "1 to 3 lines" in said.trial.reason, said.trial
    assert said.fix.startswith("no line in fp32 is the fix") and "teacher-forced" in said.fix, said.fix
    assert "compute what" not in said.fix, said.fix


def test_a_selection_whose_line_set_runs_all_failed_says_no_run_checked_it():
    from fpdoctor.precision.compare.selections import Changed, Pick, finding

    pick = Pick("argmax", f"{__file__}:10", torch.zeros(64, 1, dtype=torch.int64), (f"{__file__}:9",))
    found = Changed(pick, changed=25, rows=64, floor=0.01, error_before=0.3, tried=[(1, None), (2, None)])
    said = finding(found, label="bf16", dtype=torch.bfloat16, reference="rounding the exact scores")
    assert "no run checked it" in said.fix and "no line in fp32 is the fix" not in said.fix, said.fix
