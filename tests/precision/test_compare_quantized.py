"""A quantized model (torch.ao's quantize_dynamic) given to compare: it runs in no floating dtype, so
there is no fp64 run to judge it against. The error said to cast the input to float64, which is what
failed; it names the quantized module and asks for the floating model it was made from."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare.compare import ReferenceFailed


def test_a_quantized_model_is_refused_with_its_quantized_module_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of its quantized tensors
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ReferenceFailed) as refused:
        fpdoctor.compare(quantized, torch.randn(8, 16), candidate="bf16")
    text = str(refused.value)
    assert "`0` is a quantized module" in text and "to(torch.float64)" not in text, text
    assert refused.value.fix is not None and "the floating model the quantized one was made from" in refused.value.fix
