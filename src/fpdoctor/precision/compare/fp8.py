"""fp8 statistics per Linear: what tensorwise and rowwise scaling do to its input and weight.

With dynamic amax scaling the largest value maps to the format's max, so nothing clips; the
damage is at the other end: when a few outlier channels set the scale, the other values fall
below the smallest subnormal and flush to zero. Only values that matter in their own channel count
(at least SIGNIFICANT of its RMS: an input's feature, a weight's output channel, each weight by what
it adds there: times the RMS of the input feature it multiplies), and the SQNR weighs every channel
alike: the many near-zero outputs of an activation such as GELU flush harmlessly under any recipe,
and an outlier channel's energy does not hide the others' noise. Rowwise scaling (per token for the
input, per output channel for the weight) confines an outlier to its own row. An unscaled cast, the
naive recipe, clips everything beyond the max instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.candidates import Fp8Linear, fp8_quantize
from fpdoctor.precision.metrics import Reads, spread_index
from fpdoctor.report.model import Finding, Trial

# Below 20 dB SQNR, more than 1% of the signal's energy is quantisation noise: we call that unsafe.
MIN_SQNR_DB = 20.0
MAX_UNDERFLOW = 0.01
SIGNIFICANT = 0.01  # a value below 1% of its row's RMS carries under 1e-4 of an average value's energy


# Shares and SQNR are measured on STATS_ROWS evenly spread rows (65536 values at width 1024): the
# scale still comes from the exact amax of the whole tensor, and a 1% underflow share is resolved
# to better than a tenth of a percent.
STATS_ROWS = 64


def _spread_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] <= STATS_ROWS:
        return rows
    return rows[spread_index(rows.shape[0], STATS_ROWS, rows.device)]


def _quality(
    sample: torch.Tensor, amax: torch.Tensor, fp8: torch.dtype, *, dim: int = -1, by: torch.Tensor | None = None
) -> list[torch.Tensor]:  # fmt: skip
    """SQNR's and the flushed share's parts for `sample` (float32 rows) scaled so that `amax` maps to
    the max, on the device, not read: (flushed, significant, noise, signal) -> _read_quality. Each
    value is weighed against its own channel along `dim` (a weight's output channel: its row, -1; an
    input's feature: its column, 0): one outlier channel sets the scale and flushes the others, and
    against the outlier's RMS they would not count, nor would their noise beside its energy. `by`:
    what each value is multiplied by where it is used (a weight's: the RMS of the input feature it
    multiplies), so that a value counts by what it adds to the output, not by its size."""
    q = fp8_quantize(sample, fp8, rowwise=False, amax=amax)  # `amax` per row or per tensor, as given
    used, q_used = (sample, q) if by is None else (sample * by, q * by)
    rms = used.square().mean(dim=dim, keepdim=True).sqrt()
    significant = (used.abs() >= SIGNIFICANT * rms) & (used != 0)
    weight = torch.where(rms > 0, 1.0 / rms, torch.zeros_like(rms))  # every channel counted alike
    return [
        ((q == 0) & significant).sum(),
        significant.sum(),
        torch.linalg.vector_norm((q_used - used) * weight, dtype=torch.float64),
        torch.linalg.vector_norm(used * weight, dtype=torch.float64),
    ]


def _read_quality(flushed: float, significant: float, noise: float, signal: float) -> dict[str, float]:
    sqnr = math.inf if noise == 0 else 20 * math.log10(signal / noise) if signal > 0 else 0.0
    return {"sqnr_db": sqnr, "underflow": flushed / max(1, int(significant))}


def linear_stats(
    name: str, x: torch.Tensor, weight: torch.Tensor, fp8: torch.dtype, reads: Reads | None = None
) -> dict[str, Any]:
    """The row of one fp8 Linear. With `reads`, its figures are filled in when `reads` is read
    (compare's pass reads every device value at its end, not per layer); without, at once."""
    now = reads is None
    reads = Reads() if reads is None else reads
    fmax = torch.finfo(fp8).max
    row: dict[str, Any] = {"module": name, "format": str(fp8).replace("torch.", "")}
    # a weight multiplies its input feature: a weight tiny beside its row's largest can be what the output is
    # made of where its feature is large (a scaler folded into the first Linear: Pa beside ratios)
    features = x.detach().reshape(-1, x.shape[-1]).float() if x.dim() else None
    by = (
        features.square().mean(dim=0, keepdim=True).sqrt()
        if features is not None and features.shape[-1] == weight.shape[-1]
        else None
    )
    for operand, tensor in (("input", x.detach()), ("weight", weight.detach())):
        # exact, on every value: the tensor's scale, and what an unscaled cast would clip
        low, high = torch.aminmax(tensor)
        amax = torch.maximum(low.abs(), high).float()
        clipped = (tensor.abs() > fmax).sum()

        def saturation(clipped: float, operand: str = operand, numel: int = tensor.numel()) -> None:
            row[f"{operand}_unscaled_saturation"] = int(clipped) / max(1, numel)

        reads.later([clipped], saturation)
        sample = _spread_rows(tensor.reshape(-1, tensor.shape[-1])).float()
        recipes = (("tensorwise", amax), ("rowwise", sample.abs().amax(dim=-1, keepdim=True)))
        for recipe, amax in recipes:

            def quality(*parts: float, key: str = f"{operand}_{recipe}") -> None:
                got = _read_quality(*parts)
                row[f"{key}_sqnr_db"], row[f"{key}_underflow"] = got["sqnr_db"], got["underflow"]

            weighed = (
                _quality(sample, amax, fp8, dim=-1, by=by)
                if operand == "weight"
                else _quality(sample, amax, fp8, dim=0)
            )
            reads.later(weighed, quality)
    if now:
        reads.read()
    return row


def _bad(row: dict[str, Any], op: str, recipe: str) -> bool:
    return row[f"{op}_{recipe}_sqnr_db"] < MIN_SQNR_DB or row[f"{op}_{recipe}_underflow"] > MAX_UNDERFLOW


def _unsafe(row: dict[str, Any], recipe: str) -> bool:
    return any(_bad(row, op, recipe) for op in ("input", "weight"))


def weight_lost(row: dict[str, Any], recipe: str) -> str | None:
    """What a Linear's weight loses to fp8 with the candidate's scaling (`recipe`: "tensorwise" or
    "rowwise"), where that is past the bounds NUM007 holds it to; None where it keeps its values."""
    if not _bad(row, "weight", recipe):
        return None
    scales = "one scale for the tensor" if recipe == "tensorwise" else "one scale per row"
    return (
        f"in {row['format']} with {scales} it keeps {row[f'weight_{recipe}_sqnr_db']:.1f} dB SQNR and flushes "
        f"{row[f'weight_{recipe}_underflow']:.1%} of its significant values"
    )


def findings(rows: list[dict[str, Any]]) -> list[Finding]:
    found = []
    for row in rows:
        if not _unsafe(row, "tensorwise"):
            continue
        worst = next(op for op in ("weight", "input") if _bad(row, op, "tensorwise"))
        rowwise_ok = not _bad(row, worst, "rowwise")
        found.append(
            catalog.make(
                "fp8-saturation",
                message=(
                    f"`{row['module']}` in {row['format']} with tensorwise scaling: its {worst} keeps "
                    f"{row[f'{worst}_tensorwise_sqnr_db']:.1f} dB SQNR and loses "
                    f"{row[f'{worst}_tensorwise_underflow']:.1%} of its significant values to zero "
                    "(outliers set the scale); "
                    f"an unscaled cast would clip {row[f'{worst}_unscaled_saturation']:.1%}. "
                    + (
                        f"Rowwise scaling keeps {row[f'{worst}_rowwise_sqnr_db']:.1f} dB and flushes "
                        f"{row[f'{worst}_rowwise_underflow']:.1%}: use the rowwise recipe."
                        if rowwise_ok
                        else "Rowwise scaling does not fix it either: keep this layer in bf16."
                    )
                ),
                where={"module": row["module"], "op": "aten.linear.default", "phase": "forward"},
                evidence={
                    "kind": "fp8",
                    **row,
                    "count": None,
                    "numel": None,
                    "dtype": row["format"],
                    "rowwise_ok": rowwise_ok,
                },
                fix=(
                    "use rowwise scaling for this layer (torchao Float8LinearConfig.from_recipe_name('rowwise'))"
                    if rowwise_ok
                    else f"exclude `{row['module']}` from fp8 (module_filter_fn) and keep it in bf16"
                ),
                trial=Trial.checked(
                    "rowwise scaling instead of tensorwise",
                    metric=f"the {worst}'s SQNR in dB",
                    before=row[f"{worst}_tensorwise_sqnr_db"],
                    after=row[f"{worst}_rowwise_sqnr_db"],
                    on="the example inputs",
                )
                if rowwise_ok
                else Trial.untried(
                    "rowwise scaling was measured and does not fix it; bf16 for this layer is not re-run"
                ),
            )
        )
    return found


def kernels_used(run: nn.Module) -> dict[str, Any]:
    """Which fp8 GEMM the candidate's Linear layers ran: the real kernel or the simulation, and why."""
    layers = [m for m in run.modules() if isinstance(m, Fp8Linear)]
    real = sum(1 for m in layers if m.kernel == "scaled_mm" and m.fallback is None)
    reasons = sorted({m.fallback for m in layers if m.fallback})
    if real == len(layers):
        text = f"torch._scaled_mm (the real fp8 kernel) in all {real} Linear layer(s)"
    elif not reasons:
        text = f"simulated (fake-quant: quantized, dequantized, fp32 GEMM) in all {len(layers)} Linear layer(s)"
    else:
        text = (
            f"torch._scaled_mm in {real} of {len(layers)} Linear layer(s), simulated (fake-quant) in the rest; "
            f"the kernel did not run: {reasons[0]}"
        )
    return {"layers": len(layers), "scaled_mm": real, "fake": len(layers) - real, "fallback": reasons, "text": text}
