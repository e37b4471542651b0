"""The budget for `compare`: extra memory O(largest activation), time <= 3x two plain forwards.

A transformer encoder (benchmarks/models.py), eval mode, candidates against fp32. Every
measurement runs in its own subprocess. Besides its leaves, `compare` judges each container's own
ops there: nn.MultiheadAttention's in- and out-projection GEMMs and its attention (computed in
its forward, not in submodules), each layer's residual adds and activation.

Time: two plain forward passes (the fp32 reference and the candidate's copy, e.g. fp16) against
one `compare`, each after a warm-up, alternating, medians. The plain forwards take PyTorch's fused
fast path where it applies (fp32, fp16, bf16); `compare` runs module by module. The budget is
checked on fp16; bf16, simulated fp8 (every Linear input quantized in the forward itself) and
simulated fp16-accumulate are printed beside it.

Memory: the working memory of `compare` = its peak resident memory - the resident memory just
before the call - the weight copies it makes (fp64 and fp16: O(parameters), reported apart).
Measured at 12 and 24 layers: O(largest activation) means it must not grow with depth beyond the
64 KiB sample kept per module call.

Many tiny ops: a streaming model whose forward is a loop of 4096 steps of three elementwise ops
and a select on a running state (16k ops per forward, each microseconds), fp16 and bf16 against
fp32: the same budget for both, with compare and two plain forwards interleaved in one child
(`--tiny` runs this row alone); one torch thread, the budget on CPU time (a shared machine's load
stretches wall time, which is printed beside it). Beside each, its floor: compare's passes, the
fp64 forward under an empty dispatch mode (compare watches every op there, for its containers'
own ops and, under fp16, the op ranges) and the candidate's plain (it watches ops only inside the
module calls that come near the format's max: none here): what watching every op costs before
compare does anything with it. Each own op is re-run on its first
calls and every power-of-two-th after (ownops.REPEATS), so the re-runs grow with the log of the
loop's length.

A per-token loop (`--loop`): the streaming case's shape, a 2-layer linear-attention LM in recurrent
form over 2048 tokens (86k ops, 53k torch function calls per forward), bf16 against fp32, whose
error is made by two running states: compare runs three forwards there (the fp64 pass, the bf16
pass, and the running-state search, whose forward keeps each state in fp64 from its first counted
update on and so is the check of both; the input floor needs none, as token ids are not rounded),
and the row prints each step's share beside the floor: those forwards run plain, and what a torch
function mode (the fp64 pass and the search watch every call through one) adds to a forward before
it does anything.

On a GPU (`--device cuda`) one child measures the same on CUDA, at a compute-bound size (dim
1024, 16 heads, 16 x 512 tokens): fp16 against the budget and fp8-e4m3 with the real fp8 GEMM
(torch._scaled_mm; the report says in how many Linear layers it ran), plain and compare
interleaved per round; memory is the CUDA allocator's peak during one compare beyond the weight
copies, at 12 and 24 layers: the 12 more layers may add less than half the largest activation.

Host reads and launches (`--launches`): what bounds compare on a GPU is not its work but its host
reads of device values (each waits for the device's queue to drain) and its ops (each a launch from
the host). Counted on the CPU, in the form a GPU runs (metrics.launched), per compare of the encoder
at 1, 2, 4 and 8 layers (dim 64, the math attention a GPU's fp64 runs), beside the ops of two plain
forwards; the budget is host reads that do not grow with depth.

Run: python benchmarks/bench_compare.py [--rounds N] [--device cpu|cuda] [--tiny] [--loop] [--launches]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, resource, sys, time, copy
sys.path.insert(0, {here!r})
import torch
from models import small_transformer, batch
from fpdoctor.precision.candidates import compute_dtype, make_run
torch.manual_seed(0)
model = small_transformer(layers=int(sys.argv[2]), dim=256).eval()
tokens, _ = batch(length=128)
embed = model.embed(tokens).detach()
encoder = model.encoder
params = sum(p.numel() for p in encoder.parameters())
mode, candidate = sys.argv[1], sys.argv[3]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
out = {{"params": params}}
if mode == "plain":
    ref = copy.deepcopy(encoder); cand = make_run(encoder, candidate).eval()
    dtype = compute_dtype(candidate)
    # a simulated candidate runs its layers only off the fused fast path, which reads their weights itself
    simulated = candidate not in ("fp16", "bf16")
    def forward(run, x, fastpath):
        torch.backends.mha.set_fastpath_enabled(fastpath)
        run(x)
        torch.backends.mha.set_fastpath_enabled(True)
    with torch.no_grad():
        ref(embed); forward(cand, embed.to(dtype), not simulated)  # warm-up
        start = time.perf_counter()
        ref(embed); forward(cand, embed.to(dtype), not simulated)
        out["seconds"] = time.perf_counter() - start
elif mode == "compare":
    import fpdoctor
    fpdoctor.compare(encoder, embed, candidate=candidate)  # warm-up
    start = time.perf_counter(); fpdoctor.compare(encoder, embed, candidate=candidate)
    out["seconds"] = time.perf_counter() - start
else:  # memory: no warm-up, so the peak belongs to this call
    import fpdoctor
    before = rss()
    fpdoctor.compare(encoder, embed, candidate="fp16")
    out["working"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before - params * (8 + 2)
print(json.dumps(out))
"""


