"""Whole numbers the model's forward makes in its own dtype (an arange of positions, timesteps or
counts cast from integers) past what the candidate's format holds exactly, and the fix checked.

container_ops.OwnOps notes each such line in the fp64 pass (`WholeMade`: a value made in float64
there follows the model's dtype, so the candidate makes it in its own). Rounding them is not an
op's error: the fp64 output rounded to the format, every op's floor, is exactly as wrong, so no
module or op stands out, and the relative error barely moves, the large values being nearly
right. What reads their small differences is wrong (ALiBi's distance |i - j| between nearby
tokens past position 256 in bf16). The check decides: the line in fp32, then with the lines after
it that read its values (nonfinite.fp32_lines), their results cast back; a run RAISED_FALLS below
the end-to-end error is the finding, with its figures.
"""

from __future__ import annotations

import dataclasses

import torch

from fpdoctor import catalog
from fpdoctor.precision.compare.container_ops import WholeMade
from fpdoctor.precision.compare.nonfinite import Check, fp32_lines, line_of, source_text
from fpdoctor.precision.profile import RAISED_FALLS
from fpdoctor.report.model import Finding, Trial


def checked(sites: list[WholeMade], check: Check, error: float) -> list[tuple[WholeMade, int, float]]:
    """Per site whose fix cures: (the site, lines after it raised with it, the end-to-end error then).
    The first site that cures ends the search: one cause, one finding."""
    for site in sites:
        line = line_of(site.location)
        if line is None:
            continue
        more, after = fp32_lines(check, line, error)
        if after is not None and after * RAISED_FALLS <= error:
            return [(site, more, after)]
    return []


def finding(site: WholeMade, more: int, before: float, after: float, *, label: str, dtype: torch.dtype) -> Finding:
    """NUM020 for `site`, its lines (`more` after it) in fp32 checked: `before` -> `after`."""
    file, number = line_of(site.location) or ("", 0)
    lines = f"line {number}" if more == 0 else f"lines {number}-{number + more}"
    name = str(dtype).removeprefix("torch.")
    limit = 2.0 / torch.finfo(dtype).eps
    code = source_text(site.location)
    code = code[: code.index("  #")].rstrip() if "  #" in code else code  # the code, not its comment
    written = f" (`{code}`)" if code else ""
    message = (
        f"In {label}, line {number} of {file}{written} makes whole numbers up to {site.largest:.0f} in the model's "
        f"dtype; {name} holds whole numbers exactly only up to {limit:.0f}, so those past it are rounded before "
        "anything reads them (relative figures barely move: the large values are nearly right, their small "
        f"differences are not). With {lines} computed in fp32, their results cast back to {name}, the end-to-end "
        f"error goes from {before:.3g} to {after:.3g} (checked)."
    )
    fix = (
        f"Make them in fp32 at line {number} (dtype=torch.float32 instead of the model's dtype, or the integers "
        f"then .float()), compute {lines} in fp32 from them, and cast what "
        f"{'it makes' if more == 0 else f'line {number + more} makes'} to {name} (.to(x.dtype), x the tensor "
        f"whose dtype the line followed); checked: the end-to-end error goes from {before:.3g} to {after:.3g}"
    )
    trial = Trial.checked(
        f"the ops at {lines} of {file} in fp32, their results cast back to {name}",
        metric="end-to-end relative error against fp64",
        before=before,
        after=after,
        on="the inputs given",
    )
    return catalog.make(
        "whole-numbers-rounded",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "forward"},
        evidence={"location": site.location, "largest": site.largest, "exact_up_to": limit,
                  "lines_raised": [number, number + more], "error_before": before, "error_after": after},
        trial=trial,
    )  # fmt: skip


def told(findings: list[Finding], sites: list[WholeMade], dtype: torch.dtype) -> list[Finding]:
    """`findings`, a divergence whose check raised a line that makes whole numbers the candidate
    rounds (upstream of the op it names) saying so: the why behind "what it reads is made at"."""
    limit = 2.0 / torch.finfo(dtype).eps
    name = str(dtype).removeprefix("torch.")
    out = []
    for f in findings:
        lines = set(f.evidence.get("feeding_lines") or []) if f.name == "precision-divergence" else set()
        made = [w for w in sites if w.location in lines]
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
