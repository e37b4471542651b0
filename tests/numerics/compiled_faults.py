"""Compiled-only faults for the tests: Inductor post-grad passes that change one op's result in
the compiled program only: into NaN (the model's eager ops stay finite), or by a drift. Importable by path, so the
reproducer a fresh interpreter runs installs it as the test did."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


class NanAfterTanh(CustomGraphPass):
    """The first tanh of each graph Inductor compiles returns NaN (its result times NaN)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.tanh.default:
                with graph.inserting_after(node):
                    bad = graph.call_function(torch.ops.aten.mul.Tensor, (node, math.nan))
                node.replace_all_uses_with(bad, delete_user_cb=lambda user, bad=bad: user is not bad)
                return

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class DriftAfterTanh(CustomGraphPass):
    """The first tanh of each graph Inductor compiles returns 10% more: a precision bug of the
    compiled program that no rounding mode explains."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.tanh.default:
                with graph.inserting_after(node):
                    bad = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.1))
                node.replace_all_uses_with(bad, delete_user_cb=lambda user, bad=bad: user is not bad)
                return

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,)) + b"drift"