GPU_CHILD = r"""
import copy, json, statistics, sys, time
sys.path.insert(0, {here!r})
import torch
import fpdoctor
from models import small_transformer, batch
from fpdoctor.precision.candidates import compute_dtype, make_run
rounds = int(sys.argv[1])
def setup(layers):
    torch.manual_seed(0)
    model = small_transformer(layers=layers, dim=1024, heads=16).eval().cuda()
    tokens, _ = batch(size=16, length=512, device="cuda")
    with torch.no_grad():
        embed = model.embed(tokens).detach()
    return model.encoder, embed
def timed(fn):
    torch.cuda.synchronize(); start = time.perf_counter(); value = fn(); torch.cuda.synchronize()
    return time.perf_counter() - start, value
encoder, embed = setup(12)
out = {{}}
for candidate in ("fp16", "fp8-e4m3"):
    ref = copy.deepcopy(encoder)
    cand = make_run(encoder, candidate, "scaled_mm").eval()
    x = embed.to(compute_dtype(candidate))
    fastpath = candidate == "fp16"  # the fp8 layers run only off the fused fast path
    def plain():
        with torch.no_grad():
            ref(embed)
            torch.backends.mha.set_fastpath_enabled(fastpath)
            cand(x)
            torch.backends.mha.set_fastpath_enabled(True)
    def comp():
        return fpdoctor.compare(encoder, embed, candidate=candidate, fp8_kernel="scaled_mm")
    plain(); result = comp()  # warm-up
    plains, comps = [], []
    for _ in range(rounds):
        plains.append(timed(plain)[0])
        seconds, result = timed(comp)
        comps.append(seconds)
    row = {{"plain": statistics.median(plains), "compare": statistics.median(comps)}}
    kernel = result.report.data.get("fp8_kernel")
    if kernel:
        row["fp8_kernel"] = kernel["text"]
        row["scaled_mm_layers"] = [kernel["scaled_mm"], kernel["layers"]]
    out[candidate] = row
    del ref, cand
for layers in (12, 24):
    encoder, embed = setup(layers)
    params = sum(p.numel() for p in encoder.parameters())
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fpdoctor.compare(encoder, embed, candidate="fp16")
    torch.cuda.synchronize()
    out[f"working_{{layers}}"] = torch.cuda.max_memory_allocated() - before - params * (8 + 2)
out["gpu"] = torch.cuda.get_device_name()
print(json.dumps(out))
"""


