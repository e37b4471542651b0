"""Activation checkpointing recomputes a block's forward in the backward, reading what the forward
saved. A NaN the forward made is then met again there, in tensors the trace first sees in the
backward: they are the forward's activations, not data. They never become `nonfinite-input`
("check your data pipeline"), which on a small transformer under fp16 autocast was six errors for a
batch of clean token ids (and 33 on a longer run), ahead of nothing the data did."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import run_fpdoctor

SCRIPT = """
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    V, D, S = 50, 32, 16

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x, mask):
            q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
            scores = q @ k.transpose(-2, -1)  # no 1/sqrt(d)
            scores = scores.masked_fill(mask, float("-inf"))
            x = x + self.proj(torch.softmax(scores, -1) @ v)
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(V, D), nn.Parameter(torch.zeros(S, D))
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.ln, self.out = nn.LayerNorm(D), nn.Linear(D, V)

        def forward(self, idx):
            mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
            x = self.emb(idx) + self.pos
            for b in self.blocks:
                x = checkpoint(b, x, mask, use_reentrant=False)
            return self.out(self.ln(x))

    torch.set_num_threads(1)  # the step at which the scores overflow depends on the threads' sums
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # too large: the scores grow past fp16's range
    scaler = torch.amp.GradScaler("cpu")
    data = torch.randint(0, V, (16, S + 1))
    for step in range(16):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V).float(), data[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
"""


def test_a_recomputed_blocks_saved_activations_are_not_data(tmp_path: Path) -> None:
    script = tmp_path / "checkpointed.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    names = [f["name"] for f in json.loads(report.read_text())["findings"]]
    assert names[0] == "nonfinite-produced" and "nonfinite-input" not in names, names
