"""A softmax over a row where every position is masked (-inf everywhere: an empty memory, a fully
padded sequence) is 0/0 in every precision. trace says so, rather than pointing at a finding of the
mask that does not exist, and its fix writes the masked tensor's own finite minimum at the mask's
line; applied as printed, the NaN is gone. The case: a pointer network's log-softmax over a memory
whose padding mask covers every slot of some rows, the mask written in place."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

POINTER = """
import torch
from torch import nn
torch.manual_seed(0)
class Pointer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
    def forward(self, query, memory, pad):
        scores = self.q(query) @ self.k(memory).transpose(1, 2) / 32 ** 0.5
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        return torch.log_softmax(scores, dim=-1)
model = Pointer().eval()
query, memory = torch.randn(16, 5, 32), torch.randn(16, 12, 32)
lengths = torch.randint(1, 13, (16,))
lengths[::4] = 0  # memories with nothing in them
pad = torch.arange(12)[None, :] >= lengths[:, None]
with torch.no_grad():
    out = model(query, memory, pad)
print("NAN ROWS", int(out.isnan().any(-1).sum()))
"""


def _trace(tmp_path: Path, script: Path) -> dict:
    return report_of(tmp_path, "trace", "--", str(script))


def test_a_softmax_of_rows_masked_everywhere_is_named_so_and_the_finite_fill_works_as_printed(tmp_path):
    script = tmp_path / "pointer.py"
    script.write_text(POINTER)
    first = _trace(tmp_path, script)["findings"][0]
    assert first["name"] == "nonfinite-produced" and first["evidence"].get("fully_masked"), first["title"]
    assert "every position is masked" in first["message"], first["message"]
    line = next(n for n, text in enumerate(POINTER.splitlines(), 1) if "masked_fill_" in text)
    assert f"Write a finite fill instead of -inf at line {line} of pointer.py" in first["fix"], first["fix"]
    assert "torch.finfo(scores.dtype).min" in first["fix"], first["fix"]
    script.write_text(POINTER.replace('float("-inf")', "torch.finfo(scores.dtype).min"))
    fixed = _trace(tmp_path, script)
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]


# the mask added to the scores (an additive bias of -inf), the softmax taken in fp32 after an fp16 forward
ADDITIVE = """
import torch
from torch import nn
torch.manual_seed(0)
class Attend(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
    def forward(self, query, memory, pad):
        scores = self.q(query) @ self.k(memory).transpose(1, 2) * 4.0
        bias = torch.zeros(pad.shape, dtype=scores.dtype)
        bias[pad] = float("-inf")
        scores = scores + bias[:, None, :]
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
model = Attend().half().eval()
query, memory = torch.randn(16, 5, 32).half(), torch.randn(16, 12, 32).half()
lengths = torch.randint(1, 13, (16,))
lengths[::4] = 0
pad = torch.arange(12)[None, :] >= lengths[:, None]
with torch.no_grad():
    out = model(query, memory, pad)
print("NAN ROWS", int(out.isnan().any(-1).sum()))
"""


def test_an_additive_mask_gets_a_quarter_of_the_formats_minimum_at_its_own_line_and_it_works_as_printed(tmp_path):
    """Past the addition and the softmax's own cast to fp32, the line that wrote the -inf is the mask's,
    its format fp16's; the fill leaves the scores room (finfo.min alone plus a negative score is -inf)
    and stays clear of the range's top half."""
    script = tmp_path / "attend.py"
    script.write_text(ADDITIVE)
    first = _trace(tmp_path, script)["findings"][0]
    line = next(n for n, text in enumerate(ADDITIVE.splitlines(), 1) if 'bias[pad] = float("-inf")' in text)
    assert first["evidence"].get("fully_masked"), first["title"]
    said = f'at line {line} of attend.py (`bias[pad] = float("-inf")`): torch.finfo(torch.float16).min / 4'
    assert said in first["fix"], first["fix"]
    script.write_text(ADDITIVE.replace('float("-inf")', "torch.finfo(torch.float16).min / 4"))
    assert _trace(tmp_path, script)["verdict"] == "ok"


def test_rows_that_overflowed_to_minus_inf_are_not_called_masked(tmp_path):
    """-d2 with d2 past fp16's range: -inf that no mask wrote. The overflow is the cause, not a mask."""
    script = tmp_path / "dist.py"
    script.write_text(
        "import torch\n"
        "x = torch.randn(8, 16).half() * 2\n"
        "x[3] = 80\n"  # one query far from every key: its squared distances pass 65504
        "keys = torch.randn(10, 16).half()\n"
        "d2 = ((x[:, None, :] - keys[None]) ** 2).sum(-1)\n"
        "print(torch.softmax(-d2, dim=-1).isnan().sum())\n"
    )
    found = _trace(tmp_path, script)["findings"]
    assert found and not any(f["evidence"].get("fully_masked") for f in found), [f["title"] for f in found]


def test_a_mask_built_in_fp32_and_cast_to_fp16_gets_fp16s_fill(tmp_path):
    """The -inf written in fp32, cast to fp16 on its way to the scores: the fill must hold in fp16
    (fp32's minimum is -inf there)."""
    source = ADDITIVE.replace(
        'bias = torch.zeros(pad.shape, dtype=scores.dtype)\n        bias[pad] = float("-inf")\n',
        'bias = torch.zeros(pad.shape).masked_fill(pad, float("-inf")).to(scores.dtype)\n',
    )
    assert source != ADDITIVE
    script = tmp_path / "cast.py"
    script.write_text(source)
    first = _trace(tmp_path, script)["findings"][0]
    assert first["evidence"].get("fully_masked") and "torch.finfo(torch.float16).min / 4" in first["fix"], first["fix"]
    script.write_text(source.replace('float("-inf")', "torch.finfo(torch.float16).min / 4"))
    assert _trace(tmp_path, script)["verdict"] == "ok"
