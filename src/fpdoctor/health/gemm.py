"""The device-side work of a GEMM fingerprint: known answers, seeded digests, throughput.

Runs inside the fingerprint child (`fpdoctor.health.fingerprint`), one device per process, under
deterministic settings (see `deterministic`). Three things per dtype:

- known answer: integer matrices small enough that every partial sum is exact in the dtype's
  accumulator and output, so the product is the same bits on any GPU, any kernel, any split-K,
  and on the CPU. It is checked against an exact int64 reference on the CPU without a host copy
  of the product: two Freivalds projections (C @ g and h @ C) computed exactly in int64 on the
  device are compared with A @ (B @ g) and (h @ A) @ B computed in int64 on the CPU. A single
  wrong integer (|error| < 2**19 by the bounds below) always changes a projection; a value that
  is no longer an integer (a flipped low mantissa bit, NaN, Inf) is counted on the device.
- seeded digests: mantissa-heavy inputs from a counter-based integer hash (the same integers on
  every device, unlike torch's RNG, whose CUDA launch grid depends on the SM count), multiplied
  repeatedly; each product's bits are reduced on the device to three int64 sums, and all repeats'
  sums are read back in one copy. Bitwise equality is only promised within one fingerprint group
  (same GPU model, SM count, MIG profile, cuBLAS, driver): cuBLAS picks kernels by SM count.
- throughput: the repeated GEMMs with their digests, timed from the second call on (the first
  pays for handles, heuristics and lazy loading).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.health.fingerprint import CUBLAS_WORKSPACE
from fpdoctor.torchprivate import has_scaled_mm, scaled_mm

DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
MIN_REPEATS = 3  # two repeats can disagree without saying which is right; three can
MAX_REPEATS = 2000
KNOWN_ANSWER_REPEATS = 3  # an intermittent fault has three chances to show on the known answer


@dataclass(frozen=True)
class KnownAnswerPlan:
    """Integer inputs in [-span, span] with reduction length k: every partial sum is bounded by
    span**2 * k, which the dtype's accumulator and output hold exactly."""

    span: int
    k: int


# fp32/tf32: |sum| <= 64 * 4096 = 2**18 < 2**24 (fp32 significand); tf32 inputs hold 8 exactly.
# fp16 output: |sum| <= 9 * 224 = 2016 <= 2048, the largest run of integers fp16 holds exactly.
# bf16 (and fp8 with bf16 output): |sum| <= 4 * 64 = 256, the same bound for bf16's 8 bits;
# e4m3 holds the inputs in [-2, 2] exactly.
KNOWN_ANSWER = {
    "fp32": KnownAnswerPlan(8, 4096),
    "tf32": KnownAnswerPlan(8, 4096),
    "fp16": KnownAnswerPlan(3, 224),
    "bf16": KnownAnswerPlan(2, 64),
    "fp8": KnownAnswerPlan(2, 64),
}


@dataclass(frozen=True)
class Shapes:
    known_mn: int  # known-answer products are known_mn x known_mn
    mn: int  # seeded products are mn x mn
    k: dict[str, int]  # reduction length of the seeded products, per dtype


# On a GPU the digest (one int64 pass over the product's 16-bit words) costs like a memory copy
# while the GEMM grows with k: k = 65536 keeps the bf16 digest under ~10% of the GEMM on an
# H100/H200 (bf16 4096 x 65536 x 4096 ~ 3 ms). fp32 without TF32 is ~15x slower per flop, so a
# shorter k gives it the same share of the time. On a CPU everything is small: ranks share cores.
GPU_SHAPES = Shapes(known_mn=2048, mn=4096, k={"bf16": 65536, "fp16": 65536, "fp8": 65536, "tf32": 16384, "fp32": 8192})
CPU_SHAPES = Shapes(known_mn=64, mn=64, k={d: 128 for d in DTYPES})

_CHUNK = 1 << 24  # elements generated per step: bounds the int64 temporaries of the hash
_WEIGHT_LIMIT = 1 << 12  # digest weights: keeps every int64 sum far from overflow (see _digest)
_PROJECTION_LIMIT = 1 << 20  # Freivalds weights: |C| <= 2**18, n <= 2**11 -> |C @ g| < 2**49


