"""Models whose output or tensors the passes cannot measure as they measure a dense floating output:
ids returned by an argmax (no floating output: every check that reads the output's error stands
down, and the ids are judged), and a sparse adjacency the model holds (a one-line error, exit 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from tests.conftest import run_python


class Bend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 300.0
        return (y * y - 9e4) / 600.0 - x


class Pick(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bend, self.head = Bend(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bend(x)).argmax(-1)


def test_ids_returned_after_a_module_whose_own_op_cancels_are_judged_without_a_crash():
    x = torch.rand(256, 64, generator=torch.Generator().manual_seed(0))
    findings = fpdoctor.compare(Pick(), x, candidate="fp16").report.findings
    first = findings[0]
    assert first.name == "decisions-changed" and "`bend`" in first.fix, [(f.code, f.fix[:80]) for f in findings]


class Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
        self.register_buffer("adj", torch.sparse_coo_tensor(edges, torch.ones(4), (4, 4)).coalesce())
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sparse.mm(self.adj, x))


def test_a_sparse_tensor_the_model_holds_is_refused_in_one_line_naming_it():
    with pytest.raises(ValueError, match=r"dense tensors only, and `adj` \(in the model\) is torch.sparse_coo"):
        fpdoctor.compare(Graph(), torch.randn(4, 8), candidate="bf16")


def test_compare_and_plan_say_so_with_exit_code_2(tmp_path):
    factory = tmp_path / "graph.py"
    factory.write_text(
        "import torch\nfrom tests.precision.test_compare_ids_and_sparse import Graph\n"
        "def make():\n    return Graph(), torch.randn(4, 8)\n"
    )
    for command in ("compare", "plan"):
        done = run_python("-m", "fpdoctor", command, f"{factory}:make", "--candidate", "bf16", timeout=120)
        assert done.returncode == 2, (command, done.stderr)
        assert "is torch.sparse_coo" in done.stderr and "Traceback" not in done.stderr, done.stderr
