"""Values the model's forward makes in its own dtype that the candidate's format rounds before
anything computes with them, and the fix checked: whole numbers past the format's exact range (an
arange of positions, timesteps or counts cast from integers), and random draws (a uniform draw in
bf16 takes bf16's values only: none above 0.996, and 0 among them).

container_ops.OwnOps notes each such line in the fp64 pass (`Made`: a value made in float64 there
follows the model's dtype, so the candidate makes it in its own). Rounding them is not an op's
error: the fp64 output rounded to the format, every op's floor, is exactly as wrong, so no module
or op stands out; what reads their small differences (ALiBi's distance |i - j| between nearby
tokens past position 256 in bf16), or their values near an end (-log(-log(u)) of a Gumbel noise
at u near 1), is wrong. The check decides: the line in fp32, then with the lines after it that read
its values (nonfinite.fp32_lines), their results cast back; a run RAISED_FALLS below the end-to-end
error is the finding, with its figures.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from fpdoctor import catalog
from fpdoctor.precision.compare.container_ops import Made
from fpdoctor.precision.compare.nonfinite import Check, fp32_lines, line_of, source_text
from fpdoctor.precision.profile import RAISED_FALLS, line_spans
from fpdoctor.report.model import Finding, Trial

# Lines after the site tried in fp32 with it: positions go through a product and a cos/sin before
# anything holds them in a range the format places finely (pos, pos * inv_freq, its cos and sin)
LINES_AFTER = 4


def checked(sites: list[Made], check: Check, error: float) -> tuple[Made, int, float, bool] | None:
    """The first site whose fix cures: (the site, lines after it raised with it, the end-to-end error
    then, whether its values stay fp32 for what reads them); None where none does. Its line in fp32
    with the lines after it, cast back; else its line alone kept fp32 (what reads it widens or
    promotes it: a time embedding that calls t.float(), where a cast back would round it again).
    The first one ends the search: one cause, one finding."""
    for site in sites:
        line = line_of(site.location)
        if line is None:
            continue
        more, after = fp32_lines(check, line, error, most=LINES_AFTER)
        if after is not None and after * RAISED_FALLS <= error:
            return site, more, after, False
        kept = check("wide", line, 0)
        if kept is not None and math.isfinite(kept) and kept * RAISED_FALLS <= error:
            return site, 0, kept, True
    return None


# a line whose result is a cast to integers: it ends in .long()/.int()/.short() or .to(<an integer dtype>)
_INTEGER_CAST = re.compile(r"\.(long|int|short)\(\)\s*(#.*)?$|\.to\(\s*(dtype=)?torch\.(u?int\d*|long)\s*\)\s*(#.*)?$")


def finding(
    site: Made, more: int, before: float, after: float, *, label: str, dtype: torch.dtype, wide: bool = False
) -> Finding:
    """NUM020 (whole numbers) or NUM021 (a draw) for `site`, its lines (`more` after it) in fp32
    checked: `before` -> `after`; `wide`: its values kept in fp32 for what reads them (no cast back)."""
    file, number = line_of(site.location) or ("", 0)
    lines = f"line {number}" if more == 0 else f"lines {number}-{number + more}"
    name = str(dtype).removeprefix("torch.")
    code = source_text(site.location)
    code = code[: code.index("  #")].rstrip() if "  #" in code else code  # the code, not its comment
    written = f" (`{code}`)" if code else ""
    kept = "kept in fp32 for what reads them" if wide else f"cast back to {name}"
    checked_text = (
        f"With {lines} computed in fp32, their results {kept}, the end-to-end error goes from "
        f"{before:.3g} to {after:.3g} (checked)."
    )
    last = "it makes" if more == 0 else f"line {number + more} makes"
    evidence = {"location": site.location, "lines_raised": [number, number + more], "error_before": before,
                "error_after": after}  # fmt: skip
    if site.kind == "draw":
        top = float(torch.tensor(1.0, dtype=dtype).nextafter(torch.tensor(0.0, dtype=dtype)))
        zeros = round(4 / torch.finfo(dtype).eps)  # torch gives 0 for a draw that rounds up to 1
        message = (
            f"In {label}, line {number} of {file}{written} draws random numbers in the model's dtype: a draw in "
            f"{name} takes {name}'s values only (a uniform one none above {top:.4g}, and exactly 0 once in {zeros} "
            "draws, where the draw rounded up to 1), and what the lines after it make of them is biased where those "
            f"values are coarsest (a threshold u < p at a small p fires on every 0; a log of u or of 1 - u, a Gumbel "
            f"or exponential noise is capped). {checked_text}"
        )
        fix = (
            f"Draw it in fp32 at line {number} (torch.rand_like(x, dtype=torch.float32): a *_like draw takes x's "
            f"dtype), compute {lines} in fp32 from it, and cast what {last} to {name} (.to(x.dtype)); checked: the "
            f"end-to-end error goes from {before:.3g} to {after:.3g}"
        )
        rule = "random-draw-rounded"
    else:
        limit = 2.0 / torch.finfo(dtype).eps
        message = (
            f"In {label}, line {number} of {file}{written} makes whole numbers up to {site.largest:.0f} in the model's "
            f"dtype; {name} holds whole numbers exactly only up to {limit:.0f}, so those past it are rounded before "
            "anything reads them (relative figures barely move: the large values are nearly right, their small "
            f"differences are not). {checked_text}"
        )
        # a last line that casts to integers (position ids for an embedding) makes no floats to cast back
        back = (
            f"keep what {last} as it is (integers: an index reads them, not {name})"
            if _INTEGER_CAST.search(source_text(f"{file}:{number + more}"))
            else f"keep what {last} in fp32, not cast back: what reads it widens or promotes it (cast back to "
            f"{name}, it is rounded again there)"
            if wide
            else f"cast what {last} to {name} (.to(x.dtype), x the tensor whose dtype the line followed)"
        )
        fix = (
            f"Make them in fp32 at line {number} (dtype=torch.float32 instead of the model's dtype, or the integers "
            f"then .float()), compute {lines} in fp32 from them, and {back}; checked: the end-to-end error goes from "
            f"{before:.3g} to {after:.3g}"
        )
        evidence |= {"largest": site.largest, "exact_up_to": limit}
        rule = "whole-numbers-rounded"
    trial = Trial.checked(
        f"the ops at {lines} of {file} in fp32, their results {kept}",
        metric="end-to-end relative error against fp64",
        before=before,
        after=after,
        on="the inputs given",
    )
    where = {"module": None, "op": None, "phase": "forward"}
    return catalog.make(rule, message=message, fix=fix, where=where, evidence=evidence, trial=trial)


def whole_buffers(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The model's floating buffers of whole numbers past what `dtype` holds exactly (positions up to
    4095 as a float buffer, which the model's cast to fp16 rounds past 2048): name and largest |value|."""
    limit = 2.0 / torch.finfo(dtype).eps
    found = []
    for name, t in model.named_buffers():
        if not t.is_floating_point() or torch.finfo(t.dtype).bits <= torch.finfo(dtype).bits or not t.numel():
            continue
        with torch.no_grad():
            largest = float(t.abs().max())
            if largest > limit and math.isfinite(largest) and bool((t == t.round()).all()):
                found.append((name, largest))
    return found


