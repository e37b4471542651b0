"""`fpdoctor trace -- SCRIPT.py ARGS` end to end."""

from __future__ import annotations

import json
import textwrap

from tests.conftest import run_fpdoctor

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h / (h - h) if sys.argv[1] == "bad" else h

    torch.manual_seed(0)
    model = nn.Sequential(Scorer(), nn.Linear(8, 1))
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    print("loss", loss.item())
""")


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def test_trace_a_script_that_makes_nan(tmp_path):
    result = run_fpdoctor("trace", "--format", "json", "--", _script(tmp_path), "bad")
    assert result.code == 1
    doc = json.loads(result.out[result.out.index("{") :])
    first = next(f for f in doc["findings"] if f["name"] == "nonfinite-produced")
    assert first["where"]["module"] == "0" and first["where"]["op"] == "aten.div.Tensor"
    assert first["evidence"]["location"].startswith(str(tmp_path / "train.py"))
    assert doc["data"]["summary"][0] == ["script", f"{tmp_path / 'train.py'} bad"]


def test_trace_a_healthy_script(tmp_path):
    result = run_fpdoctor("trace", "--", _script(tmp_path), "good")
    assert result.code == 0 and "loss" in result.out and "OK" in result.out


def test_script_errors_are_reported_with_exit_1(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\nx = torch.ones(2) / 0\nraise RuntimeError('boom')\n")
    result = run_fpdoctor("trace", "--format", "json", "--", str(path))
    assert result.code == 1 and "RuntimeError: boom" in result.err
    doc = json.loads(result.out)
    assert "boom" in doc["data"]["not_checked"]["script"]
    assert [f["name"] for f in doc["findings"]] == ["nonfinite-produced"]


def test_bad_usage(tmp_path, cli):
    missing = cli("trace", "--", str(tmp_path / "none.py"))
    assert missing.code == 2 and "no such script" in missing.err
    bad_dtype = cli("trace", "--dtype", "fp12", "--", _script(tmp_path), "good")
    assert bad_dtype.code == 2 and "--dtype" in bad_dtype.err


def test_autocast_what_if(tmp_path):
    result = run_fpdoctor("trace", "--dtype", "bf16", "--format", "json", "--", _script(tmp_path), "good")
    doc = json.loads(result.out[result.out.index("{") :])
    assert ["autocast", "cpu bfloat16"] in doc["data"]["summary"]
    assert result.code == 0
