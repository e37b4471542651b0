"""How compare measures: evenly strided samples, row subsets of row-local modules, and error
metrics taken in float64 on those samples."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import Fp8Linear, Fp16AccumulateLinear, compute_dtype, fp8_format, fp8_quantize
from fpdoctor.pytrees import tensors_in

# Errors are measured on an evenly strided sample of at most SAMPLE values per module output:
# the relative L2 error of 8192 values is within a few percent of the full tensor's, far finer
# than the 16x divergence threshold, and the cost and memory per module stay independent of the
# activation size. Non-finite values are detected exactly, on every element.
SAMPLE = 8192

# The isolated re-run of a leaf whose rows are computed independently of each other (Linear, norms,
# activations) computes ROWS of them, evenly spread, instead of all: at 1024 rows that is 1/16 of
# the GEMM work, and 64 rows of a layer give a relative error as steady as the whole output's.
# A non-finite value in a row left out is still caught: the candidate pass sees every element,
# and such a leaf is re-run in full.
ROWS = 64
# Exact types: a subclass may override forward with something that mixes rows (it is re-run in full).
_ROW_LOCAL = {
    nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, Fp8Linear, Fp16AccumulateLinear,
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Hardtanh, nn.Softplus, nn.Dropout, nn.Identity,
}  # fmt: skip
_NORMS = {t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None}


def row_width(module: nn.Module) -> int | None:
    """How many trailing dims make one independent row of `module`; None when rows interact."""
    if type(module) in _ROW_LOCAL:
        return 1
    if type(module) in _NORMS:
        shape: tuple[int, ...] = module.normalized_shape  # type: ignore[assignment]
        return len(shape)
    return None


# The same op on inputs of the same shapes, called again and again in one module call (a loop over
# tokens or steps), is judged on its first REPEATS calls and then on every power-of-two-th: the
# cost per op site grows with the log of the loop's length, not with it (compare's budget of 3x
# two forwards holds for a model of thousands of tiny ops), and late calls, where a running state
# has grown, are still judged. Every pass applies the same rule, so their k-th calls still match.
REPEATS = 4


def due(k: int) -> bool:
    """Whether the k-th call (from 0) of a repeated op is judged (see REPEATS)."""
    return k < REPEATS or k & (k - 1) == 0


def spread_index(n: int, k: int, device: torch.device) -> torch.Tensor:
    """k indices evenly spread over range(n), first and last included (k <= n). Made on the device:
    a copy from pageable host memory waits for the device's queue to drain."""
    return torch.linspace(0, n - 1, k, dtype=torch.float64, device=device).round().long()