TINY_CHILD = r"""
import contextlib, json, statistics, sys, time
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
import fpdoctor
from fpdoctor.precision.candidates import compute_dtype, make_run

class Streaming(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 16)
    def forward(self, x):
        state = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = torch.tanh(state * 0.9 + x[:, t])
        return self.head(state)

torch.manual_seed(0)
model = Streaming().eval()
x = torch.randn(4, 4096, 16)
candidates = sys.argv[2].split(",")
torch.set_num_threads(1)  # OpenMP's spin-waiting would swamp the CPU time on a shared machine
runs = {{c: (make_run(model, c).eval(), x.to(compute_dtype(c))) for c in candidates}}
def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
def plain(c):
    cand, cx = runs[c]
    def go():
        with torch.no_grad():
            model(x); cand(cx)
    return timed(go)
def comp(c):
    return timed(lambda: fpdoctor.compare(model, x, candidate=c))
class Empty(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls):
        return False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {{}}))
truth, tx = make_run(model, "fp64").eval(), x.double()
def floor(c):  # compare's passes with an empty dispatch mode where compare runs one: the fp64 pass
    cand, cx = runs[c]
    def go():
        with torch.no_grad():
            with Empty():
                truth(tx)
            cand(cx)
    return timed(go)
for c in candidates:
    plain(c); comp(c); floor(c)  # warm-up
rounds = int(sys.argv[1])
p, q, f = ({{c: [] for c in candidates}} for _ in range(3))
for _ in range(rounds):
    for c in candidates:  # interleaved: a change in the machine's load falls on every column alike
        p[c].append(plain(c)); q[c].append(comp(c)); f[c].append(floor(c))
med = statistics.median
out = {{}}
for c in candidates:
    out[c] = {{
        k: {{"wall": med(w for w, _ in v[c]), "cpu": med(u for _, u in v[c])}}
        for k, v in (("plain", p), ("compare", q), ("floor", f))
    }}
print(json.dumps(out))
"""

TINY_CANDIDATES = ("fp16", "bf16")


def tiny_row(rounds: int) -> bool:
    """The many-tiny-ops row: compare against two plain forwards of a 4096-step loop, fp16 and bf16;
    the budget on CPU time (one torch thread), which other jobs on a shared machine do not stretch."""
    argv = [sys.executable, "-c", TINY_CHILD.format(), str(rounds), ",".join(TINY_CANDIDATES)]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    print(f"many tiny ops (a 4096-step loop, 16k ops per forward), against fp32, {rounds} rounds (medians, 1 thread)")
    ok = True
    for candidate in TINY_CANDIDATES:
        row = out[candidate]
        plain, comp, floor = row["plain"], row["compare"], row["floor"]
        ratio = comp["cpu"] / plain["cpu"]
        ok = ok and ratio <= 3.0
        times = f"two plain forwards {plain['cpu'] * 1e3:7.1f} ms   compare {comp['cpu'] * 1e3:7.1f} ms (CPU)"
        print(f"  {candidate:16s} {times}   {ratio:.2f}x (budget <= 3x)  {'PASS' if ratio <= 3.0 else 'FAIL'}")
        print(f"  {'':16s} wall: {plain['wall'] * 1e3:7.1f} ms / {comp['wall'] * 1e3:7.1f} ms = "
              f"{comp['wall'] / plain['wall']:.2f}x")  # fmt: skip
        print(f"  {'':16s} floor: the fp64 pass under an empty dispatch mode {floor['cpu'] / plain['cpu']:.2f}x (CPU)")
    return ok


