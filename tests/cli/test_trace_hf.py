"""A public trainer under `fpdoctor trace`: the Hugging Face Trainer with a tiny GPT-2 built from a config.

The script is the user's (written to tmp_path, nothing of the trainer copied here); it runs on CPU
with a few steps. fp16=True does not engage fp16 autocast or a GradScaler on CPU (accelerate keeps
the model in fp32 there), so the unscaled-attention case is tests/cli/test_trace_amp.py's plain loop.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import run_fpdoctor

pytest.importorskip("transformers", reason="the Hugging Face Trainer case needs transformers")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate")
pytestmark = pytest.mark.timeout(90)

TRAIN = textwrap.dedent("""
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)


    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}


    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), max_steps=4,
        per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0, learning_rate=float(sys.argv[1]),
    )
    transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
""")


def _trace(tmp_path, lr: str) -> tuple[int, dict]:
    path = tmp_path / "train_gpt2.py"
    path.write_text(TRAIN)
    result = run_fpdoctor("trace", "--format", "json", "--", str(path), lr)
    return result.code, json.loads(result.err[result.err.index('{\n  "schema"') :])


def test_a_healthy_trainer_run_has_no_error(tmp_path):
    code, doc = _trace(tmp_path, "1e-3")
    assert code == 0, doc["findings"]
    assert not [f for f in doc["findings"] if f["severity"] == "error"]
    assert ["optimizer steps", "4"] in doc["data"]["summary"]


def test_a_learning_rate_blow_up_is_told_first(tmp_path):
    code, doc = _trace(tmp_path, "1e4")
    assert code == 1
    # without it, the first finding was a NaN made by accelerate's gradient-norm product at step 2
    first = doc["findings"][0]
    assert first["name"] == "update-blew-up" and first["severity"] == "error"
    assert first["evidence"]["lr"] == 1e4 and first["evidence"]["optimizer_step"] == 1
    assert first["evidence"]["growth"] >= 100
    assert "learning rate" in first["fix"]
    assert any(f["name"] in ("nonfinite-produced", "nonfinite-zeroed") for f in doc["findings"][1:])
