"""An output of logits judged by what it decides: top-1 agreement with fp64 beside rounding's floor.

Two models whose bf16 run keeps a small relative error (55 dB SQNR, cosine 1 - 1e-10) and still
picks another class on a third of the rows: the logits' norm sits in masked classes no decision
reads, and the features the last layer reads carry a large offset that bf16 rounds the signal out
of. A classifier over a masked label space and a small language model over a masked vocabulary
(a LayerNorm whose bias carries the offset). Healthy runs get the figures and no finding; hidden
states are not judged by an argmax.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.plan.codegen import plan_code


class MaskedClassifier(nn.Module):
    """90 of 100 classes masked by their bias; the features carry an offset the head's rows cancel."""

    def __init__(self, offset: float = 100.0, masked: int = 90) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU())
        self.offset = offset
        self.head = nn.Linear(256, 100)
        with torch.no_grad():
            self.head.weight.sub_(self.head.weight.mean(1, keepdim=True))
            self.head.bias[:masked] = -2e4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) + self.offset)


class MaskedLM(nn.Module):
    """Tokens -> mixing -> LayerNorm (its bias 60 on every feature) -> lm_head over a vocabulary of
    which all but 32 tokens are masked by its bias."""

    def __init__(self, vocab: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.SiLU())
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)
        with torch.no_grad():
            self.norm.bias.fill_(60.0)
            self.lm_head.weight.sub_(self.lm_head.weight.mean(1, keepdim=True))
            self.lm_head.bias.fill_(-1e4)
            self.lm_head.bias[:32] = 0.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.mix(self.embed(tokens))))


def _classifier(**kw: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MaskedClassifier(**kw).eval(), torch.randn(2048, 64)


def _lm() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MaskedLM().eval(), torch.randint(0, 512, (4, 256))


def _top1(model: nn.Module, x: torch.Tensor, reference: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(x).double()
    return float((out.argmax(-1) == reference.argmax(-1)).double().mean())


@pytest.mark.parametrize("make", [_classifier, _lm], ids=["classifier", "language-model"])
def test_a_small_error_that_changes_the_decisions_is_an_error_with_its_fix_checked(make) -> None:
    model, x = make()
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "decisions-changed" and first.severity == "error"
    decisions = result.report.data["decisions"]
    assert decisions["top1"] < 0.9 and decisions["floor_top1"] > 0.99
    final = result.rows[-1]
    assert final.propagated < 0.01  # the relative error alone would have said OK
    assert first.trial is not None and first.trial.tried and "top-1 agreement" in first.trial.metric
    best = max(first.evidence["kept_in_fp32_tried"], key=lambda t: t["top1"])
    assert all(f"`{m}`" in first.fix for m in best["modules"]) and best["top1"] > 0.98

    # applied as printed, with the code `fpdoctor plan` writes for it: the model in bf16, those modules
    # kept in fp32 (their fp32 weights) with fp32 outputs, the inputs the user has
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double() if x.is_floating_point() else x)
    fixed = copy.deepcopy(model)
    exec(plan_code("bf16", best["modules"], best["modules"]), {"model": fixed})
    plain = copy.deepcopy(model).to(torch.bfloat16)
    assert _top1(plain, x.to(torch.bfloat16) if x.is_floating_point() else x, exact) < 0.9
    assert _top1(fixed, x, exact) > 0.98


def test_healthy_logits_get_their_figures_and_no_finding() -> None:
    model, x = _classifier(offset=0.0)
    for candidate in ("bf16", "fp16"):
        result = fpdoctor.compare(model, x, candidate=candidate)
        assert not [f for f in result.report.findings if f.name == "decisions-changed"]
        decisions = result.report.data["decisions"]
        assert decisions["rows"] == 2048 and decisions["classes"] == 100 and decisions["top1"] > 0.98
        assert any(k.startswith("decisions (logits of `head`") for k, _ in result.report.data["summary"])


def test_hidden_states_are_not_judged_by_an_argmax() -> None:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64)).eval()
    result = fpdoctor.compare(encoder, torch.randn(256, 32), candidate="bf16")
    assert "decisions" not in result.report.data
    square = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64)).eval()  # a projection, not classes
    assert "decisions" not in fpdoctor.compare(square, torch.randn(256, 32), candidate="bf16").report.data


