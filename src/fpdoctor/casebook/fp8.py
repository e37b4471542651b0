"""Incident 5, the fp8 side: which layers survive fp8, and with which scaling recipe.

Float8 rowwise training went NaN at step ~80 on 256 GPUs while bf16 was fine; the NaN itself was
a faulty GPU (the training sentinel's transient-fault verdict). Before blaming fp8, the question
is whether the model's layers are fp8-safe at all: here one Linear has a few outlier output
channels. With tensorwise scaling they set the scale and a fifth of the other weights flush to
zero; rowwise (per output channel) scaling keeps every channel.
"""

from __future__ import annotations

import torch
from torch import nn

from fpdoctor.casebook import Case
from fpdoctor.report.model import Report


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 64))
    first: nn.Linear = model[0]  # type: ignore[assignment]
    with torch.no_grad():
        first.weight[:4] *= 1e5  # four outlier output channels, as trained models grow them
    return model, torch.randn(32, 64)


def diagnose() -> Report:
    import fpdoctor

    model, x = build()
    tensorwise = fpdoctor.compare(model, x, candidate="fp8-e4m3")
    rowwise = fpdoctor.compare(model, x, candidate="fp8-e4m3-rowwise")
    report = tensorwise.report
    report.data["summary"] = [
        *report.data["summary"],
        (
            "rowwise recipe",
            f"end-to-end error {dict(rowwise.report.data['summary'])['end-to-end error']}; "
            f"first divergent module: {rowwise.first_divergent or 'none'}",
        ),
    ]
    return report


FP8_OUTLIERS = Case(
    name="fp8-outlier-channels",
    incident=5,
    title="Which layers are fp8-safe: tensorwise vs rowwise scaling",
    story=(
        "Float8 training went NaN at scale while bf16 was fine. The NaN was a faulty GPU, but the fp8 recipe still "
        "matters: fpdoctor quantizes every Linear's input and weight with tensorwise and rowwise scaling and "
        "shows that a layer with outlier channels loses a fifth of its weights tensorwise and none rowwise."
    ),
    expect=frozenset({"fp8-saturation"}),
    run=diagnose,
)