LOOP_CHILD = r"""
import functools, json, statistics, sys, time
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
import fpdoctor
from fpdoctor.precision.candidates import make_run
from fpdoctor.precision.compare import compare as steps

class Attention(nn.Module):  # linear attention in recurrent form: two running states per token
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = q.softmax(-1), k.softmax(-1)
        kv = x.new_zeros(b, self.heads, d // self.heads, d // self.heads)
        k_sum = x.new_zeros(b, self.heads, d // self.heads)
        ys = []
        for t in range(n):
            kv = kv + k[:, :, t, :, None] * v[:, :, t, None, :]
            k_sum = k_sum + k[:, :, t]
            ys.append((q[:, :, t, None, :] @ kv).squeeze(-2) / (q[:, :, t] * k_sum).sum(-1, keepdim=True))
        return self.out(torch.stack(ys, dim=2).transpose(1, 2).reshape(b, n, d))

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2, self.attn = nn.RMSNorm(d), nn.RMSNorm(d), Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

class LM(nn.Module):
    def __init__(self, vocab=1024, d=128, heads=4, layers=2):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(vocab, d), nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

torch.manual_seed(7)
model = LM().eval()
with torch.no_grad():  # a trained model's sharp feature maps and strong value path: bf16 then drifts
    for block in model.blocks:
        block.attn.qkv.weight[:256].mul_(2.0); block.attn.qkv.weight[256:].mul_(3.0); block.attn.out.weight.mul_(3.0)
tokens = torch.randint(0, 1024, (1, 2048), generator=torch.Generator().manual_seed(0))
torch.set_num_threads(1)
cand = make_run(model, "bf16").eval()
spent = {{}}
def split(owner, name):  # the time compare spends in one of its steps, summed over a call
    f = getattr(owner, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.process_time()
        try:
            return f(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + time.process_time() - t
            spent[name + " calls"] = spent.get(name + " calls", 0) + 1
    setattr(owner, name, w)
for name in ("truth_pass", "candidate_pass", "input_floor", "accumulation", "forced", "result"):
    split(steps._Comparison, name)
for name in ("carried_and_raised", "raised_error", "input_rounding_error"):  # each a forward: the search
    split(steps, name)                            # (and its check), a checked run of its own, the input floor
def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
def plain():
    with torch.no_grad():
        model(tokens); cand(tokens)
found = []
def comp():
    spent.clear()
    result = fpdoctor.compare(model, tokens, candidate="bf16")
    found[:] = [f.name for f in result.report.findings if f.severity in ("error", "warning")]
class Empty(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {{}}))
truth = make_run(model, "fp64").eval()
def bare():  # the forwards compare runs, each plain: what its passes cost before they observe anything
    out = {{}}
    with torch.no_grad():
        for name, run in (("fp64", truth), ("bf16", cand), ("fp32", model)):
            out[name] = timed(lambda: run(tokens))[1]
        with Empty():
            out["bf16 under an empty function mode"] = timed(lambda: cand(tokens))[1]
    return out
timed(plain); timed(comp); bare()  # warm-up
p, q, parts, floors = [], [], [], []
for _ in range(int(sys.argv[1])):
    p.append(timed(plain)); q.append(timed(comp)); parts.append(dict(spent)); floors.append(bare())
med = statistics.median
print(json.dumps({{
    "plain": med(u for _, u in p), "compare": med(u for _, u in q), "wall": med(w for w, _ in q) / med(w for w, _ in p),
    "parts": {{k: med(x[k] for x in parts) for k in parts[0]}}, "findings": found,
    "bare": {{k: med(x[k] for x in floors) for k in floors[0]}},
}}))
"""


def loop_row(rounds: int) -> bool:
    """The per-token-loop row: a 2-layer linear-attention LM in recurrent form over 2048 tokens (the
    streaming case's shape, 86k ops per forward), bf16 against fp32, whose error is made by its two
    running states: compare finds them and checks them together in one forward."""
    argv = [sys.executable, "-c", LOOP_CHILD.format(), str(rounds)]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    ratio = out["compare"] / out["plain"]
    print(f"per-token loop (linear attention, 2 layers x 2048 tokens, 86k ops per forward), bf16 against fp32, "
          f"{rounds} rounds (medians, 1 thread)")  # fmt: skip
    times = f"two plain forwards {out['plain'] * 1e3:7.1f} ms   compare {out['compare'] * 1e3:7.1f} ms (CPU)"
    print(f"  bf16             {times}   {ratio:.2f}x (budget <= 3x)  {'PASS' if ratio <= 3.0 else 'FAIL'}")
    parts, bare, unit = out["parts"], out["bare"], out["plain"]
    runs, checked = parts.get("raised_error calls", 0), parts.get("raised_error", 0.0)
    print(f"  {'':16s} of which: the fp64 pass {parts['truth_pass'] / unit:.2f}x, the bf16 pass "
          f"{parts['candidate_pass'] / unit:.2f}x, the input floor {parts['input_floor'] / unit:.2f}x, the "
          f"running-state search and its check {parts.get('carried_and_raised', 0.0) / unit:.2f}x (one forward), "
          f"{runs:.0f} checked run{'' if runs == 1 else 's'} of its own {checked / unit:.2f}x "
          f"({checked / max(runs, 1) / unit:.2f}x each), "
          f"the decisions and the report "
          f"{parts['result'] / unit:.2f}x; without the checked runs {(out['compare'] - checked) / unit:.2f}x; "
          f"wall {out['wall']:.2f}x")  # fmt: skip
    # the forwards themselves, unobserved: fp64, fp32 where the input floor ran one (the reference on
    # rounded inputs) and bf16 (the candidate pass, the search, the checked runs), and what a function
    # mode's call alone adds to one
    floors = parts.get("input_rounding_error calls", 0)
    floor = (bare["fp64"] + floors * bare["fp32"] + (2 + runs) * bare["bf16"]) / unit  # candidate, search, runs
    mode = (bare["bf16 under an empty function mode"] - bare["bf16"]) / unit
    print(f"  {'':16s} floor: its {3 + floors + runs:.0f} forwards run plain {floor:.2f}x (fp64 "
          f"{bare['fp64'] / unit:.2f}x, bf16 {bare['bf16'] / unit:.2f}x, fp32 {bare['fp32'] / unit:.2f}x; the input "
          f"floor {floors:.0f} forward{'' if floors == 1 else 's'}); an empty function mode adds {mode:.2f}x to a "
          f"forward, and {1 + runs:.0f} bf16 ones and the fp64 pass run under one")  # fmt: skip
    print(f"  {'':16s} findings: {', '.join(out['findings']) or 'none'}")
    return ratio <= 3.0