def test_the_fix_trials_leave_the_users_model_as_it_was() -> None:
    model, x = _classifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fpdoctor.compare(model, x, candidate="bf16")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert type(model.head) is nn.Linear and model.head.weight.dtype == torch.float32


class StreamingClassifier(nn.Module):
    """A class per token from the running mean of the tokens so far: a running sum and a running
    count, held in the model's dtype unless `fp32_states` (the fix, applied as a user writes it)."""

    def __init__(self, fp32_states: bool = False) -> None:
        super().__init__()
        self.fp32_states = fp32_states
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        state = torch.float32 if self.fp32_states else h.dtype
        total = h.new_zeros(h.shape[0], h.shape[-1], dtype=state)
        count = h.new_zeros(h.shape[0], 1, dtype=state)
        means = []
        for t in range(h.shape[1]):
            total = total + h[:, t]
            count = count + 1.0
            means.append((total / count).to(h.dtype))
        return self.head(torch.stack(means, 1))


def test_decisions_changed_by_running_states_get_the_states_fix_checked_by_the_same_run() -> None:
    """Where the end-to-end error is the running states' (a sum and a count that bf16 stops counting
    past 256), the decisions finding's fix is theirs, checked by the run that kept them in fp64, and
    no module is swapped in fp32 for it; applied as printed, the decisions come back."""
    torch.manual_seed(0)
    model, x = StreamingClassifier().eval(), torch.randn(2, 600, 16) + 0.5
    report = fpdoctor.compare(model, x, candidate="bf16").report
    (decisions,) = report.by_name("decisions-changed")
    (divergence,) = report.by_name("precision-divergence")
    lines = divergence.evidence["state_locations"]
    assert len(lines) == 2, str(report)
    assert all(line in decisions.fix for line in lines), decisions.fix
    assert decisions.evidence["kept_in_fp32_tried"] == []  # no module trial ran
    kept = decisions.evidence["running_state_kept"]
    assert 1.0 - kept["top1"] <= 0.25 * (1.0 - decisions.evidence["decisions"]["top1"])

    fixed = StreamingClassifier(fp32_states=True).eval()
    fixed.load_state_dict(model.state_dict())
    after = fpdoctor.compare(fixed, x, candidate="bf16").report
    assert not after.by_name("decisions-changed"), str(after)
    assert after.data["decisions"]["top1"] >= kept["top1"] - 0.02


class PhaseClassifier(nn.Module):
    """Classes read off sin/cos features of large positions (a timestep, a clock), the angle table
    built in the model's dtype: bf16 rounds the positions past 256 and the frequencies, and sin/cos
    of the rounded angles pick other classes. `fp32_tables`: the table in fp32, cast back after."""

    def __init__(self, dim: int = 32, classes: int = 16, fp32_tables: bool = False) -> None:
        super().__init__()
        self.dim, self.fp32_tables = dim, fp32_tables
        self.proj = nn.Linear(2 * dim, 64)
        self.head = nn.Linear(64, classes)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.fp32_tables else self.proj.weight.dtype
        freq = torch.exp(torch.arange(0, self.dim, dtype=dtype) * (-9.21 / self.dim))
        angles = t.to(dtype)[:, None] * freq
        feats = torch.cat([angles.sin(), angles.cos()], -1).to(self.proj.weight.dtype)
        return self.head(torch.tanh(self.proj(feats)))


