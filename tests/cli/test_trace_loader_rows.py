"""`fpdoctor trace -- train.py` on a Hugging Face Trainer script: the rows a NaN is made in are named as
the dataset items of the batch the step read. accelerate's loader fetches the next batch before the
step runs, so the last batch handed out is the next step's (the trace named its items before).

The script is the user's, written to tmp_path and run in-process (the CLI's own code path): a model
called with keyword arguments, token ids, and two items that are all padding (an embedding's sum
of 0, normalised: 0/0)."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("transformers", reason="the Hugging Face Trainer case needs transformers")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate")
pytestmark = pytest.mark.timeout(60)

TRAIN = textwrap.dedent("""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from torch import nn

    PADDING = {21, 41}  # all padding: items 16-31 are the second batch, item 21 its row 5


    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(1, 64, (12,), generator=torch.Generator().manual_seed(i))
            ids = ids * 0 if i in PADDING else ids
            return {"input_ids": ids, "labels": ids}


    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 8, padding_idx=0)
            self.head = nn.Linear(8, 4)

        def forward(self, input_ids, labels=None):
            h = self.embed(input_ids).sum(1)
            return {"loss": self.head(h / h.norm(dim=1, keepdim=True)).pow(2).mean()}


    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)


    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), max_steps=3,
        per_device_train_batch_size=16, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, remove_unused_columns=False, logging_strategy="no",
    )
    InOrder(model=Bag(), args=args, train_dataset=Tokens()).train()
""")


def test_trace_names_the_items_of_the_batch_the_trainers_step_read(tmp_path, cli):
    script = tmp_path / "train_bag.py"
    script.write_text(TRAIN)
    out = tmp_path / "report.json"
    result = cli("trace", "--format", "json", "-o", str(out), "--", str(script))
    assert result.code == 1, result.err
    doc = json.loads(out.read_text())
    first = next(f for f in doc["findings"] if f["name"] == "nonfinite-produced")
    rows = first["evidence"]["experiment"]["rows"]
    # it named item 37, row 5 of the third batch (items 32-47), which accelerate had fetched
    assert rows["indices"] == [5] and rows["dataset_indices"] == [21], rows
    assert "dataset item 21" in first["message"], first["message"]