CANDIDATES = ("fp16", "bf16", "fp8-e4m3", "fp16-accumulate")  # the budget is checked on the first


def run(mode: str, layers: int = 12, candidate: str = "fp16") -> dict[str, float]:
    argv = [sys.executable, "-c", CHILD.format(here=str(HERE)), mode, str(layers), candidate]
    # A fixed mmap threshold makes glibc hand every large freed tensor back at once; its default
    # dynamic threshold keeps freed activations in the heap, so peak RSS would measure allocator
    # history rather than what the code holds.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"} if mode == "memory" else None
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


LAUNCH_CHILD = r"""
import collections, json, sys, warnings
sys.path.insert(0, {here!r})
warnings.simplefilter("ignore")
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
import fpdoctor
from fpdoctor.precision import metrics
from models import small_transformer, batch
metrics.launched = lambda device: True  # the form a GPU runs: figures joined, finiteness from one norm
READS = {{"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.nonzero"}}
METHODS = {{"tolist", "cpu", "numpy", "item", "__bool__", "__float__", "__int__", "__index__"}}
FREE = {{"aten.detach", "aten._unsafe_view", "aten.alias", "aten.lift_fresh"}}  # no kernel, as views
class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.ops = 0; self.reads = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {{}}
        name = str(func.overloadpacket)
        self.reads += name in READS or (name == "aten._to_copy" and str(kwargs.get("device")) == "cpu")
        self.ops += not (func.is_view or name in FREE)
        return func(*args, **kwargs)
class Methods(TorchFunctionMode):
    def __init__(self, ops):
        super().__init__(); self.count = ops
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count.reads += getattr(func, "__name__", "") in METHODS
        return func(*args, **(kwargs or {{}}))
out = {{}}
for layers in (1, 2, 4, 8):
    torch.manual_seed(0)
    model = small_transformer(layers=layers, dim=64, heads=4).eval()
    tokens, _ = batch(size=4, length=80)
    x = model.embed(tokens).detach()
    encoder = model.encoder
    torch.backends.mha.set_fastpath_enabled(False)  # op by op, as compare's own runs are
    with sdpa_kernel(SDPBackend.MATH):  # attention as a GPU runs it in fp64: its ops one by one
        fpdoctor.compare(encoder, x, candidate="fp16")
        seen = Ops()
        with seen, Methods(seen):
            fpdoctor.compare(encoder, x, candidate="fp16")
        plain = Ops()
        with plain, torch.no_grad():
            encoder(x); encoder.half()(x.half())
    out[layers] = {{"reads": seen.reads, "ops": seen.ops, "plain": plain.ops}}
print(json.dumps(out))
"""


def launches_row() -> bool:
    """Host reads and ops launched per compare at 1 to 8 layers, counted on the CPU in the form a GPU
    runs: on a GPU each read waits for the device's queue and each op is a launch from the host, so
    both, not the work, bound compare there. The budget: host reads that do not grow with depth."""
    argv = [sys.executable, "-c", LAUNCH_CHILD.format(here=str(HERE))]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    print("host reads and ops launched per compare (encoder dim 64, 4 x 80 tokens, fp16, the GPU's form, on the CPU)")
    for layers, row in out.items():
        print(
            f"  {layers} layer(s): {row['reads']:4d} host reads   {row['ops']:6d} ops   two plain forwards "
            f"{row['plain']:5d} ops   {row['ops'] / row['plain']:.1f}x"
        )
    reads = [row["reads"] for row in out.values()]
    ok = max(reads) <= reads[0] + 2
    print(f"  host reads grow with depth by {max(reads) - reads[0]} (budget <= 2)  {'PASS' if ok else 'FAIL'}")
    return ok