def test_decisions_changed_by_lines_in_bf16_get_the_lines_fix_checked_by_its_own_run() -> None:
    """The decisions finding leads with the fix the divergence's check found (the lines that build the
    angles, in fp32), its top-1 read off that same run: no module set is tried in its place (none can
    fix a table built in the forward), and applied as the fp32 table, the decisions come back."""
    torch.manual_seed(0)
    model, t = PhaseClassifier().eval(), torch.randint(0, 20000, (1024,))
    report = fpdoctor.compare(model, t, candidate="bf16").report
    (divergence,) = report.by_name("precision-divergence")
    (decisions,) = report.by_name("decisions-changed")
    assert divergence.evidence.get("feeding_lines") and divergence.trial is not None and divergence.trial.tried
    assert decisions.fix.startswith(divergence.fix.partition("; checked:")[0]), decisions.fix
    assert decisions.trial is not None and decisions.trial.tried
    assert decisions.trial.changed == divergence.trial.changed
    assert f"checked: top-1 {decisions.trial.before} -> {decisions.trial.after}" in decisions.fix
    assert decisions.evidence["kept_in_fp32_tried"] == []  # no forward of its own
    kept = decisions.evidence["lines_in_fp32"]["top1"]
    assert decisions.evidence["decisions"]["top1"] < 0.5 and kept > 0.95  # 30.7% -> 99.1%

    fixed = PhaseClassifier(fp32_tables=True).eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(t)
    assert _top1(fixed.to(torch.bfloat16), t, reference) >= kept - 0.02


def test_a_fix_whose_run_did_not_give_the_decisions_back_is_never_printed_as_the_fix() -> None:
    from fpdoctor.precision.compare import use

    found = use.Decisions("logits of `head`", rows=1000, classes=10, top1=0.5, top5=0.9, kl=0.3,
                          floor_top1=0.999, floor_kl=1e-5)  # fmt: skip
    tried = use.CheckedFix("compute lines 3-4 of m.py in fp32", "the ops at lines 3-4 in fp32", 0.6, "lines_in_fp32",
                           "m.py:3, m.py:4")  # fmt: skip
    f = use.finding(found, "bf16", [(["head"], 0.51)], head="head", inputs=(torch.zeros(2),), checked_fixes=[tried])
    assert "lines 3-4" not in f.fix and "`head`" not in f.fix, f.fix
    assert f.trial is not None and not f.trial.tried, f.trial
    assert "60.0%" in f.trial.reason and "51.0%" in f.trial.reason, f.trial.reason
    # given back by that run: it is the fix, with top-1 before -> after
    good = use.CheckedFix(tried.fix, tried.changed, 0.995, tried.kind, tried.locations)
    f = use.finding(found, "bf16", [], head="head", inputs=(torch.zeros(2),), checked_fixes=[good])
    assert f.fix.startswith(tried.fix) and "checked: top-1 50.0% -> 99.5%" in f.fix, f.fix
    assert f.trial is not None and f.trial.tried and f.trial.after == "99.5%"
    # most given back, and still 3% changed (30x rounding's 0.1%): compare would call it changed again
    most = use.CheckedFix(tried.fix, tried.changed, 0.97, tried.kind, tried.locations)
    f = use.finding(found, "bf16", [], head="head", inputs=(torch.zeros(2),), checked_fixes=[most])
    assert f.trial is not None and not f.trial.tried and "97.0%" in f.trial.reason, f.fix