def buffer_finding(
    names: list[str], largest: float, lines: list[tuple[str, int]], before: float, after: float, *, label: str,
    dtype: torch.dtype, held: str,
) -> Finding:  # fmt: skip
    """NUM020 for buffers of whole numbers the model's cast rounds, one attribute of one module class
    (`held`: how to keep them in fp32), checked with them held in fp32 and the `lines` that read them
    computed in fp32, their results cast back."""
    leaf = names[0].rpartition(".")[2]
    name = f"`{names[0]}`" if len(names) == 1 else f"`{leaf}` of {len(names)} modules (`{names[0]}`, ...)"
    limit = 2.0 / torch.finfo(dtype).eps
    dname = str(dtype).removeprefix("torch.")
    file = lines[0][0] if lines else ""
    at = f"{line_spans([n for _, n in lines])} of {file}" if lines else "the lines that read it"
    message = (
        f"In {label}, the buffer {name} holds whole numbers up to {largest:.0f}, and the model's cast to {dname} "
        f"rounds those past {limit:.0f}, the largest it holds exactly, before anything reads them (relative figures "
        "barely move: the large values are nearly right, their small differences are not: the distance of two "
        f"nearby positions). With {name} kept in fp32 and {at} computed in fp32 from it, their results cast back "
        f"to {dname}, the end-to-end error goes from {before:.3g} to {after:.3g} (checked)."
    )
    fix = (
        f"Keep {name} in fp32 ({held}), compute {at} in fp32 from it, and cast what they make to {dname} where "
        f"the rest reads it (.to(x.dtype), x the tensor it meets); checked: the end-to-end error goes from "
        f"{before:.3g} to {after:.3g}"
    )
    trial = Trial.checked(
        f"{name} held in fp32, the ops at {at} in fp32, their results cast back to {dname}",
        metric="end-to-end relative error against fp64", before=before, after=after, on="the inputs given",
    )  # fmt: skip
    evidence = {
        "buffers": names, "largest": largest, "exact_up_to": limit, "lines_raised": [n for _, n in lines],
        "location": f"{file}:{lines[0][1]}" if lines else None, "error_before": before, "error_after": after,
    }  # fmt: skip
    where = {"module": names[0].rpartition(".")[0] or None, "op": None, "phase": "forward"}
    return catalog.make("whole-numbers-rounded", message=message, fix=fix, where=where, evidence=evidence, trial=trial)


def told(findings: list[Finding], sites: list[Made], dtype: torch.dtype) -> list[Finding]:
    """`findings`, a divergence whose check raised a line that makes whole numbers the candidate
    rounds (upstream of the op it names) saying so: the why behind "what it reads is made at"."""
    limit = 2.0 / torch.finfo(dtype).eps
    name = str(dtype).removeprefix("torch.")
    out = []
    for f in findings:
        lines = set(f.evidence.get("feeding_lines") or []) if f.name == "precision-divergence" else set()
        made = [w for w in sites if w.location in lines and w.kind == "whole"]
        if not made:
            out.append(f)
            continue
        w = made[0]
        number = w.location.rpartition(":")[2]
        out.append(
            dataclasses.replace(
                f,
                message=f"{f.message} Line {number} makes whole numbers up to {w.largest:.0f} in the model's dtype, "
                f"and {name} holds whole numbers exactly only up to {limit:.0f}: those past it are rounded there.",
                evidence={
                    **f.evidence,
                    "whole_numbers": {"location": w.location, "largest": w.largest, "exact_up_to": limit},
                },
            )
        )
    return out