def use_rows(rounds: int) -> bool:
    """The use metrics' share of compare (decisions over the logits, the top-1 of checked runs), timed
    inside compare, bf16: the budget is <= 10% of compare's time. Logits large against a tiny forward
    (vocabulary 512, width 64) are the worst case; an LM head of width 512 over 8192 tokens is not.
    The third row's bf16 run changes the decisions (a masked vocabulary, the features' offset that
    bf16 rounds the signal out of, as tests/precision/test_compare_decisions.py's MaskedLM): there
    compare also takes the top-1 of each checked run (its fixes and the modules kept in fp32)."""
    import time
    from typing import Any

    import torch
    from torch import nn

    import fpdoctor
    from fpdoctor.precision.compare import use

    class Lm(nn.Module):
        """A language model's shape: embedding, an MLP block, a head to the vocabulary; `masked`: all
        but 32 tokens masked by the head's bias, the features offset by 60 before it."""

        def __init__(self, vocab: int, dim: int, masked: bool = False) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.mix = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.norm = nn.LayerNorm(dim) if masked else None
            self.lm_head = nn.Linear(dim, vocab)
            if self.norm is not None:
                with torch.no_grad():
                    self.norm.bias.fill_(60.0)
                    self.lm_head.weight.sub_(self.lm_head.weight.mean(1, keepdim=True))
                    self.lm_head.bias.fill_(-1e4)
                    self.lm_head.bias[:32] = 0.0

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            h = h + self.mix(h)
            return self.lm_head(h if self.norm is None else self.norm(h))

    spent = [0.0]

    def timed(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return run

    decisions, top1 = use.decisions, use.top1
    use.decisions, use.top1 = timed(decisions), timed(top1)
    ok = True
    print(f"the use metrics' share of compare (bf16 against fp32, {rounds} rounds, medians, in process)")
    try:
        for label, vocab, dim, shape, masked in (
            ("LM, vocabulary 512, width 64, 4 x 256 tokens", 512, 64, (4, 256), False),
            ("LM, vocabulary 8192, width 512, 4 x 128 tokens", 8192, 512, (4, 128), False),
            ("the first, masked: decisions changed", 512, 64, (4, 256), True),
        ):
            shares, totals, changed = [], [], False
            for _ in range(rounds + 1):  # the first is a warm-up
                torch.manual_seed(0)
                model = Lm(vocab, dim, masked).eval()
                tokens = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
                spent[0] = 0.0
                start = time.perf_counter()
                result = fpdoctor.compare(model, tokens, candidate="bf16")
                totals.append(time.perf_counter() - start)
                shares.append(spent[0] / totals[-1])
                changed = any(f.name == "decisions-changed" for f in result.report.findings)
            share, total = statistics.median(shares[1:]), statistics.median(totals[1:])
            ok_row = share <= 0.10 and changed == masked  # the masked row measures what it says
            ok = ok and ok_row
            print(
                f"  {label:48s} compare {total * 1e3:7.1f} ms   use metrics {share:6.1%} (budget <= 10%)  "
                f"{'PASS' if ok_row else 'FAIL'}{'  (decisions changed)' if changed else ''}"
            )
    finally:
        use.decisions, use.top1 = decisions, top1
    return ok


def cuda_rows(rounds: int) -> bool:
    """The GPU row: fp16 against the 3x budget, fp8-e4m3 on torch._scaled_mm beside it, CUDA memory."""
    argv = [sys.executable, "-c", GPU_CHILD.format(here=str(HERE)), str(rounds)]
    child = subprocess.run(argv, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        print(f"CUDA compare child failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
        return False
    out = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"CUDA ({out['gpu']}): 12-layer encoder, dim 1024, 16 x 512 tokens, against fp32, {rounds} rounds (medians)")
    for candidate in ("fp16", "fp8-e4m3"):
        row = out[candidate]
        ratio = row["compare"] / row["plain"]
        if candidate == "fp16":
            judged = f"   {ratio:.2f}x (budget <= 3x)  {'PASS' if ratio <= 3.0 else 'FAIL'}"
        else:
            judged = f"   {ratio:.2f}x; fp8 GEMM: {row.get('fp8_kernel', 'not reported')}"
        times = f"two plain forwards {row['plain'] * 1e3:7.1f} ms   compare {row['compare'] * 1e3:7.1f} ms"
        print(f"  {candidate:16s} {times}{judged}")
    fp8 = out["fp8-e4m3"].get("scaled_mm_layers", [0, 0])
    ok_fp8 = fp8[1] > 0 and fp8[0] == fp8[1]
    share = fp8[0] / fp8[1] if fp8[1] else 0.0
    verdict = "PASS" if ok_fp8 else "FAIL"
    print(f"  {fp8[1]} fp8 Linear layers, on torch._scaled_mm: {share:.0%} (budget 100%)  {verdict}")
    m12, m24 = out["working_12"], out["working_24"]
    # O(largest activation): twelve more layers may add samples, never another activation's worth
    limit = 16 * 512 * 4096 * 8 / 2  # half the fp64 feed-forward activation, bytes
    ok_memory = m24 - m12 <= limit
    print(
        f"  CUDA working memory beyond the weight copies: {m12 / 2**20:.1f} MiB (12 layers), {m24 / 2**20:.1f} MiB "
        f"(24): {(m24 - m12) / 2**20:+.1f} MiB (budget <= {limit / 2**20:.0f} MiB, half the largest activation)  "
        f"{'PASS' if ok_memory else 'FAIL'}"
    )
    ratio = out["fp16"]["compare"] / out["fp16"]["plain"]
    return ratio <= 3.0 and ok_fp8 and ok_memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU row alone")
    parser.add_argument("--tiny", action="store_true", help="the many-tiny-ops row alone")
    parser.add_argument("--loop", action="store_true", help="the per-token-loop row alone")
    parser.add_argument("--launches", action="store_true", help="host reads and ops launched per compare alone")
    parser.add_argument("--use", action="store_true", help="the use metrics' share of compare alone")
    args = parser.parse_args()
    if args.use:
        return 0 if use_rows(args.rounds) else 1
    if args.launches:
        return 0 if launches_row() else 1
    if args.device == "cuda":
        return 0 if cuda_rows(args.rounds) else 1
    if args.tiny:
        return 0 if tiny_row(args.rounds) else 1
    if args.loop:
        return 0 if loop_row(args.rounds) else 1
    plain: dict[str, list[float]] = {c: [] for c in CANDIDATES}
    comp: dict[str, list[float]] = {c: [] for c in CANDIDATES}
    shallow, deep = [], []
    for _ in range(args.rounds):
        for candidate in CANDIDATES:
            plain[candidate].append(run("plain", candidate=candidate)["seconds"])
            comp[candidate].append(run("compare", candidate=candidate)["seconds"])
        shallow.append(run("memory", 12)["working"])
        deep.append(run("memory", 24)["working"])
    m12, m24 = statistics.median(shallow), statistics.median(deep)
    largest = 8 * 128 * 1024 * 8  # the feed-forward activation of the fp64 pass, bytes
    print(f"12-layer encoder, dim 256, 8 x 128 tokens, against fp32, {args.rounds} rounds (medians)")
    for candidate in CANDIDATES:
        t_plain, t_comp = statistics.median(plain[candidate]), statistics.median(comp[candidate])
        budget = " (budget 3x)" if candidate == CANDIDATES[0] else ""
        print(
            f"  {candidate:16s} two plain forwards {t_plain * 1e3:7.1f} ms   compare {t_comp * 1e3:7.1f} ms"
            f"   {t_comp / t_plain:.2f}x{budget}"
        )
    ratio = statistics.median(comp[CANDIDATES[0]]) / statistics.median(plain[CANDIDATES[0]])
    print(f"  working memory beyond the weight copies: {m12 / 2**20:.1f} MiB (12 layers), {m24 / 2**20:.1f} MiB (24)")
    print(f"  = {m12 / largest:.1f}x / {m24 / largest:.1f}x the largest activation ({largest / 2**20:.0f} MiB fp64)")
    ok_time = ratio <= 3.0
    ok_memory = m24 <= 1.5 * m12
    ok_tiny = tiny_row(args.rounds) and loop_row(args.rounds)
    print(f"time {'PASS' if ok_time and ok_tiny else 'FAIL'}, memory {'PASS' if ok_memory else 'FAIL'}")
    return 0 if ok_time and ok_memory and ok_tiny else 1


if __name__ == "__main__":
    sys.exit(main())