class _Prototypes(nn.Module):
    """A nearest-class-mean classifier: negative squared distances to class means (a buffer),
    by expansion (||f||^2 + ||p||^2 - 2 f.p), over features far from zero."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.register_buffer("means", torch.zeros(12, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.encoder(x) + 40.0
        return -((f * f).sum(-1, keepdim=True) + (self.means * self.means).sum(-1) - 2.0 * f @ self.means.t())


class _Cosine(nn.Module):
    """A cosine classifier: normalised features against normalised class embeddings (a parameter
    of the model's own), sharpened by a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.classes = nn.Parameter(torch.randn(12, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional.normalize(self.encoder(x), dim=-1)
        return f @ nn.functional.normalize(self.classes, dim=-1).t() / 0.05


def test_scores_against_a_class_table_of_the_models_own_are_judged_by_their_decisions() -> None:
    """A prototype classifier in bf16 flipped most of its classes and compare reported no top-1: its
    output is not a Linear's. Scores with one column per row of a table the model holds (prototypes,
    class embeddings) are judged as logits; the flips are a decisions finding, a healthy cosine head's
    figures are given without one."""
    torch.manual_seed(0)
    model = _Prototypes().eval()
    x = torch.randn(600, 16)
    with torch.no_grad():
        f = model.encoder(x) + 40.0
        model.means.copy_(f[:12] + 0.05 * torch.randn(12, 32))  # class means near the queries
    report = fpdoctor.compare(model, x, candidate="bf16").report
    decisions = report.data["decisions"]
    assert decisions["classes"] == 12 and decisions["top1"] < 0.9, decisions
    assert report.by_name("decisions-changed"), str(report)
    assert any("against its `means` (12 x 32" in k for k, _ in report.data["summary"]), report.data["summary"]

    torch.manual_seed(0)
    healthy = fpdoctor.compare(_Cosine().eval(), torch.randn(600, 16), candidate="bf16").report
    assert healthy.data["decisions"]["classes"] == 12 and healthy.data["decisions"]["top1"] > 0.9
    assert not healthy.by_name("decisions-changed"), str(healthy)


class _Centroids(nn.Module):
    """Cluster assignment: negative squared distances to centroids held as a plain fp32 tensor attribute
    (what compare's fix for a buffer the cast rounds writes), the distance computed in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 24))
        self.centroids = torch.randn(10, 24) * 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.encoder(x).float()
        return -torch.cdist(f, self.centroids).pow(2).to(x.dtype)


def test_scores_against_a_plain_tensor_attribute_table_are_still_judged_by_their_decisions() -> None:
    """After compare's fix moves a class table out of the buffers (a plain fp32 attribute), the fixed
    model is judged by its decisions as the broken one was, not as a regression output."""
    torch.manual_seed(0)
    report = fpdoctor.compare(_Centroids().eval(), torch.randn(400, 16), candidate="bf16").report
    assert report.data["decisions"]["classes"] == 10, report.data.get("decisions")
    assert any("against its `centroids` (10 x 24" in k for k, _ in report.data["summary"]), report.data["summary"]


class _ZeroShot(nn.Module):
    """Zero-shot scores: image features against class embeddings a small tower encodes in the
    forward from the class ids (no table of the model's own), cosine similarity times `scale`."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.names = nn.Embedding(300, 32)
        self.text = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.scale = scale

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        im = nn.functional.normalize(self.image(x), dim=-1)
        tx = nn.functional.normalize(self.text(self.names(ids)), dim=-1)
        return self.scale * im @ tx.t()


def _zero_shot(classes: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = _ZeroShot(100.0).eval()
    ids = torch.arange(classes)
    with torch.no_grad():  # images near their class's text embedding, as a trained pair puts them
        classes = torch.randint(0, classes, (512,))
        x = model.text(model.names(ids))[classes] + 0.3 * torch.randn(512, 32)
    return model, (x, ids)


def test_scores_a_format_cannot_hold_are_named_with_the_output_format_as_the_cause() -> None:
    """Zero-shot scores near 100 in bf16 (spacing 0.5) over 300 classes against class embeddings the
    model encodes in the forward: compare said OK (no decisions line: no Linear head, no table of its
    own) while bf16 flips a few percent of the classes, nearly all of it rounding the output:
    output-too-coarse, with the exact output held in fp32 as the check. Over 20 classes, whose
    margins bf16 holds, the decisions are judged and nothing is named."""
    model, inputs = _zero_shot(300)
    report = fpdoctor.compare(model, inputs, candidate="bf16").report
    decisions = report.data["decisions"]
    assert decisions["classes"] == 300 and "against the rows `text` made" in decisions["source"], decisions
    (found,) = report.by_name("output-too-coarse")
    assert found.evidence["kind"] == "decisions" and found.evidence["fp32_top1"] > decisions["floor_top1"]
    assert 1 - decisions["floor_top1"] >= 0.01 and "Return the scores in fp32" in found.fix
    # the model's own ops make the scores: no run put the fix in place, and the exact output's figure is not
    # printed as the fix's check (a cosine classifier's scores kept in fp32 from bf16 features stayed as wrong)
    assert found.trial is not None and not found.trial.tried and "no run put the fix in place" in found.trial.reason
    assert report.verdict != "ok"

    model, inputs = _zero_shot(20)
    calm = fpdoctor.compare(model, inputs, candidate="bf16").report
    assert "decisions" in calm.data and not calm.by_name("output-too-coarse"), str(calm)


class _Retriever(nn.Module):
    """Cosine kNN: an encoder's embedding against a memory bank the caller passes in, sharpened."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
        q = nn.functional.normalize(self.encoder(x), dim=-1)
        return q @ nn.functional.normalize(bank, dim=-1).t() / 0.02


def test_scores_against_a_memory_bank_passed_in_are_judged_by_their_decisions() -> None:
    """A kNN over 500 stored embeddings passed as an input: compare said OK with no decisions line
    (no table of the model's own); the bank is a table the model was given, and bf16's rounding of
    the scores is named (the exact scores held in fp32 keep the picks)."""
    torch.manual_seed(0)
    model = _Retriever().eval()
    with torch.no_grad():
        bank = model.encoder(torch.randn(500, 32))
        x = torch.randn(256, 32)
    report = fpdoctor.compare(model, (x, bank), candidate="bf16").report
    decisions = report.data["decisions"]
    assert decisions["classes"] == 500 and "against an input's rows (500 x 32" in decisions["source"], decisions
    assert report.verdict != "ok" and (report.by_name("output-too-coarse") or report.by_name("decisions-changed"))


class _Enrolled(nn.Module):
    """Speaker identification against voiceprints exact in bf16 (a bf16 checkpoint): unit embeddings
    near one direction, squared distances by the expansion (`expanded`: its terms rounded one by one
    in bf16) or by addmm (one rounding of the result)."""

    def __init__(self, expanded: bool, dim: int = 192, speakers: int = 300) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.expanded = expanded
        self.net = nn.Sequential(nn.Linear(80, 256), nn.ReLU(), nn.Linear(256, dim))
        c = torch.randn(1, dim, generator=g)
        prints = nn.functional.normalize(c + 0.2 * torch.randn(speakers, dim, generator=g), dim=-1)
        self.prints = nn.Parameter(prints.bfloat16().float())

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        e = nn.functional.normalize(self.net(feats).mean(1) * 0.1 + self.prints.mean(0), dim=-1)
        sq = (e * e).sum(-1, keepdim=True) + (self.prints * self.prints).sum(-1)
        if self.expanded:
            return 2.0 * (e @ self.prints.t()) - sq
        return -torch.addmm(sq, e, self.prints.t(), alpha=-2.0)


def test_decisions_the_computation_changes_far_beyond_a_coarse_floor_are_not_blamed_on_the_format() -> None:
    # rounding the exact scores flips 7.4% of the rows: 16x that is more rows than there are to flip
    torch.manual_seed(0)
    model, feats = _Enrolled(expanded=True).eval(), torch.randn(256, 20, 80)
    result = fpdoctor.compare(model, feats, candidate="bf16")
    names = [f.name for f in result.report.findings]
    assert "decisions-changed" in names and "output-too-coarse" not in names, names
    changed = next(f for f in result.report.findings if f.name == "decisions-changed")
    found = changed.evidence["decisions"]
    assert 1 - found["floor_top1"] > 0.05 and 1 - found["top1"] < 16 * (1 - found["floor_top1"])
    assert changed.trial is not None and changed.trial.tried, changed.fix

    # the same scores by addmm: the computation adds little, the format is the cause
    torch.manual_seed(0)
    model = _Enrolled(expanded=False).eval()
    result = fpdoctor.compare(model, feats, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "output-too-coarse" and "The computation adds little" in first.message, str(result.report)


def test_a_quarter_of_the_rows_more_than_rounding_is_a_change_on_eight_rows_or_more() -> None:
    from fpdoctor.precision.decide import Decisions

    def changed(rows: int, top1: float, floor_top1: float) -> bool:
        return Decisions("logits", rows, 10, top1, 1.0, 0.0, floor_top1, 0.0).changed

    assert changed(256, 0.398, 0.953)  # 13x a coarse floor: more than 16x is not there to flip
    assert not changed(256, 0.90, 0.953)  # 2x: within what a coarse output loses
    assert not changed(4, 0.5, 1.0) and not changed(8, 0.625, 1.0)  # 2 or 3 rows: no evidence
    assert changed(32, 0.5, 1.0)


class _Probabilities(nn.Module):
    """A classifier that returns calibrated probabilities: softmax(logits / temperature)."""

    def __init__(self, inner: nn.Module, temperature: float = 0.07) -> None:
        super().__init__()
        self.inner, self.temperature = inner, temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.inner(x) / self.temperature, dim=-1)


def test_probabilities_a_softmax_returns_are_judged_by_their_decisions() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    broken = fpdoctor.compare(_Probabilities(MaskedClassifier()).eval(), x, candidate="bf16")
    decisions = broken.report.data["decisions"]
    assert decisions["source"].startswith("probabilities of a softmax over 100 classes")
    assert "decisions-changed" in [f.name for f in broken.report.findings], [f.name for f in broken.report.findings]

    torch.manual_seed(0)
    healthy = fpdoctor.compare(_Probabilities(MaskedClassifier(offset=0.0, masked=0)).eval(), x, candidate="bf16")
    assert healthy.report.data["decisions"]["source"].startswith("probabilities of a softmax")
    assert all(f.name != "decisions-changed" for f in healthy.report.findings)


class _ScoresAgainstAnEmbedding(nn.Module):
    """Scores against every row of an embedding the model holds (`user @ items.weight.T`): a
    recommender's item table, a retriever's document table (trial79: no decisions were judged)."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.history = nn.EmbeddingBag(2000, 32, mode="mean") if bag else nn.Linear(16, 32)
        self.items = nn.Embedding(2000, 32)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        user = self.history(x, offsets) if self.bag else self.history(x)
        return user @ self.items.weight.T


@pytest.mark.parametrize("bag", [True, False], ids=["recommender-bag", "retriever-query-tower"])
def test_scores_against_an_embedding_table_are_judged_by_their_decisions(bag: bool) -> None:
    torch.manual_seed(0)
    model = _ScoresAgainstAnEmbedding(bag).eval()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 2000, (256,), generator=g), torch.arange(0, 256, 16)) if bag else torch.randn(16, 16)
    result = fpdoctor.compare(model, inputs, candidate="bf16")
    decisions = result.report.data.get("decisions")
    assert decisions is not None, dict(result.report.data["summary"])
    assert "`items.weight` (2000 x 32" in decisions["source"], decisions["source"]


class _Siblings(nn.Module):
    """A fine-grained classifier: sub-classes share their super-class's head row but for a small offset,
    so their logits are close, and bf16's spacing at those values flips a fifth of the decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128))
        self.head = nn.Linear(128, 120)
        with torch.no_grad():
            self.head.weight.copy_(
                (torch.randn(12, 128) * 0.2).repeat_interleave(10, 0) + 0.004 * torch.randn(120, 128)
            )
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def test_an_output_too_coarse_for_a_fifth_of_its_decisions_is_an_error_and_plans_target_stays_a_share_of_rows():
    """Rounding the exact logits to bf16 alone flips ~20% of the rows: output-too-coarse, an error (a
    candidate that changes that many decisions is not one to ship, exit 1), its fix (the head returning
    fp32) checked. plan --metric top1 aims for logits kept wider (16x what rounding the inputs costs),
    not 16x the format's own 20% (a target below 0%, which keeping nothing meets)."""
    torch.manual_seed(0)
    model, x = _Siblings().eval(), torch.randn(1024, 32)
    report = fpdoctor.compare(model, x, candidate="bf16").report
    (coarse,) = report.by_name("output-too-coarse")
    assert coarse.severity.value == "error" and report.verdict == "error", coarse.message
    assert coarse.trial is not None and coarse.trial.tried
    planned = fpdoctor.plan(model, x, candidate="bf16", metric="top1")
    target = 1.0 - planned.plan.target
    assert 0.9 <= target < 1.0, target
    assert planned.plan.verified and "head" in planned.plan.keep_fp32
    assert "output-too-coarse" in dict(planned.report.data["summary"])["target"]