def row_subset(
    module: nn.Module, args: Any, kwargs: Any, output: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """(ROWS input rows, the fp64 output's same rows, keyword arguments for the re-run) for a
    row-local leaf called on one tensor."""
    width = row_width(module)
    if width is None or kwargs or len(args) != 1 or not isinstance(output, torch.Tensor):
        return None
    (x,) = args
    if not isinstance(x, torch.Tensor) or x.dim() <= width or x.shape[:-width] != output.shape[:-width]:
        return None
    n = math.prod(x.shape[:-width])
    if n <= ROWS:
        return None
    index = spread_index(n, ROWS, x.device)
    # a tensorwise fp8 scale comes from all rows, so the re-run gets the whole input's amax
    extra = {"input_amax": x.abs().amax()} if isinstance(module, Fp8Linear) and not module.rowwise else {}
    return x.reshape(n, *x.shape[-width:])[index], output.reshape(n, *output.shape[-width:])[index], extra


def floating(value: Any) -> Iterator[torch.Tensor]:
    """The non-empty floating tensors in `value` (a tensor, nested containers, a dataclass), detached."""
    for t in tensors_in(value):
        if t.is_floating_point() and t.numel() > 0:
            yield t.detach()


def integral(t: torch.Tensor) -> bool:
    """A tensor of whole numbers by its dtype (token ids, positions, counts): not floating, complex or bool."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def flat_sample(value: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    parts = [t.reshape(-1) for t in floating(value)]
    if not parts:
        return None
    step = sample_step(sum(p.numel() for p in parts))
    # Each part is sampled before it is converted (never a full-size copy), and the result is always
    # a copy: a strided view would keep the whole activation alive for the entire run.
    if len(parts) == 1:
        return parts[0][::step].to(device="cpu", dtype=dtype, copy=True)
    return torch.cat([p[::step].to(device="cpu", dtype=dtype) for p in parts])


def device_sample(value: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """flat_sample() left on the values' device: compare's passes keep their samples there and reduce
    them there, so a module call costs no copy to the host and no wait for the device's queue."""
    parts = [t.reshape(-1) for t in floating(value)]
    if not parts:
        return None
    step = sample_step(sum(p.numel() for p in parts))
    if len(parts) == 1:
        return parts[0][::step].to(dtype=dtype, copy=True)
    device = parts[0].device
    return torch.cat([p[::step].to(dtype=dtype) if p.device == device else p[::step].to(device, dtype) for p in parts])


def launched(device: torch.device) -> bool:
    """Whether each op on `device` is a kernel launched from the host (a GPU): there, the fewer ops
    the better, however much work each does; on a CPU an op costs only its work."""
    return device.type != "cpu"


def largest(value: Any) -> torch.Tensor | None:
    """The largest magnitude among the floating tensors in `value`, a 0-d tensor, not read: NaN when
    one holds NaN (the max propagates it), so the values are all finite exactly when it reads finite.
    One kernel per tensor, where aminmax and the finite tests took five. None for no floating tensor."""
    found = []
    for t in floating(value):
        try:
            if not launched(t.device):  # aminmax is 20x faster than the inf-norm on a CPU
                low, high = torch.aminmax(t)
                found.append(torch.maximum(low.abs(), high.abs()))
            else:  # one kernel launch, where aminmax and their magnitudes are four
                found.append(torch.linalg.vector_norm(t, math.inf))
        except (RuntimeError, NotImplementedError):  # a dtype without them here (fp8)
            found.append(t.float().abs().amax())
    if len(found) <= 1:
        return found[0] if found else None
    device = found[0].device
    return torch.stack(
        [n.to(torch.float64) if n.device == device else n.to(device, torch.float64) for n in found]
    ).amax()


def norm_of(x: torch.Tensor) -> torch.Tensor:
    """l2_norm() as a 0-d float64 tensor on x's device, not read."""
    return torch.linalg.vector_norm(x, dtype=torch.float64)


def relative(diff: float, norm: float) -> float:
    """rel_error() from the two norms it divides, read: the difference's and the truth's."""
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def cosine_of(dot: float, a_norm: float, truth_norm: float) -> float | None:
    """cosine() from its read parts: the dot product and the two norms."""
    if not math.isfinite(a_norm) or a_norm == 0 or truth_norm == 0:
        return None
    return dot / (a_norm * truth_norm)


class Later:
    """A norm or dot product of float64 samples, computed when its Reads is read, together with every
    other of its kind on its device: a fixed number of kernels per pass for all of them, where one
    per figure made a pass's launches grow with its module calls and ops (a GPU's time, when its
    Python is what bounds it). Made by norm_later, diff_later and dot_later."""

    __slots__ = ("at", "device", "kind", "nbytes", "x", "y")

    def __init__(self, kind: str, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self.kind, self.x, self.y = kind, x.reshape(-1), None if y is None else y.reshape(-1).to(x.device)
        self.device = x.device
        self.nbytes = self.x.numel() * self.x.element_size() * (1 if y is None else 2)
        self.at: tuple[torch.Tensor, int] | None = None  # once computed: (its kind's vector, index), unread


def norm_later(x: torch.Tensor) -> Later:
    """||x||, computed at read time (Later)."""
    return Later("norm", x)


def diff_later(x: torch.Tensor, y: torch.Tensor) -> Later:
    """||x - y||, computed at read time (Later)."""
    return Later("diff", x, y)


def dot_later(x: torch.Tensor, y: torch.Tensor) -> Later:
    """x . y, computed at read time (Later)."""
    return Later("dot", x, y)


def _computed(kind: str, items: list[Later], device: torch.device) -> torch.Tensor:
    """The figures of `items` (one kind, one device) as one float64 vector: their operands joined, one
    product, summed per item by index_add (a segment per item), then the square root of the norms'.
    On a CPU, where an op costs no launch, each figure by itself (joining them costs more there)."""
    if not launched(device):
        one = {
            "norm": lambda i: torch.linalg.vector_norm(i.x, dtype=torch.float64),
            "diff": lambda i: torch.linalg.vector_norm(i.x - i.y, dtype=torch.float64),
            "dot": lambda i: torch.dot(i.x.double(), i.y.double()),
        }[kind]
        return torch.stack([one(i) for i in items])
    x = torch.cat([i.x for i in items]).to(torch.float64)
    if kind == "norm":
        product = x.square()
    else:
        y = torch.cat([i.y for i in items if i.y is not None]).to(torch.float64)
        product = (x - y).square_() if kind == "diff" else x.mul_(y)
    lengths = torch.tensor([i.x.numel() for i in items])
    # a copy from pinned memory is queued without waiting for the device
    lengths = lengths.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else lengths.to(device)
    segment = torch.repeat_interleave(torch.arange(len(items), device=device), lengths, output_size=x.numel())
    summed = torch.zeros(len(items), dtype=torch.float64, device=device).index_add_(0, segment, product)
    return summed if kind == "dot" else summed.sqrt_()


class Reads:
    """Device values compare's passes read back together: one wait for the device's queue per
    device and pass, not one per module call or op. On a GPU each host read of a device value
    (float(t), bool(t), a copy to the host) drains the queue: read per module, a pass runs at the
    speed of its Python, the device idle in between; read at the end, the device's work overlaps the
    Python that queues it. `later(values, then)` calls `then` with the values read as floats (a bool
    as 1.0 or 0.0; a Later computed first; a float or None passes through) when `read()` runs, in the
    order they were asked for, so a decision that needs a value made earlier finds it made.

    The Later figures' samples are not all kept to the read: once those waiting on a device hold
    HELD bytes, their figures are computed (queued, not read) and the samples let go, so a pass's
    memory does not grow with the model's depth (it did: ~23 MiB a layer on a 1024-wide encoder on
    a GPU). On a CPU, where joining saves nothing, each figure is computed as it is asked for."""

    HELD = 16 << 20

    def __init__(self) -> None:
        self._asked: list[tuple[list[Any], Callable[..., None]]] = []
        self._waiting: dict[torch.device, dict[str, list[Later]]] = {}
        self._held: dict[torch.device, int] = {}

    def later(self, values: Sequence[torch.Tensor | Later | float | None], then: Callable[..., None]) -> None:
        self._asked.append((list(values), then))
        for v in values:
            if isinstance(v, Later) and v.at is None and v.x is not None:
                device = v.device
                self._waiting.setdefault(device, {}).setdefault(v.kind, []).append(v)
                self._held[device] = held = self._held.get(device, 0) + v.nbytes
                if held > self.HELD or not launched(device):
                    self._compute(device)

    def _compute(self, device: torch.device) -> None:
        """The waiting figures on `device` computed, one vector per kind (not read), samples let go."""
        for kind, items in self._waiting.pop(device, {}).items():
            unique = list({id(item): item for item in items}.values())  # one Later asked twice
            vector = _computed(kind, unique, device)
            for i, item in enumerate(unique):
                item.at, item.x, item.y = (vector, i), None, None  # type: ignore[assignment]  # let go: computed
        self._held[device] = 0

    def read(self) -> None:
        asked, self._asked = self._asked, []
        for device in list(self._waiting):
            self._compute(device)
        # per device one flat list: each figures' vector, then the tensors stacked per dtype (no
        # conversion kernel per value), copied in one go; `offset` says where each value starts
        vectors: dict[torch.device, dict[int, torch.Tensor]] = {}
        plain: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for values, _ in asked:
            for v in values:
                if isinstance(v, Later) and v.at is not None:
                    vectors.setdefault(v.device, {})[id(v.at[0])] = v.at[0]
                elif isinstance(v, torch.Tensor):
                    plain.setdefault(v.device, {}).setdefault(v.dtype, []).append(v)
        offset: dict[int, int] = {}
        flat: dict[torch.device, list[float]] = {}
        for device in {*vectors, *plain}:
            parts, n = list(vectors.get(device, {}).values()), 0
            for vector in parts:
                offset[id(vector)], n = n, n + vector.numel()
            for ts in plain.get(device, {}).values():
                parts.append(torch.stack([t.reshape(()) for t in ts]).to(torch.float64))
                for t in ts:
                    offset[id(t)], n = n, n + 1
            flat[device] = torch.cat(parts).tolist()

        def value(v: Any) -> Any:
            if isinstance(v, Later):
                assert v.at is not None
                return flat[v.device][offset[id(v.at[0])] + v.at[1]]
            if isinstance(v, torch.Tensor):
                return flat[v.device][offset[id(v)]]
            return v

        for values, then in asked:  # a value `then` asks for is read by the next read()
            then(*[value(v) for v in values])

    def __bool__(self) -> bool:
        return bool(self._asked)


def to_host(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """The samples copied to the host in one copy per device (one wait for its queue, not one each)."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(samples):
        if t.device.type == "cpu":
            out[k] = t
        else:
            by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        flat = torch.cat([samples[k].reshape(-1).to(torch.float64) for k in ks]).cpu()
        for k, part in zip(ks, flat.split([samples[k].numel() for k in ks]), strict=True):
            out[k] = part.reshape(samples[k].shape).to(samples[k].dtype)
    return [t for t in out if t is not None]


def all_finite(value: Any) -> bool:
    """Exact: NaN and Inf reach the min or the max (aminmax propagates NaN); one pass, no copy, and
    unlike a sum it cannot overflow on finite values."""
    for t in floating(value):
        try:
            low, high = torch.aminmax(t)
            finite = bool(torch.isfinite(low) & torch.isfinite(high))  # one device sync
        except (RuntimeError, NotImplementedError):  # a dtype without aminmax here (fp8)
            finite = bool(torch.isfinite(t.float()).all())
        if not finite:
            return False
    return True


def l2_norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))  # accumulated in float64


def rel_error(a: torch.Tensor, truth: torch.Tensor, truth_norm: float | None = None) -> float:
    """Relative L2 error; inf when a holds NaN/Inf (its difference norm is then not finite).

    Operands are float64 samples, so an fp32 candidate's ~1e-7 errors are resolved too."""
    norm = l2_norm(truth) if truth_norm is None else truth_norm
    diff = l2_norm(a - truth)
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def cosine(a: torch.Tensor, truth: torch.Tensor, truth_norm: float) -> float | None:
    """Cosine similarity in float64; None when a is non-finite or either side is all zeros."""
    a64 = a.double()
    a_norm = l2_norm(a64)
    if not math.isfinite(a_norm) or a_norm == 0 or truth_norm == 0:
        return None
    return float(torch.dot(a64, truth)) / (a_norm * truth_norm)


def sqnr_db(rel: float) -> float:
    return math.inf if rel == 0 else (-math.inf if math.isinf(rel) else -20.0 * math.log10(rel))


def output_format(candidate: str) -> str:
    """The format the floors of an output's use round it to: the candidate's own, but an fp8
    candidate's layers return the dtype its copy computes in (fp32), never fp8: rounding its logits
    to fp8 is no recipe's, and flips far more than any fp8 model does."""
    if fp8_format(candidate) is None:
        return candidate
    return str(compute_dtype(candidate)).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")


def round_to(t: torch.Tensor, candidate: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The output rounded to the candidate's format: the floor that rounding alone causes. `amax`:
    an fp8 scale's largest magnitude when `t` is a part of the output (the scale is the whole's)."""
    fp8 = fp8_format(candidate)
    if fp8 is not None:
        return fp8_quantize(t, fp8, rowwise=False, amax=amax).to(t.dtype)
    return t.to(compute_dtype(candidate)).to(t.dtype)


def sample_step(total: int) -> int:
    """The stride flat_sample takes over `total` values: every value up to 2 * SAMPLE - 1 of them,
    else a prime of at least 11 (and at least total // SAMPLE). A stride that shares a factor with a
    dimension of the output samples some of its columns only: every 64th value of a [.., 64] output
    is one feature, which may be the one that does not go wrong; a prime above 7 shares none with
    the sizes models use (powers of two, 3 x 2^k, 10^k, ...)."""
    step = total // SAMPLE
    if step < 2:
        return 1
    step = max(step, 11)
    while any(step % d == 0 for d in range(2, math.isqrt(step) + 1)):
        step += 1
    return step
