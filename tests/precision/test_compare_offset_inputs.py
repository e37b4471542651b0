"""Input values far from zero that vary little (coordinates, unix timestamps with fractions of a
second): the candidate's spacing at their magnitude is a large share of their spread, and a model
that reads their differences reads the rounding. No module diverges; keeping modules wider undoes
nothing. compare names the columns and the offset, and checks the fix (one offset subtracted before
the cast); the fix applied as printed takes the error away. Against an fp32 candidate, the decisions
finding takes that checked fix and never sends the user to `plan`, which refuses fp32."""

from __future__ import annotations

import re

import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare.input_cause import offset_columns


class Trip(nn.Module):
    """An ETA model fed a trip's raw pickup and drop-off coordinates (degrees) and two features: the
    displacement is computed inside the forward from the coordinates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        north = (x[:, 2] - x[:, 0]) * 111.0  # km
        east = (x[:, 3] - x[:, 1]) * 88.0
        return self.net(torch.stack([north, east, x[:, 4], x[:, 5]], dim=1))


def _trips(rows: int = 1024) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lat = 37.77 + 0.05 * torch.randn(rows, 2, generator=g)
    lon = -122.42 + 0.05 * torch.randn(rows, 2, generator=g)
    return torch.cat([lat[:, :1], lon[:, :1], lat[:, 1:], lon[:, 1:], torch.randn(rows, 2, generator=g)], dim=1)


def test_coordinates_far_from_zero_are_named_with_their_offset_and_the_fix_works_as_printed() -> None:
    torch.manual_seed(0)
    model, x = Trip().eval(), _trips()
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.evidence["kind"] == "input-rounding", str(result.report)
    found = first.evidence["whole_numbers"]  # latitudes and longitudes: two ranges, an offset each
    assert sorted(tuple(f["columns"]) for f in found) == [(0, 2), (1, 3)], found
    assert "far from zero" in first.title and "spacing" in first.message
    trial = first.trial
    assert trial is not None and trial.tried and trial.after < trial.before / 10, trial
    # the fix as printed: `x[..., [0, 2]] - offset` and `x[..., [1, 3]] - offset`, in fp32, then the model in bf16
    printed = re.findall(r"`x\[\.\.\., \[([0-9, ]+)\]\] - (-?[0-9.e+]+)`", first.fix)
    assert len(printed) == 2, first.fix
    fixed = x.clone()
    for columns, offset in printed:
        fixed[..., [int(c) for c in columns.split(",")]] -= float(offset)
    with torch.no_grad():
        truth = model.double()(x.double())
        before = model.bfloat16()(x.bfloat16()).double()
        after = model(fixed.bfloat16()).double()
    rel = lambda out: float((out - truth).norm() / truth.norm())  # noqa: E731
    assert rel(after) < rel(before) / 10, (rel(before), rel(after))


def test_centred_features_and_a_small_offset_are_not_named() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, generator=g) * torch.tensor([1.0, 5.0, 1.0]) + torch.tensor([0.0, 10.0, 3.0])
    assert offset_columns(x, torch.bfloat16, []) == []
    x[:, 1] = 37.77 + 0.05 * torch.randn(256, generator=g)  # 755 spreads from zero
    (found,) = offset_columns(x, torch.bfloat16, [])
    assert found.columns == [1] and round(found.offset or 0.0) == 38


class Fraud(nn.Module):
    """A scorer fed unix timestamps with fractions of a second; the research code ran in fp64."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gap = (x[:, 1] - x[:, 0]) / 60.0 - 5.0  # minutes between two events, less five
        return self.net(torch.stack([gap, x[:, 2], gap * x[:, 2]], dim=1))


def test_an_fp32_candidate_gets_the_checked_input_fix_for_its_decisions_not_plan() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    start = 1.7e9 + 86400 * torch.rand(2048, generator=g, dtype=torch.float64)
    x = torch.stack([start, start + 600 * torch.rand(2048, generator=g, dtype=torch.float64),
                     torch.randn(2048, generator=g, dtype=torch.float64)], dim=1)  # fmt: skip
    result = fpdoctor.compare(Fraud().eval(), x, candidate="fp32", reference="fp64")
    names = [f.name for f in result.report.findings]
    assert result.report.findings[0].evidence["kind"] == "input-rounding", str(result.report)
    decisions = [f for f in result.report.findings if f.name == "decisions-changed"]
    assert decisions, names
    (changed,) = decisions
    assert "plan" not in changed.fix, changed.fix
    assert changed.trial is not None and changed.trial.tried, changed
    assert changed.fix.startswith("Subtract one offset"), changed.fix
    assert "kept_in_fp32_tried" not in changed.evidence or changed.evidence["kept_in_fp32_tried"] == []


class Eta(nn.Module):
    """A trip's duration from its pickup and drop-off times (unix seconds with fractions): the two
    columns' ranges do not overlap (half an hour apart), and their difference is what is read."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.stack([(x[:, 1] - x[:, 0]) / 60.0 - 32.0, x[:, 2]], dim=1))


class Bearing(Trip):
    """The trip model reading a latitude's value too (east scaled by its cosine): no offset subtracted
    before the cast leaves the model computing the same thing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        north = (x[:, 2] - x[:, 0]) * 111.0
        east = (x[:, 3] - x[:, 1]) * 111.0 * torch.cos(x[:, 0] * (3.141592653589793 / 180))
        return self.net(torch.stack([north, east, x[:, 4], x[:, 5]], dim=1))


def _fixed(x: torch.Tensor, fix: str) -> torch.Tensor:
    printed = re.findall(r"`x\[\.\.\., \[([0-9, ]+)\]\] - (-?[0-9.e+]+)`", fix)
    assert printed, fix
    fixed = x.clone()
    for columns, offset in printed:
        fixed[..., [int(c) for c in columns.split(",")]] -= float(offset)
    return fixed


def test_columns_whose_ranges_do_not_overlap_but_whose_difference_is_read_share_one_offset() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    start = 1.7e9 + 60 * torch.rand(2048, generator=g, dtype=torch.float64)
    x = torch.stack([start, start + 1800 + 300 * torch.rand(2048, generator=g, dtype=torch.float64),
                     torch.randn(2048, generator=g, dtype=torch.float64)], dim=1)  # fmt: skip
    model = Eta().eval()
    result = fpdoctor.compare(model, x, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.evidence["kind"] == "input-rounding", str(result.report)
    assert [f["columns"] for f in first.evidence["whole_numbers"]] == [[0, 1]], first.evidence
    with torch.no_grad():
        truth = model.double()(x.double())
        before = model.float()(x.float()).double()
        after = model(_fixed(x, first.fix).float()).double()
    rel = lambda out: float((out - truth).norm() / truth.norm())  # noqa: E731
    assert rel(after) < rel(before) / 100, (rel(before), rel(after))


def test_an_offset_fix_is_not_printed_for_a_model_that_reads_the_values_themselves() -> None:
    torch.manual_seed(0)
    result = fpdoctor.compare(Bearing().eval(), _trips(), candidate="bf16")
    assert all(
        "Subtract one offset" not in f.fix and "subtract one offset" not in f.fix for f in result.report.findings
    )
    assert result.report.verdict != "ok", str(result.report)


def test_an_fp8_candidate_still_tries_the_modules_that_give_its_decisions_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 512)).eval()
    result = fpdoctor.compare(model, torch.randn(512, 32), candidate="fp8-e4m3")
    (changed,) = [f for f in result.report.findings if f.name == "decisions-changed"]
    assert changed.evidence["kept_in_fp32_tried"], changed.evidence
    assert changed.trial is not None and changed.trial.tried, changed.trial