def deterministic(device: torch.device) -> None:
    """The settings every member of a fingerprint group must share."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # see fingerprint.CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    # torch's defaults, set explicitly so a caller's environment cannot change them: the same
    # kernels as a plain torch.mm. The known answers stay exact under reduced-precision split-K,
    # since every partial sum is bounded by what the output dtype holds (KNOWN_ANSWER).
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    if device.type == "cuda":
        torch.cuda.set_device(device)


def hash_ints(count: int, seed: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """`count` pseudo-random integers in [0, 2**24) from a counter hash: identical on any device.

    The hash is `lowbias32`-style (xorshift-multiply) on 32-bit values held in int64, with
    multipliers below 2**31: no product or sum leaves int64 (signed overflow is undefined in C++,
    so it must not happen) and every step is exact integer arithmetic."""
    x = torch.arange(offset, offset + count, dtype=torch.int64, device=device) & 0xFFFFFFFF
    x = (((x * 0x6C8E9CF5) & 0xFFFFFFFF) + ((seed & 0xFFFFFFFF) * 0x7FEB352D & 0xFFFFFFFF) + 0x165667B1) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 15
    return x >> 8


def _fill(
    shape: tuple[int, int], seed: int, dtype: torch.dtype, device: torch.device, convert: Callable
) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        count = min(_CHUNK, flat.numel() - start)
        flat[start : start + count] = convert(hash_ints(count, seed, device, offset=start))
    return out


def uniform(shape: tuple[int, int], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values in [-1, 1) with a full 24-bit mantissa (exact in float32), rounded to `dtype` once."""
    return _fill(shape, seed, dtype, device, lambda u: (u.to(torch.float32) - 2.0**23) * 2.0**-23)


def integers(shape: tuple[int, int], seed: int, span: int, device: torch.device) -> torch.Tensor:
    """int64 values in [-span, span]."""
    return _fill(shape, seed, torch.int64, device, lambda u: u % (2 * span + 1) - span)


def _storage_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}.get(
        name, torch.float8_e4m3fn
    )


