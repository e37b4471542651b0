"""torch.cdist's matrix-product distances cancel on points far from the origin: in fp32 against fp64
compare names the model's own cdist (not the readout that amplifies what it is fed), re-runs it in
its direct form and prints that argument, checked; applied as printed the same compare is OK (the
readout's own fp32 loss is its conditioning, the floor). Narrower candidates judged against an fp32
model that is itself far off fp64 are told so first, not judged within its error."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor


class _Prototypes(nn.Module):
    """Nearest-prototype scorer on raw readings near 500 (a spread of a few units): logits are minus
    the distances to 16 class prototypes, then a linear calibration."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.protos = nn.Parameter(500 + 2 * torch.randn(16, 6, generator=g))
        self.calibrate = nn.Linear(16, 16)
        self.mode = "donot_use_mm_for_euclid_dist" if direct else "use_mm_for_euclid_dist_if_necessary"
        with torch.no_grad():
            self.calibrate.weight.copy_(torch.eye(16) + 0.01 * torch.randn(16, 16, generator=g))
            self.calibrate.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, self.protos, compute_mode=self.mode)
        return self.calibrate(-d)


def _readings() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return 500 + 2 * torch.randn(128, 6, generator=g)


def test_cdist_on_far_points_is_named_with_its_direct_form_checked_and_ok_once_applied() -> None:
    result = fpdoctor.compare(_Prototypes(direct=False).eval(), _readings(), candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.severity == "error" and first.evidence["own_op"] == "aten._euclidean_dist.default", str(result.report)
    lines, start = inspect.getsourcelines(_Prototypes.forward)
    at = start + next(i for i, line in enumerate(lines) if "torch.cdist" in line)
    assert first.evidence["own_op_location"].endswith(f"test_compare_stable_forms.py:{at}")
    assert first.fix.startswith("Pass compute_mode='donot_use_mm_for_euclid_dist' to torch.cdist at ")
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    # as printed: the same model calling cdist with that argument
    fixed = fpdoctor.compare(_Prototypes(direct=True).eval(), _readings(), candidate="fp32", reference="fp64")
    assert fixed.report.verdict == "ok", str(fixed.report)


class _Kernel(nn.Module):
    """A Gaussian-kernel regressor on raw readings near 2000 (spread about 1), its readout fitted by
    least squares (weights that cancel): the fp32 model is itself far off fp64 through cdist."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        x = 2000 + torch.randn(1024, 4, generator=g, dtype=torch.float64)
        y = torch.sin(2 * (x[:, 0] - 2000)) + (x[:, 1] - 2000) * (x[:, 2] - 2000)
        centers = x[:48]
        self.sigma = float(torch.cdist(centers, centers).median())
        phi = torch.exp(-(torch.cdist(x, centers) ** 2) / (2 * self.sigma**2))
        a = torch.cat([phi, torch.ones(len(x), 1, dtype=torch.float64)], 1)
        sol = torch.linalg.solve(a.T @ a + 1e-4 * torch.eye(49, dtype=torch.float64), a.T @ y)
        self.centers = nn.Parameter(centers.float())
        self.readout = nn.Linear(48, 1)
        with torch.no_grad():
            self.readout.weight.copy_(sol[:-1][None])
            self.readout.bias.fill_(float(sol[-1]))
        self.mode = "donot_use_mm_for_euclid_dist" if direct else "use_mm_for_euclid_dist_if_necessary"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, self.centers, compute_mode=self.mode)
        return self.readout(torch.exp(-(d**2) / (2 * self.sigma**2))).squeeze(-1)


def test_a_narrower_candidate_is_told_first_that_its_fp32_floor_model_is_broken() -> None:
    x = 2000 + torch.randn(256, 4, generator=torch.Generator().manual_seed(3))
    result = fpdoctor.compare(_Kernel(direct=False).eval(), x, candidate="fp16")
    first = result.report.findings[0]
    assert first.evidence.get("kind") == "reference-broken", str(result.report)
    assert first.severity == "error" and "--candidate fp32 --reference fp64" in first.fix
    assert first.trial is not None and not first.trial.tried and first.trial.reason
    # as printed: fp32 against fp64 names the cdist and its direct form, checked
    fp32 = fpdoctor.compare(_Kernel(direct=False).eval(), x, candidate="fp32", reference="fp64")
    assert fp32.report.findings[0].fix.startswith("Pass compute_mode="), str(fp32.report)
    fixed = fpdoctor.compare(_Kernel(direct=True).eval(), x, candidate="fp16")
    assert all(f.evidence.get("kind") != "reference-broken" for f in fixed.report.findings), str(fixed.report)
    assert fpdoctor.compare(_Kernel(direct=True).eval(), x, candidate="fp32", reference="fp64").report.verdict == "ok"


def test_plan_against_a_broken_fp32_model_is_no_plan_and_an_error() -> None:
    x = 2000 + torch.randn(256, 4, generator=torch.Generator().manual_seed(3))
    result = fpdoctor.plan(_Kernel(direct=False).eval(), x, candidate="fp16", metric="rel")
    report, the_plan = result.report, result.plan
    assert report.verdict == "error" and report.findings[0].evidence.get("kind") == "reference-broken", str(report)
    assert dict(report.data["summary"])["keep in fp32"].startswith("no module set is the fix")
    assert not any(f.fix.startswith("apply the plan") for f in report.findings), [f.fix for f in report.findings]
    with pytest.raises(ValueError, match="no set of modules kept in fp32 is the fix"):
        fpdoctor.apply_plan(_Kernel(direct=False).eval(), the_plan)


class _TwoTables(nn.Module):
    """Two prototype tables, each by its own torch.cdist line: the direct form on one line alone is
    not the fix, and no fix names one line as checked when both were changed."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p1 = nn.Parameter(500 + 2 * torch.randn(16, 6, generator=g))
        self.p2 = nn.Parameter(500 + 2 * torch.randn(16, 6, generator=g))
        self.calibrate = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = torch.cdist(x, self.p1)
        d2 = torch.cdist(x, self.p2, 2.0, "use_mm_for_euclid_dist_if_necessary")  # compute_mode by position
        return self.calibrate(-torch.cat([d1, d2], -1))


def test_the_direct_form_names_every_line_its_check_changed() -> None:
    x = 500 + 2 * torch.randn(128, 6, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(_TwoTables().eval(), x, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.fix.startswith("Pass compute_mode="), str(result.report)
    lines, start = inspect.getsourcelines(_TwoTables.forward)
    at = [f"test_compare_stable_forms.py:{start + i}" for i, line in enumerate(lines) if "torch.cdist" in line]
    assert all(a in first.fix and a in first.trial.changed for a in at), (at, first.fix)
    assert first.trial.tried and first.trial.after * 100 <= first.trial.before


def test_a_small_output_whose_floor_is_rounding_is_not_a_broken_fp32_model() -> None:
    """fp16's spacing near 2e-7 is a quarter of the values: a large floor that is rounding's, not fp32's."""

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2e-7

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Scale()).eval()
    result = fpdoctor.compare(model, torch.randn(64, 8), candidate="fp16")
    assert all(f.evidence.get("kind") != "reference-broken" for f in result.report.findings), str(result.report)
