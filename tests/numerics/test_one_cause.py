"""Two findings of one cause told from two sides are one finding (numerics/updates/causes.py):
bf16 weights whose updates round away (TRN010, measured on the weights) and the reference step's
update departing already in the optimizer's own step, gone on fp32 copies (TRN018, intended stage).
A departure at the kept stage (code after the step) is another cause and stays its own finding."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.updates.causes import Causes
from fpdoctor.report.model import Finding, Severity, Trial


def _finding(
    name: str, step: int, after: int = 0, severity: Severity = Severity.WARNING, **evidence: object
) -> Finding:
    trial = Trial.checked("fp32 copies", metric="departing", before=3, after=after, on=f"step {step}")
    return Finding(
        code="X", name=name, severity=severity, title=name, message=f"{name} at {step}.", fix="fix",
        where={"rank": None, "phase": evidence.get("stage")}, evidence={"step": step, **evidence}, trial=trial,
    )  # fmt: skip


def test_the_reference_steps_view_folds_into_the_mechanism_where_the_first_of_them_stood() -> None:
    findings: list[Finding] = []
    causes = Causes(findings)
    causes.add(_finding("nonfinite-loss", 1))
    causes.add(_finding("update-departs-from-reference", 1, stage="intended", departed_count=3, compared=4))
    causes.add(_finding("update-rounded-away", 1))
    causes.add(_finding("update-departs-from-reference", 1, stage="intended", departed_count=3, compared=4))
    causes.add(_finding("update-rounded-away", 5))
    assert [f.name for f in findings] == ["nonfinite-loss", "update-rounded-away"]
    merged = findings[1]
    assert merged.evidence["reference_step"]["departed_count"] == 3
    assert merged.evidence["occurrences"] == 2 and merged.evidence["steps"] == [1, 5]
    assert "The reference step measures it" in merged.message and merged.trial is not None
    # a live line named the reference step's finding: the report says where it went
    assert "(what the live line printed as X update-departs-from-reference is this same cause" in merged.message


def test_the_folded_finding_is_as_severe_as_the_more_severe_of_the_two() -> None:
    """A reference step's warning folded into a mechanism told as info is a warning, not dropped to info."""
    findings: list[Finding] = []
    causes = Causes(findings)
    causes.add(_finding("update-departs-from-reference", 1, stage="intended", departed_count=3, compared=4))
    causes.add(_finding("update-rounded-away", 71, severity=Severity.INFO))
    assert [(f.name, f.severity) for f in findings] == [("update-rounded-away", Severity.WARNING)]


def test_a_departure_after_the_step_or_one_fp32_copies_do_not_cure_stays_its_own() -> None:
    findings: list[Finding] = []
    causes = Causes(findings)
    causes.add(_finding("update-rounded-away", 1))
    causes.add(_finding("update-departs-from-reference", 1, stage="kept", departed_count=2, compared=4))
    causes.add(_finding("update-departs-from-reference", 2, after=2, stage="intended", departed_count=2, compared=4))
    assert [f.name for f in findings] == [
        "update-rounded-away", "update-departs-from-reference", "update-departs-from-reference"
    ]  # fmt: skip
    assert "reference_step" not in findings[0].evidence


def test_a_sentinel_on_bf16_weights_tells_the_cause_once_with_the_reference_check(capsys) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.bfloat16()).float(), y)
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        guard.step(step, torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    names = [f.name for f in guard.report.findings]
    assert names.count("update-rounded-away") == 1 and "update-departs-from-reference" not in names, names
    (found,) = guard.report.by_name("update-rounded-away")
    assert found.evidence["reference_step"]["stage"] == "intended"
    assert found.trial is not None and found.trial.after == 0 and "master weights" in found.fix
    said = capsys.readouterr().err
    assert "update-rounded-away" in said, said  # the folded finding is said as it stands
