"""An error no part of the model makes alone, built up across it past what `fpdoctor plan` aims for.

compare's other checks each name a part: a module or an op whose own error is far above its floor, a
running state, a selection, the inputs. Where none does and the output's error is still above the
target plan holds a candidate to (DIVERGENCE_RATIO times the output's floor, or FLOOR_MARGIN times
what rounding the inputs costs, the larger), the format itself is what costs it: every module adds
its share of rounding (a flow's couplings, each within 2-3x its floor, compound into 20x at the
log-likelihood) and no single change takes it away. "OK" would tell the user that nothing is wrong
where plan, on the same model, finds the error past its target; so compare says what it measured,
with the worst modules kept in fp32, doubled until they reach the target, as the checked fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from fpdoctor import catalog
from fpdoctor.precision.profile import DIVERGENCE_RATIO, ModuleRow
from fpdoctor.report.model import Finding, Severity, Trial

# Within 2x (6 dB) of what rounding the inputs alone costs is as close as the candidate gets: modules
# kept in fp32 read rounded inputs too, and their outputs are rounded once more on the way back.
FLOOR_MARGIN = 2.0
# Sets of the worst 1, 2, 4, ... modules, one forward each: at most this many before the search stops.
SEARCH_RUNS = 6
METRIC = "end-to-end relative error against fp64"
# Rounding many values costs about a third of the unit roundoff, relative L2 (bf16: 0.0016 of 0.0039).
ROUNDING_RMS = 1 / 3


def floor(rows: list[ModuleRow], unit: float) -> float:
    """The output's floor as plan reads it (rounding the exact output, or the reference model's own error
    where larger), never below ROUNDING_RMS of the format's unit roundoff `unit` (a few values' own
    rounding, a 0-d loss's, can be near 0 by chance); an own op's forced error is what any computation of
    it in the format loses, which the output cannot do better than."""
    root = rows[-1]
    return max(ROUNDING_RMS * unit, root.floor, root.reference or 0.0, *forced(rows))


def forced(rows: Iterable[ModuleRow]) -> list[float]:
    """The own ops' forced errors: what any computation of each in the format loses (its conditioning)."""
    return [r.own["forced_rel"] for r in rows if r.own and r.own.get("forced_rel")]


def target(rows: list[ModuleRow], input_floor: float | None, unit: float) -> float:
    """What plan judges the candidate against: DIVERGENCE_RATIO x the output's floor, or FLOOR_MARGIN x
    rounding the inputs where that is out of reach."""
    return max(DIVERGENCE_RATIO * floor(rows, unit), FLOOR_MARGIN * (input_floor or 0.0))


def above_floor(rows: list[ModuleRow], unit: float) -> bool:
    """The output's error is past DIVERGENCE_RATIO x its floor: the only case worth a forward to measure
    the inputs' share (target's second term)."""
    root = rows[-1] if rows else None
    return (
        root is not None
        and root.module == ""
        and math.isfinite(root.propagated)
        and root.propagated > DIVERGENCE_RATIO * floor(rows, unit)
    )


def ranked(rows: Iterable[ModuleRow]) -> list[str]:
    """The model's modules by their worst isolated error / floor over `rows` (one run's, or several
    input sets'), worst first (plan's order; never the root; a row whose own error a child's explains
    does not rank its module)."""
    worst: dict[str, float] = {}
    for r in rows:
        if r.module and r.ratio is not None and not math.isnan(r.ratio) and not r.inherited:
            worst[r.module] = max(worst.get(r.module, 0.0), r.ratio)
    return sorted(worst, key=lambda m: -worst[m])


def search(
    order: list[str], error_with: Callable[[list[str]], float | None], aim: float
) -> list[tuple[list[str], float]]:
    """The worst 1, 2, 4, ... modules of `order` kept in fp32 (a module inside one already kept adds
    nothing, and is left out), one run each, until a set reaches `aim` or SEARCH_RUNS ran: each set
    with its end-to-end error, in the order tried."""
    tried: list[tuple[list[str], float]] = []
    k = 1
    while len(tried) < SEARCH_RUNS:
        kept: list[str] = []
        for name in order[:k]:
            if not any(name.startswith(f"{other}.") for other in kept):
                kept = [m for m in kept if not m.startswith(f"{name}.")] + [name]
        if not tried or kept != tried[-1][0]:
            after = error_with(kept)
            if after is None:
                break
            tried.append((kept, after))
            if after <= aim:
                break
        if k >= len(order):
            break
        k = min(2 * k, len(order))
    return tried


