"""`fpdoctor audit MODEL` end to end, and MODEL specs that cannot load (exit 2, one line)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_fpdoctor
from tests.precision.factories import loads_strict


def test_audit_module_spec():
    result = run_fpdoctor("audit", "fpdoctor.casebook.unet:build", "--format", "json")
    assert result.code == 1
    doc = loads_strict(result.out)
    assert {f["name"] for f in doc["findings"]} == {"dtype-mismatch", "mixed-dtype-parameters"}


def test_audit_file_spec(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4)\n"
    )
    result = run_fpdoctor("audit", f"{path}:make")
    assert result.code == 0 and "OK" in result.out


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no-colon", "MODEL must be"),
        ("/no/such/file.py:make", "no such file"),
        ("no.such.module:make", "No module named"),
        ("fpdoctor.casebook.unet:missing", "has no factory"),
        ("fpdoctor.casebook.unet:TinyUNet", "returned a model without inputs; it must return (model, inputs)"),
    ],
)
def test_bad_model_specs(spec, words, cli):
    result = cli("audit", spec)
    assert result.code == 2 and words in result.err and len(result.err.strip().splitlines()) == 1


def test_factory_that_raises(tmp_path, cli):
    path = tmp_path / "broken.py"
    path.write_text("def make():\n    raise ValueError('no weights here')\n")
    result = cli("audit", f"{path}:make")
    assert result.code == 2 and "raised ValueError: no weights here" in result.err


@pytest.mark.parametrize(
    ("device", "words"),
    [
        pytest.param(
            "cuda",
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device"),
        ),
        pytest.param(
            "mps",
            "no Apple MPS device",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple MPS device"),
        ),
    ],
)
def test_unavailable_device(cli, device, words):
    result = cli("audit", "fpdoctor.casebook.unet:build", "--device", device)
    assert result.code == 2 and words in result.err and len(result.err.strip().splitlines()) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_audit_on_cuda(cli):
    result = cli("audit", "fpdoctor.casebook.unet:build", "--device", "cuda", "--format", "json")
    doc = loads_strict(result.out)
    assert result.code == (1 if doc["verdict"] == "error" else 0)
    assert list(doc["data"]["devices"]) == ["cuda:0"]
