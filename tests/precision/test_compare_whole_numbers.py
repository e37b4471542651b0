"""Whole numbers kept in a floating input past what the candidate's format holds exactly (item ids
beside a tabular batch's features, timesteps read back as indices): rounding them makes the model
read other rows, no module diverges, and the error is the input floor's. compare is never OK there:
it names the column, says the format's exact range, and checks the fix (the reference fed the inputs
rounded everywhere but there). A float input without such values, or whole numbers the format holds,
keeps the verdict it had."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare.input_cause import exact_whole, whole_numbers


class Tabular(nn.Module):
    """Features and an item id in one float row, as `torch.tensor(df.values)` makes them."""

    def __init__(self, items: int = 4096, features: int = 12, width: int = 32) -> None:
        super().__init__()
        self.item, self.num = nn.Embedding(items, width), nn.Linear(features, width)
        self.head = nn.Sequential(nn.SiLU(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.num(x[:, :-1]) + self.item(x[:, -1].long()))


class Timesteps(nn.Module):
    """A sequence model fed the timesteps of its frames as floats (a keyword), read as indices."""

    def __init__(self, steps: int = 8192, width: int = 32) -> None:
        super().__init__()
        self.when, self.proj = nn.Embedding(steps, width), nn.Linear(width, width)

    def forward(self, frames: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.proj(frames + self.when(t.long()))


def _tabular(largest: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, largest, (512, 1)).float()
    return Tabular().eval(), torch.cat([torch.randn(512, 12), ids], dim=1)


def test_item_ids_past_bf16s_whole_numbers_are_named_with_the_fix_checked() -> None:
    model, x = _tabular(4000)
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert result.report.verdict == "error", str(result.report)
    first = result.report.findings[0]
    assert first.evidence["kind"] == "input-rounding", str(result.report)
    assert first.evidence["whole_numbers"] == [
        {"input": "inputs[0]", "columns": [12], "largest": first.evidence["whole_numbers"][0]["largest"],
         "changed": first.evidence["whole_numbers"][0]["changed"]}
    ]  # fmt: skip
    assert first.evidence["whole_numbers"][0]["largest"] > 256
    assert "column 12 of `inputs[0]`" in first.message.lower() and "256" in first.message
    assert "integer tensor" in first.fix
    trial = first.trial
    assert trial is not None and trial.tried, first
    assert isinstance(trial.before, float) and isinstance(trial.after, float)
    assert trial.after < trial.before / 100, trial  # the ids kept exact: the floor is gone
    # the fix applied as printed: ids as an integer tensor, the features in bf16
    with torch.no_grad():
        truth = model.double()(x.double())
        fixed = model.bfloat16().head(
            model.num(x[:, :-1].bfloat16()) + model.item(x[:, -1].long())
        ).double()  # fmt: skip
    assert float((fixed - truth).norm() / truth.norm()) < 0.05


def test_timesteps_past_fp16s_whole_numbers_are_named_in_a_keyword_input() -> None:
    torch.manual_seed(0)
    model = Timesteps().eval()
    inputs = {"frames": torch.randn(256, 32), "t": torch.randint(0, 8000, (256,)).float()}
    result = fpdoctor.compare(model, inputs, candidate="fp16")
    first = result.report.findings[0]
    assert first.evidence["kind"] == "input-rounding", str(result.report)
    assert first.evidence["whole_numbers"][0]["input"] == "inputs['t']"
    assert first.evidence["whole_numbers"][0]["columns"] is None  # the whole 1-D tensor
    assert "2048" in first.message
    assert first.trial is not None and first.trial.tried and first.trial.after < first.trial.before / 100


def test_ids_the_format_holds_keep_an_ok_verdict() -> None:
    model, x = _tabular(200)  # bf16 holds every whole number up to 256
    assert not whole_numbers(x, torch.bfloat16)
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert result.report.verdict == "ok", str(result.report)


def test_whole_numbers_are_judged_against_the_formats_exact_range() -> None:
    assert (exact_whole(torch.bfloat16), exact_whole(torch.float16), exact_whole(torch.float8_e4m3fn)) == (
        256.0, 2048.0, 16.0,
    )  # fmt: skip
    x = torch.tensor([[0.5, 301.0, 3.0], [1.5, 1001.0, 7.0]])
    (found,) = whole_numbers(x, torch.bfloat16)
    assert found.columns == [1] and found.largest == 1001.0 and found.changed == 1.0  # 300, 1000 in bf16
    assert whole_numbers(x, torch.float16) == []  # fp16 holds them all
    assert whole_numbers(x.double(), torch.float32) == []  # past 2^24 only


def test_plan_names_the_whole_numbers_and_no_ill_conditioned_model_beside_them() -> None:
    model, x = _tabular(4000)
    report = fpdoctor.plan(model, x, candidate="bf16").report
    inputs = [f for f in report.findings if f.evidence.get("kind") == "input-rounding"]
    assert len(inputs) == 1 and "whole_numbers" in inputs[0].evidence, str(report)
    assert inputs[0].trial is not None and inputs[0].trial.tried
    assert report.verdict == "error"
    rows = dict(report.data["summary"])
    assert rows["keep in fp32"].startswith("no module set is the fix"), rows