def _whole(kept: list[str], children: list[str]) -> bool:
    """`kept` holds every module the model's own forward calls (own_code.submodules): the model in fp32."""
    return bool(children) and all(any(c == k or c.startswith(f"{k}.") for k in kept) for c in children)


def finding(
    rows: list[ModuleRow],
    *,
    label: str,
    aim: float,
    input_floor: float | None,
    tried: list[tuple[list[str], float]],
    on: str,
    children: list[str],
) -> Finding:
    """NUM024: the error, what explains it part by part, and the fix: the kept set that reached the target,
    checked; else every module the model calls kept in fp32 (the model in fp32), checked where that run
    took the error down; else plan, the next step, untried."""
    root = rows[-1]
    error = root.propagated
    worst = ranked(rows)
    ratios = {r.module: r.ratio for r in rows if r.module and r.ratio is not None}
    parts = ", ".join(f"`{m}` {ratios[m]:.1f}x" for m in worst[:3]) or "none measured"
    inputs = (
        f"; rounding the inputs to {label} alone costs {input_floor:.3g}"
        if input_floor is not None and input_floor > 0
        else ""
    )
    # a set that holds every module the model calls is the model in fp32, no fix of a part
    reached = next(((kept, after) for kept, after in tried if after <= aim and not _whole(kept, children)), None)
    closest = min(tried, key=lambda t: t[1]) if tried else None
    named = ", ".join(f"`{m}`" for m in (reached or closest or ([], 0.0))[0])
    way = "their inputs cast to fp32 and their outputs cast back"
    plan = f"`fpdoctor plan` with `--candidate {label}` finds the smallest such set and writes its code"
    if reached is not None:
        after = reached[1]
        fix = f"Keep {named} in fp32 ({way}); {plan}"
        trial = Trial.checked(
            f"{named} kept in fp32, the rest in {label}", on=on, metric=METRIC, before=error, after=after
        )
        said = f"keeping {named} in fp32 takes it to {after:.3g}, within the target"
    elif (whole := next(((k, a) for k, a in tried if _whole(k, children) and a < error), None)) is not None:
        # every module the model calls in fp32 (its own ops left in the candidate): a run, and no fix of a part
        fix = (
            f"Keep the model in fp32 where this output matters: {label} is too coarse for it at this depth (every "
            f"module it calls kept in fp32 takes the error to {whole[1]:.3g}; the target is {aim:.3g}); `fpdoctor "
            f"plan` with `--candidate {label}` checks whether fewer modules do"
        )
        trial = Trial.checked(
            "every module the model calls kept in fp32, its own ops as they ran", on=on, metric=METRIC,
            before=error, after=whole[1],
        )  # fmt: skip
        said = f"every module it calls kept in fp32 takes it to {whole[1]:.3g}"
    else:
        fix = (
            f"Run `fpdoctor plan` with `--candidate {label}`, which searches further than this check for the modules "
            "to keep in fp32; or keep the model in fp32 where this output matters"
        )
        best = f"the closest, {named} in fp32, leaves {closest[1]:.3g}" if closest is not None else "none could run"
        trial = Trial.untried(f"the next step, not a fix that was tried: of the sets tried, {best}")
        said = f"of the sets of its worst modules kept in fp32, {best}"
    return catalog.make(
        "error-builds-up",
        message=(
            f"In {label}, the output's error is {error:.3g}, {error / root.floor:.0f}x what rounding the exact "
            f"output costs ({root.floor:.3g}) and past {aim:.3g}, the target `fpdoctor plan` holds a candidate to "
            "(16x the output's floor, or 2x what rounding the inputs costs), while "
            f"no module or op adds more than a few times its own floor (worst: {parts}){inputs}. Every part "
            f"rounds a little and the model compounds it; {said}."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "built_up",
            "error_rel": error,
            "floor_rel": root.floor,
            "target_rel": aim,
            "input_floor_rel": input_floor,
            "tried": [{"fp32": kept, "error_rel": after} for kept, after in tried],
        },
        fix=fix,
        trial=trial,
        severity=Severity.WARNING,
    )
