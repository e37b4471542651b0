"""`compare(inputs_as_given=True)` / `--inputs-as-given`: the candidate is fed the inputs in the dtype
the user gives them, for a model that casts them itself. A sensor model that standardises raw fp32
readings near 900 in fp32 (its statistics plain fp32 tensors, which the model's cast leaves alone)
and casts the result to its dtype: fed as given, fp16 loses nothing there and compare says OK; cast
to fp16 before the forward (the default), the readings' rounding is the error. Its standardisation
as a module of its own (a leaf the user wrote) is judged on the inputs as given too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare.compare import ReferenceFailed


class Standardise(nn.Module):
    """Readings to z-scores in fp32, then to the dtype of the layer after it."""

    def __init__(self, like: nn.Linear, n: int = 16) -> None:
        super().__init__()
        self.like = [like]  # not a submodule: the dtype to cast to
        self.mean = 900.0 + torch.linspace(-3, 3, n)  # plain tensors: model.half() leaves them in fp32
        self.std = torch.full((n,), 0.8)

    def forward(self, readings: torch.Tensor) -> torch.Tensor:
        return ((readings.float() - self.mean) / self.std).to(self.like[0].weight.dtype)


class Sensor(nn.Module):
    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n, 64), nn.GELU(), nn.Linear(64, 4))
        self.standardise = Standardise(self.body[0], n)

    def forward(self, readings: torch.Tensor) -> torch.Tensor:
        return self.body(self.standardise(readings))


def _sensor() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    readings = 900.0 + torch.linspace(-3, 3, 16) + 0.8 * torch.randn(512, 16)
    return Sensor().eval(), readings


def _bad(report) -> list[tuple[str, str]]:
    return [(f.name, f.message[:160]) for f in report.findings if f.severity in ("error", "warning")]


def test_fed_as_given_the_model_that_casts_its_own_inputs_is_ok_and_says_how_it_was_fed() -> None:
    model, readings = _sensor()
    given = fpdoctor.compare(model, readings, candidate="fp16", inputs_as_given=True).report
    assert not _bad(given), _bad(given)
    summary = dict(given.data["summary"])
    assert "as given" in summary["inputs fed"]
    # the standardisation, a leaf of its own, is re-run on the readings as given: nothing of its own rounds
    (row,) = [r for r in given.data["modules"] if r["module"] == "standardise"]
    assert row["isolated_rel"] <= 4 * row["floor_rel"], row
    cast = fpdoctor.compare(model, readings, candidate="fp16").report  # readings rounded to fp16 first
    assert _bad(cast) and cast.data["modules"][-1]["propagated_rel"] > 10 * given.data["modules"][-1]["propagated_rel"]


def test_a_model_that_does_not_cast_its_inputs_is_told_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 2)).eval()
    with pytest.raises(ReferenceFailed, match="does not cast them itself"):
        fpdoctor.compare(model, torch.randn(64, 16), candidate="fp16", inputs_as_given=True)
    # inputs of a wider dtype than the candidate's (fp64 research inputs, an fp32 candidate): the reference runs,
    # the candidate's run is where the model shows it does not cast them (trial135)
    with pytest.raises(ReferenceFailed, match="does not cast them itself"):
        fpdoctor.compare(model, torch.randn(64, 16, dtype=torch.float64), candidate="fp32", inputs_as_given=True)
    script = tmp_path / "plain.py"
    script.write_text("import torch\nfrom torch import nn\n\ndef make():\n"
                      "    return nn.Linear(16, 2), torch.randn(8, 16)\n")  # fmt: skip
    cmd = [sys.executable, "-m", "fpdoctor", "compare", f"{script}:make", "--candidate", "fp16", "--inputs-as-given"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 2 and "does not cast them itself" in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_cli_flag(tmp_path: Path) -> None:
    script = tmp_path / "sensor.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compare_inputs_as_given import _sensor as make
    """)
    )
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "fpdoctor", "compare", f"{script}:make", "--candidate", "fp16", "-o", str(out)]
    given = subprocess.run([*cmd, "--inputs-as-given"], capture_output=True, text=True, timeout=240, check=False)
    assert given.returncode == 0, given.stdout + given.stderr
    assert json.loads(out.read_text())["verdict"] == "ok"
    cast = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert cast.returncode == 1, cast.stdout + cast.stderr


def test_a_compiled_candidate_takes_no_inputs_as_given() -> None:
    model, readings = _sensor()
    with pytest.raises(ValueError, match="inputs_as_given"):
        fpdoctor.compare(model, readings, candidate="compiled", inputs_as_given=True)


class RowNorm(nn.Module):
    """Each row of raw readings centred and scaled by its own statistics, in fp32 (the model's fix for
    a one-pass variance in its dtype), cast back to the model's dtype."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = self.weight.dtype, x.float()
        z = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)
        return (z * self.weight.float() + self.bias.float()).to(dtype)


def test_a_row_standardisation_in_fp32_that_amplifies_the_inputs_rounding_is_no_ok() -> None:
    # A bank of strain gauges, each unit at its own offset (300-1000 counts) with a signal of 5-30 on top; each
    # row is standardised by its own mean and spread, in fp32. Cast to bf16 before the call (steps of 2-4
    # there), the readings' differences are rounded: the module's floor is what its exact computation makes
    # of them, no part diverges, and the OK said before hid an error far above the output's rounding. Fed as
    # given, bf16 is fine.
    torch.manual_seed(0)
    model = nn.Sequential(RowNorm(24), nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 1)).eval()
    readings = 300.0 + 700.0 * torch.rand(256, 1) + (5.0 + 25.0 * torch.rand(256, 1)) * torch.randn(256, 24)
    cast = fpdoctor.compare(model, readings, candidate="bf16").report
    first = cast.findings[0]
    assert first.severity == "error" and first.evidence.get("kind") == "input-rounding", _bad(cast)
    assert first.trial is not None and first.trial.tried, first.trial
    assert first.fix.startswith("Pass the inputs to the bf16 model unrounded"), first.fix
    assert first.evidence["fed_as_given_rel"] * 10 < first.evidence["propagated_rel"], first.evidence
    # the fix as printed: the same model fed the readings as they come
    given = fpdoctor.compare(model, readings, candidate="bf16", inputs_as_given=True).report
    assert not _bad(given), _bad(given)
