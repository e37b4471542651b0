"""`fpdoctor run` on a dtype or device mismatch: explained from the live model, with the line that
attached the odd module or parameter, not only the line that crashed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from fpdoctor.crash import run_command

pytest.importorskip("torch")

# model.half(), then the head replaced by a fresh (float32) Linear: the forward dies in the head
REPLACED_HEAD = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
model.half()
model[2] = nn.Linear(16, 4)  # REPLACED
model(torch.randn(2, 8).half())
"""

# a parameter swapped for a new float32 one after the cast
SWAPPED_WEIGHT = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
model[0].weight = nn.Parameter(torch.randn(16, 8))  # SWAPPED
model(torch.randn(2, 8, dtype=torch.bfloat16))
"""

# the model moved to another device, then a module attached that was built on the CPU
ATTACHED_AFTER_MOVE = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("meta")
model.append(nn.Linear(4, 2))  # ATTACHED
model(torch.randn(2, 8, device="meta"))
"""


def _line(source: str, mark: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if mark in text)


def _run(tmp_path: Path, source: str, *, breadcrumbs: bool = True) -> tuple[Path, dict]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source).lstrip("\n"))
    result = run_command(
        [sys.executable, str(script)], breadcrumbs=breadcrumbs, stdout=None, stderr=None, environment=False
    )
    assert result.exit_code == 1
    findings = [f for f in result.report.findings if f.name in ("dtype-mismatch", "device-mismatch")]
    assert len(findings) == 1, [f.name for f in result.report.findings]
    return script, findings[0].to_dict()


def test_a_submodule_replaced_after_half_is_named_with_the_line_that_replaced_it(tmp_path):
    source = textwrap.dedent(REPLACED_HEAD).lstrip("\n")
    script, finding = _run(tmp_path, source)
    at = f"{script}:{_line(source, 'REPLACED')}"
    assert finding["name"] == "dtype-mismatch"
    assert finding["evidence"]["assigned"] == "2" and finding["evidence"]["assigned_at"] == at
    assert f"entered at {at}: `2` was assigned a Linear in torch.float32" in finding["message"]
    assert "parameter 2.weight" in finding["message"]  # the operands by name, as trace and audit give them
    assert finding["fix"].startswith(f"at {at}, make the new Linear torch.float16")
    assert "model.get_submodule('2').to(torch.float16)" in finding["fix"]
    assert finding["where"]["module"] == "2"


def test_a_parameter_swapped_after_the_cast_is_named(tmp_path):
    source = textwrap.dedent(SWAPPED_WEIGHT).lstrip("\n")
    script, finding = _run(tmp_path, source)
    at = f"{script}:{_line(source, 'SWAPPED')}"
    assert finding["evidence"]["assigned"] == "0.weight" and finding["evidence"]["assigned_at"] == at
    assert "a parameter in torch.float32" in finding["message"] and "torch.bfloat16" in finding["message"]


def test_a_module_attached_after_the_model_moved_is_a_device_mismatch_named_with_its_line(tmp_path):
    source = textwrap.dedent(ATTACHED_AFTER_MOVE).lstrip("\n")
    script, finding = _run(tmp_path, source)
    at = f"{script}:{_line(source, 'ATTACHED')}"
    assert finding["name"] == "device-mismatch"
    assert finding["evidence"]["assigned"] == "3" and finding["evidence"]["assigned_at"] == at
    assert "`3` was assigned a Linear in cpu there, into the model whose tensors were meta" in finding["message"]
    assert finding["fix"].startswith(f"at {at}, make the new Linear meta before it is assigned: `.to('meta')`")


def test_without_breadcrumbs_the_operands_are_explained_and_the_rerun_names_the_line(tmp_path):
    source = textwrap.dedent(REPLACED_HEAD).lstrip("\n")
    _, finding = _run(tmp_path, source, breadcrumbs=False)
    assert "assigned_at" not in finding["evidence"]
    assert "parameter 2.weight" in finding["message"]
    assert "--breadcrumbs" in finding["fix"] and "names the line that attached" in finding["fix"]