def matmul(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product for dtype `name`; torch.mm is looked up at call time, as user code does."""
    if name == "fp8":

        def fp8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            one = torch.ones((), device=a.device)
            return scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        return fp8

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)  # looked up per call, as in user code: a patched torch.mm is seen

    return mm


def operands(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast to the dtype's storage; fp8's _scaled_mm wants B column-major."""
    dtype = _storage_dtype(name)
    if name == "fp8":
        return a.to(dtype), b.t().contiguous().to(dtype).t()
    return a.to(dtype), b.to(dtype)


def seeded_operands(name: str, device: torch.device, mn: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded inputs [mn, k] and [k, mn], generated straight into the dtype's storage (no
    float32 copy of the whole matrix); fp8's B is the transpose of a generated [mn, k] matrix,
    column-major as _scaled_mm wants it."""
    dtype, index = _storage_dtype(name), DTYPES.index(name)
    a = uniform((mn, k), 101 + 2 * index, dtype, device)
    if name == "fp8":
        return a, uniform((mn, k), 102 + 2 * index, dtype, device).t()
    return a, uniform((k, mn), 102 + 2 * index, dtype, device)


def supported(name: str, device: torch.device) -> str | None:
    """None when dtype `name` runs on `device`, else why not."""
    if name == "tf32":
        return None if device.type == "cuda" else "TF32 is a tensor-core format; a CPU multiplies in fp32"
    if name != "fp8":
        return None
    if not hasattr(torch, "float8_e4m3fn") or not has_scaled_mm():
        return f"torch {torch.__version__} has no float8 matmul"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"fp8 GEMMs need compute capability 8.9 or later; this GPU has {major}.{minor}"
    return None


def _weights(count: int, seed: int, limit: int, device: torch.device) -> torch.Tensor:
    return hash_ints(count, seed, device) % (limit - 1) + 1


def known_answer(name: str, device: torch.device, mn: int) -> dict[str, Any]:
    """Multiply integer matrices KNOWN_ANSWER_REPEATS times; check each product exactly."""
    plan = KNOWN_ANSWER[name]
    cpu = torch.device("cpu")
    a_int = integers((mn, plan.k), 11, plan.span, cpu)  # [mn, k]
    b_int = integers((plan.k, mn), 12, plan.span, cpu)  # [k, mn]
    g = _weights(mn, 13, _PROJECTION_LIMIT, cpu)  # [mn]
    h = _weights(mn, 14, _PROJECTION_LIMIT, cpu)  # [mn]
    # Exact references, O(mn * k): |B @ g| < 2**3 * 2**20 * 2**11, |A @ (B @ g)| < 2**49.
    want_rows = a_int @ (b_int @ g)
    want_cols = (h @ a_int) @ b_int
    a, b = operands(name, a_int.to(device=device, dtype=torch.float32), b_int.to(device=device, dtype=torch.float32))
    g_dev, h_dev = g.to(device), h.to(device)
    mm = matmul(name)
    projections = []
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        for _ in range(KNOWN_ANSWER_REPEATS):
            product = mm(a, b).to(torch.float64)  # [mn, mn], every value an integer the output holds
            exact = product.to(torch.int64)
            # int64 truncates: a flipped low mantissa bit (12 -> 12.0625) must count as wrong too
            not_integer = (product != exact.to(torch.float64)).sum().reshape(1)  # NaN and Inf included
            projections.append(
                torch.cat([(exact * g_dev).sum(dim=1), (exact * h_dev[:, None]).sum(dim=0), not_integer])
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    got = torch.stack(projections).cpu()  # [repeats, 2 * mn + 1]: the one copy to the host
    want = torch.cat([want_rows, want_cols, torch.zeros(1, dtype=torch.int64)])
    bad_repeats = [i for i in range(len(got)) if not torch.equal(got[i], want)]
    result: dict[str, Any] = {
        "ok": not bad_repeats,
        "shape": [mn, plan.k, mn],
        "digest": _hex(want.tolist()) if not bad_repeats else None,
    }
    if bad_repeats:
        first = got[bad_repeats[0]]
        rows = (first[:mn] != want_rows).nonzero().flatten().tolist()
        cols = (first[mn : 2 * mn] != want_cols).nonzero().flatten().tolist()
        result.update(
            wrong_repeats=len(bad_repeats),
            repeats=len(got),
            not_integer=int(first[-1]),
            wrong_rows=len(rows),
            wrong_cols=len(cols),
            first_wrong_rows=rows[:8],
            first_wrong_cols=cols[:8],
        )
    return result


def _hex(values: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, values)).encode()).hexdigest()[:16]


def _digest(c: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Three int64 sums over the product's 16-bit words: plain, row-weighted, column-weighted.

    Any single changed word changes the plain sum; a value moved to another row or column changes
    a weighted one. Bounds: a row sum of <= 2**15 words of < 2**15 is < 2**30, times a weight
    < 2**12, summed over <= 2**14 rows: < 2**56, exact in int64 with no overflow."""
    words = c.contiguous().view(torch.int16).view(c.shape[0], -1).to(torch.int64)  # [m, n * words]
    rows = words.sum(dim=1)  # [m]
    cols = words.sum(dim=0)  # [n * words]
    return torch.stack([rows.sum(), (rows * h).sum(), (cols * g).sum()])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seeded(name: str, device: torch.device, mn: int, k: int, budget_s: float) -> dict[str, Any]:
    """Repeat one seeded GEMM for about `budget_s`; digests of every repeat and the throughput."""
    a, b = seeded_operands(name, device, mn, k)
    words = 2 if _storage_dtype(name) == torch.float32 else 1  # fp8's product is bf16
    h = _weights(mn, 15, _WEIGHT_LIMIT, device)
    g = _weights(mn * words, 16, _WEIGHT_LIMIT, device)
    mm = matmul(name)
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        digests = [_digest(mm(a, b), h, g)]  # first call: handles, heuristics, lazy loading
        _sync(device)
        start = time.perf_counter()
        digests.append(_digest(mm(a, b), h, g))
        _sync(device)
        seconds = time.perf_counter() - start
        # Chunks that at most double, each sized from the time so far and closed by one sync: a
        # device that slows down (or a loaded CPU) overshoots the budget by one chunk at most.
        while len(digests) < MAX_REPEATS and (len(digests) < MIN_REPEATS or seconds < budget_s):
            per_call = max(seconds / (len(digests) - 1), 1e-9)
            chunk = max(1, min(len(digests), MAX_REPEATS - len(digests), int((budget_s - seconds) / per_call)))
            for _ in range(chunk):
                digests.append(_digest(mm(a, b), h, g))
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    host = torch.stack(digests).cpu().tolist()  # [repeats, 3]: the one copy to the host
    counts = Counter("".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in row) for row in host)
    mode, _ = counts.most_common(1)[0]
    return {
        "digest": hashlib.sha256(mode.encode()).hexdigest()[:16],  # same length as the known answer's
        "distinct": len(counts),
        "repeats": len(host),
        "agreeing": counts[mode],
        "shape": [mn, k, mn],
        "tflops": 2.0 * mn * k * mn * (len(host) - 1) / seconds / 1e12,
        "seconds": round(seconds, 4),
    }
