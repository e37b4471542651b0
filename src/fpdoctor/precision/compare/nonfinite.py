"""Where the candidate's output turns NaN/Inf while the fp64 run's stays finite: the op that made the
first non-finite value, named as `trace` names it (NUM001 `nonfinite-produced`), with its fix
checked by a candidate run with the fix in place (numerics/engine/raising.py).

The candidate pass finds, for each module call whose output turned non-finite from finite inputs,
the first op inside it that did (first_overflow.py). A module whose own error diverges carries
that op in its divergence finding (profile.causes); this names the rest: an op of the model's own
forward (a mask built there), of a container whose isolated error stays small, and every cast. A
cast's fix is never "compute it in fp32": a cast to the candidate's format of a value beyond its
range (float32's lowest value as a mask fill) makes -Inf there, and the fix is a value the format
holds (`torch.finfo(x.dtype).min`), checked by a run whose cast holds the format's largest finite
value instead of Inf. A non-finite output whose origin no re-run names is never OK either.
"""

from __future__ import annotations

import linecache
import math
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.formats import DTYPE_FORMAT, FORMATS
from fpdoctor.numerics.engine.raising import below_range
from fpdoctor.numerics.engine.reruns import finfo_spelled
from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.profile import RAISED_FALLS, ModuleRow, lines_text
from fpdoctor.report.model import Finding, Trial
from fpdoctor.userframes import is_user_file

# The check of a fix: ("cast" | "op" | "fp64", (file, line), lines after it) -> the end-to-end error with it
# in place (inf while the output stays non-finite; None when the run could not be made)
Check = Callable[[str, tuple[str, int], int], "float | None"]
# The check of a computation done before the cast: (op, module, location) -> (the lines that feed
# it, its own and up to LINES_AFTER after it, computed in fp32 on the inputs fed in fp32, the error,
# whether the single values the lines make were read in fp32 as they are)
BeforeCast = Callable[[str, str, str], "tuple[list[tuple[str, int]], float | None, bool, bool]"]
# An op's fix in fp32 is tried with up to this many lines after it that consume its result
LINES_AFTER = 2

# Limits a model writes as a sentinel (a mask fill): named in the fix as the code spells them
_SENTINELS = {torch.finfo(d).max: f"torch.finfo({d})" for d in (torch.float64, torch.float32)}


# A constant held at the format's smallest normal value is the fix unless computing its line in fp32
# leaves this many times less error (an eps larger than a small row's squared norm changes its result)
LITERAL_WORSE = 4.0


def is_cast(op: str) -> bool:
    return op.startswith("aten._to_copy")


def handled(
    rows: list[ModuleRow], overflows: dict[tuple[str, int], dict[str, Any]], limit: float
) -> set[tuple[str, int]]:
    """The origins this module names (NUM001) rather than a divergence finding: every cast, every op
    that made NaN/Inf within the format's range (`limit`: its fp32 result fits, or a constant on its
    line is 0 in the format: 0/0, not an overflow), and every op of a call that does not diverge by
    itself or is the model's own forward; none while the model's output is finite."""
    if not rows or not math.isinf(rows[-1].propagated):
        return set()
    diverged = {(r.module, r.call) for r in rows if r.diverged and r.module}
    return {
        key
        for key, found in overflows.items()
        if is_cast(found["op"]) or _in_range(found, limit) or key not in diverged
    }


def _in_range(found: dict[str, Any], limit: float) -> bool:
    """The op's NaN/Inf is a constant on its line that rounds to 0 in the format (0 / (0 + 1e-8)), its
    reference result within the range: not its values passing the format's range. (A NaN that an
    ill-conditioned line makes, sqrt of a variance cancelled below 0, stays the divergence's, whose
    fix takes the lines that feed it.)"""
    biggest = found.get("reference_absmax")
    return bool(found.get("tiny")) and (biggest is None or (math.isfinite(biggest) and biggest < limit))


def findings(
    rows: list[ModuleRow],
    overflows: dict[tuple[str, int], dict[str, Any]],
    *,
    label: str,
    candidate: str,
    dtype: torch.dtype,
    check: Check,
    before_cast: BeforeCast,
    on: str,
    named: bool,
    mine: set[tuple[str, int]],
    flushed: list[str] | None = None,
) -> list[Finding]:
    """NUM001 for the first origin of `mine` (`handled`), its fix checked; where the output is non-finite,
    no origin was found and no other error finding (`named`) says why, NUM001 all the same, saying
    which module's output turned non-finite first."""
    if not rows or not math.isinf(rows[-1].propagated):
        return []
    root = rows[-1]
    count = f"{root.nonfinite} of its values are NaN or Inf where the fp64 run's are finite"
    for key, found in overflows.items():  # in the order the calls ended: the innermost origin first
        if key in mine:
            origin = found | {"flushed": flushed or []}  # what the cast made 0, for an underflow's fix
            return [_origin(key, origin, label=label, candidate=candidate, dtype=dtype, check=check,
                            before_cast=before_cast, on=on, count=count, nonfinite=root.nonfinite)]  # fmt: skip
    if named:
        return []
    first = next((r for r in rows if r.nonfinite and math.isinf(r.propagated)), root)
    where = f"`{first.module}`" if first.module else "the model's own forward"
    return [
        catalog.make(
            "nonfinite-produced",
            message=(
                f"In {label}, the output is non-finite: {count}. The first module whose output turned non-finite is "
                f"{where}; no op inside it turned finite inputs non-finite when re-run on the inputs the candidate "
                "gave it, so the first non-finite value came in with them or from an op compare does not re-run."
            ),
            fix="run `fpdoctor trace` on the script that runs the model in this precision: it names the op and line "
            "that made the first NaN/Inf, with its checked fix",
            where={"module": first.module or None, "op": None, "phase": "forward"},
            evidence={"candidate": label, "first_nonfinite_module": first.module, "nonfinite": root.nonfinite},
            trial=Trial.untried("compare could not name the op, so there is no fix of its own to try"),
        )
    ]


def _dtype_chosen(lines: list[tuple[str, int]]) -> list[int]:
    """The lines among `lines` that pick a dtype themselves (`torch.linspace(..., dtype=dtype)`): there the
    fix writes torch.float32, not a .float() on what they read (they may read no tensor at all)."""
    return [n for f, n in lines if _FACTORY_DTYPE.search(linecache.getline(f, n))]


# a tensor made with its dtype given (torch.linspace(..., dtype=dtype)); never a cast (.to(dtype=...)) nor dtype ==
_FACTORY_DTYPE = re.compile(
    r"\b(?:linspace|logspace|arange|full|zeros|ones|empty|tensor|as_tensor|eye|rand|randn)\((?:[^()]|\([^()]*\))*"
    r"\bdtype\s*=(?!=)"
)


def _fits(exact: float | None, limit: float) -> bool:
    """The op's exact (fp64) output fits the format: its NaN was no overflow (a 0/0 of values rounded to 0)."""
    return exact is not None and math.isfinite(exact) and exact < limit


def _origin(
    key: tuple[str, int], found: dict[str, Any], *, label: str, candidate: str, dtype: torch.dtype, check: Check,
    before_cast: BeforeCast, on: str, count: str, nonfinite: int,
) -> Finding:  # fmt: skip
    module, _ = key
    op, location = found["op"], found.get("location")
    fmt = FORMATS.get(DTYPE_FORMAT.get(found["dtype"], ""))
    limit = fmt.max if fmt is not None else torch.finfo(dtype).max
    code = source_text(location)
    at = f" at {location}" + (f" (`{code}`)" if code else "") if location else ""
    inside = f"`{module}`'s forward" if module else "the model's own forward"
    biggest = found.get("input_absmax") or 0.0
    line = line_of(location)
    finfo = finfo_spelled(code, str(dtype).removeprefix("torch."))  # torch.finfo(scores.dtype), as the line can say it
    evidence: dict[str, Any] = {"candidate": label, "op": op, "location": location, "input_absmax": biggest,
                                "format_max": limit, "nonfinite": nonfinite}  # fmt: skip
    constant = found.get("constant")
    alternative = ""  # a second fix, checked, printed after the first's figures
    after = check("cast", line, 0) if constant is not None and not is_cast(op) and line is not None else None
    if constant is not None and after is not None and math.isfinite(after):
        # the constant is Inf in the format: what the op makes of it is the constant's, held at the limit
        evidence["constant"] = constant
        literal = _SENTINELS.get(abs(constant))
        name = f"{literal}.{'min' if constant < 0 else 'max'}, " if literal else ""
        message = (
            f"In {label}, {op}{at} in {inside} applies the constant {name}{constant:.4g}, past {candidate}'s largest "
            f"finite value ({limit:.6g}): on a {candidate} tensor it acts as {'-' if constant < 0 else ''}Inf, and "
            f"from there the output is non-finite ({count}); as a mask value, a row that is masked whole becomes NaN "
            "in a softmax."
        )
        fix = (
            f"write the limit of the tensor's dtype, not a wider one's: {finfo}.min ({-limit:.6g} in "
            f"{candidate}) for a mask value{at}, or a constant {candidate} holds; checked: the output is finite again, "
            f"its error {after:.3g}"
        )
        trial = Trial.checked(
            f"the constant {constant:.4g}{at} held at {candidate}'s largest finite value (+-{limit:.6g})",
            metric="end-to-end relative error against fp64", before="non-finite", after=after, on=on,
        )  # fmt: skip
        where = {"module": module or None, "op": op, "phase": "forward"}
        return catalog.make("nonfinite-produced", message=message, fix=fix, where=where, evidence=evidence, trial=trial)
    if is_cast(op):
        literal = _SENTINELS.get(biggest)
        value = f"{literal}.min or .max ({biggest:.4g})" if literal else f"values up to {biggest:.4g}"
        message = (
            f"In {label}, the cast{at} in {inside} turns {value} into Inf: {candidate}'s largest finite value is "
            f"{limit:.6g}. From there the output is non-finite ({count}); as a mask fill, -Inf makes a row that "
            "is masked whole NaN in a softmax, where float32's lowest value kept it finite."
        )
        evidence["sentinel"] = literal
        fix = (
            f"write the limit of the dtype you cast to, not float32's: {finfo}.min ({-limit:.6g} in "
            f"{candidate}) for a mask fill{at}, or clamp the values to +-{limit:.6g} before the cast"
        )
        changed = f"the cast{at} holding {candidate}'s largest finite value (+-{limit:.6g}) instead of Inf"
        after = check("cast", line, 0) if line is not None else None
    else:
        message = (
            f"In {label}, {op}{at} in {inside} turns finite inputs{f' (up to {biggest:.4g})' if biggest else ''} into "
            "NaN or Inf, and from "
            f"there the output is non-finite ({count})."
        )
        more, after = fp32_lines(check, line, math.inf) if line is not None else (0, None)
        lines = "" if line is None else f"line {line[1]}" if not more else f"lines {line[1]}-{line[1] + more}"
        span = f", {lines} of {line[0]}" if line is not None else ""
        # the check ran every op of those lines in fp32: a constant the format holds as 0 (clamp(min=1e-9))
        # on them counts then, so the fix is the lines, not the op's operands alone
        written = rounds_to_zero(code, dtype)  # as the line spells them; the recorded ones where it spells none
        spelled = {float(w) for w in written}
        zeros = [*written, *dict.fromkeys(f"{c:g}" for c in found.get("tiny") or [] if float(c) not in spelled)]
        zero = f" (its constant {', '.join(zeros)} is 0 in {candidate}: in fp32 it is not)" if zeros else ""
        fix = (
            f"compute {op}{at} in fp32{span}, every op on {'them' if more else 'it'}{zero}: .float() on the tensors "
            f"{'they read' if more else 'it reads'} from the rest of the model, before {'their' if more else 'its'} "
            f"first op, what {'they produce' if more else 'it produces'} cast back to {candidate} where the rest "
            "of the model reads it (.to(p.dtype), p a parameter of the model)"
        )
        held = check("cast", line, more) if zeros and line is not None else None
        changed = f"the ops at {lines} computed in fp32, what they produce cast back to {candidate}"
        if line is not None and held is None and not (after is not None and math.isfinite(after)):
            # the line in fp32 leaves the NaN: what it reads may be the model's inputs, rounded by the cast
            # before the forward (raw readings scaled by their batch's statistics: rounded, a spread of 0)
            fed, given, wide, scalars = before_cast(op, module, found.get("location") or "")
            if given is not None and math.isfinite(given) and not wide:
                # the lines that make what it reads, in fp32 from the inputs as the candidate gets them (an exp
                # two lines up that underflows to 0, whose log is then -inf)
                lines = lines_text(fed)
                message += (
                    f" It is not the op's own precision: line {line[1]} in fp32 still makes it. What it reads is made "
                    f"at {lines}, where {candidate} loses it first (an exp that underflows to 0, a difference that "
                    "cancels); those lines in fp32 give a finite output."
                )
                chosen = _dtype_chosen(fed)
                picks = f"line {chosen[0]} picks" if len(chosen) == 1 else f"lines {', '.join(map(str, chosen))} pick"
                fix = f"compute {lines} in fp32: " + (
                    f"torch.float32 where {picks} the dtype (dtype=), " if chosen else ""
                ) + ".float() on any tensor they read from the rest of the model, "  # fmt: skip
                if scalars:  # checked: each single value they make read in fp32 leaves far less error than cast back
                    fix += (
                        "and read the single values taken from what they make (a table's t-th entry, a 0-dim tensor) "
                        f"as they are, in fp32, with no cast: an op that reads a 0-dim fp32 tensor beside {candidate} "
                        f"tensors of more dims stays {candidate} and keeps the fp32 value's digits; cast back only a "
                        "whole tensor of theirs the rest of the model reads (.to(p.dtype), p a parameter of the model)"
                    )
                    changed = f"the ops at {lines} in fp32, the single values they make read in fp32 as they are"
                else:
                    fix += (
                        f"what they produce cast back to {candidate} where the rest of the model reads it "
                        "(.to(p.dtype), p a parameter of the model)"
                    )
                    changed = f"the ops at {lines} in fp32, their results cast back to {candidate}"
                evidence |= {"feeding_lines": [f"{f}:{n}" for f, n in fed]}
                after = given
            elif given is not None and math.isfinite(given):
                lines = lines_text(fed)
                message += (
                    f" It is not the op's precision: line {line[1]} in fp32 still makes it. What it reads comes from "
                    f"the model's inputs, which the cast to {candidate} before the forward rounds (values closer "
                    f"than {candidate}'s spacing become one: a spread of 0, a difference of 0, then 0/0)."
                )
                fix = (
                    f"Do that computation before the cast: pass the model's inputs in fp32 (not cast to {candidate} "
                    f"before the forward), compute {lines} in fp32 from them, and cast what they produce to "
                    f"{candidate} where the rest of the model reads it (.to(p.dtype), p one of the model's "
                    f"parameters); any other line that reads the inputs reads them cast to {candidate} "
                    "(x.to(p.dtype)), as the check ran it. Then `fpdoctor compare --inputs-as-given` checks the "
                    "changed model fed its inputs as they are"
                )
                changed = f"the inputs fed in fp32, the ops at {lines} in fp32, their results cast back to {candidate}"
                evidence |= {"inputs_as_given": True, "feeding_lines": [f"{f}:{n}" for f, n in fed]}
                after = given
        if held is not None and math.isfinite(held) and after is not None and after * LITERAL_WORSE < held:
            # the literal held finite, but far further off than the line in fp32 (an eps at the format's smallest
            # normal that outweighs a tiny row's own squared norm): the line in fp32 leads, the literal beside it
            alternative = (
                f"; or replace the constant {', '.join(zeros)}{at} (it is 0 in {candidate}) with {finfo}.tiny "
                f"(checked too: the output is finite, but its error is {held:.3g}: that eps outweighs what small "
                "rows hold)"
            )
        elif held is not None and math.isfinite(held):  # the constant at the format's smallest normal: checked
            # the user's literal is the culprit: the fix names it and a value the format holds, the line in
            # fp32 beside it (both checked)
            tiny = torch.finfo(dtype).tiny
            wider = f"; or {fix}" + (
                f" (checked too: the output is finite, its error {after:.3g})"
                if after is not None and math.isfinite(after)
                else ""
            )
            fix = (
                f"replace the constant {', '.join(zeros)}{at} (it is 0 in {candidate}) with {finfo}.tiny ({tiny:.3g}, "
                f"the smallest normal value {candidate} holds), or clamp(min=1) for a count"
            )
            alternative, after = wider, held
            changed = f"the constant {', '.join(zeros)}{at} held at {candidate}'s smallest normal value ({tiny:.3g})"
    metric = "end-to-end relative error against fp64"
    if after is not None and math.isfinite(after):
        trial = Trial.checked(changed, metric=metric, before="non-finite", after=after, on=on)
        fix += f"; checked: the output is finite again, its error {after:.3g}{alternative}"
    elif after is not None and is_cast(op):  # tried and the output stays non-finite: not the fix
        fix = "run `fpdoctor trace` on the script that runs the model in this precision for the op-level walk"
        trial = Trial.untried(f"{changed} left the output non-finite: the first NaN/Inf has another source too")
    elif after is not None and _fits(found.get("reference_absmax"), limit):
        # the exact output fits the format: no overflow, a 0/0 of values rounded to 0 before it (a buffer the cast
        # made subnormal, a product that underflowed): the line in fp32 reads them already 0
        tiny = torch.finfo(dtype).smallest_normal
        exact = found["reference_absmax"]
        fix = (
            f"make what {op}{at} reads in fp32 from where it is first computed: its exact output reaches only "
            f"{exact:.3g}, so nothing overflows; values below {candidate}'s smallest normal ({tiny:.3g}) lose their "
            "digits and become 0 (0/0 is NaN), and a buffer or parameter that small becomes subnormal or 0 in the "
            "model's cast (keep it in fp32"
            + (f": here the {'; the '.join(found['flushed'][:3])}" if found.get("flushed") else "")
            + ")"
            + (", or run in bf16, which has fp32's range" if candidate == "fp16" else "")
        )
        trial = Trial.untried(
            f"{changed} left the output non-finite: what the line reads is 0 or rounded before it, so no line alone "
            "in fp32 is the fix"
        )
    elif after is not None:  # in fp32 it fits; cast back it does not: what follows must stay wider too
        fix = (
            f"keep {op}{at} and what reads its result in fp32 (its values pass {candidate}'s largest, {limit:.6g}, "
            f"wherever they are cast back: `fpdoctor plan` finds the modules to keep), or scale them down before it"
            + (", or run in bf16, which has fp32's range" if candidate == "fp16" else "")
        )
        trial = Trial.untried(
            f"{changed} left the output non-finite: the values are past {candidate}'s range where they are cast back, "
            "so no line alone in fp32 is the fix"
        )
    else:
        trial = Trial.untried("its source line is not known, so no run with the fix in place could be made")
    return catalog.make(
        "nonfinite-produced",
        message=message,
        fix=fix,
        where={"module": module or None, "op": op, "phase": "forward"},
        evidence=evidence,
        trial=trial,
    )


def failed(
    exc: Exception, *, label: str, candidate: str, check: Check | None = None, on: str = ""
) -> Finding:  # fmt: skip
    """The candidate's run raised (a constant its format cannot hold, an op without a kernel for it, a
    factorisation that fails in fp32): the model does not run in the candidate at all, named at the
    user's line that raised. For an fp32 candidate the line in fp64 is checked (`check`, as "fp64"): a
    fix in fp32 would change nothing there."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} (`{(frames[-1].line or '').strip()}`)" if frames else ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    fix = (
        "compute that line in fp32, its operands .float() and the result cast back (.to(x.dtype), x its input), "
        f"where the op has no {candidate} kernel; else make the line run in the candidate's dtype"
    )
    trial = Trial.untried(
        "the run raised before anything could be changed in it; the line and its message are the evidence"
    )
    if compute_dtype(candidate) == torch.float32 and frames:
        # fp32 already: the wider format is fp64. A factorisation that fails (a Cholesky "not positive-definite",
        # a singular solve) is the matrix's conditioning: its smallest eigenvalues below fp32's rounding of its largest
        singular = any(w in text for w in ("positive-definite", "singular", "not invertible"))
        fix = (
            ("the matrix is numerically singular in fp32 (its smallest eigenvalues fall below fp32's rounding of its "
             "largest: a kernel of close points, a jitter such as 1e-6): " if singular else "")
            + "compute that line in fp64, its operands .double() and the result cast back (.to(x.dtype), x its input)"
            + (", or add to the diagonal a jitter fp32 resolves (1e-4 or more of its mean)" if singular else "")
        )  # fmt: skip
        after = check("fp64", (frames[-1].filename, frames[-1].lineno or 0), 0) if check is not None else None
        if after is not None and math.isfinite(after):
            fix += f"; checked: the model runs, its end-to-end error {after:.3g}"
            trial = Trial.checked(
                f"line {frames[-1].lineno} in fp64, its result cast back to fp32", before="the run raised",
                metric="end-to-end relative error against fp64", after=after, on=on,
            )  # fmt: skip
        elif check is not None and singular:  # tried: what the line reads is already singular as fp32 holds it
            fix = (
                "the matrix is numerically singular in fp32 as it is built (its smallest eigenvalues fall below "
                "fp32's rounding of its largest): that line alone in fp64 still fails (checked), so build the matrix "
                "in fp64 too (the lines that compute it, from operands .double()) and factorise it there, the result "
                "cast back (.to(x.dtype)); or add to the diagonal a jitter fp32 resolves (1e-4 or more of its mean)"
            )
            trial = Trial.untried(
                f"line {frames[-1].lineno} alone in fp64 still raised; the lines that build the matrix were not tried"
            )
        elif check is not None:  # fp64 is no fix either: the line as it should run in the candidate's dtype
            fix = "make that line run in fp32 as written: the message names what it needs (a dtype, a shape, a value)"
            trial = Trial.untried(f"line {frames[-1].lineno} in fp64 still raised: the cause is not its precision")
    if "overflow" in text:  # a Python constant past the format's range, put into one of its tensors
        limit = torch.finfo(compute_dtype(candidate)).max if compute_dtype(candidate).is_floating_point else None
        largest = f" ({limit:.6g} in {candidate})" if limit is not None else ""
        fix = (
            f"a constant there does not fit {candidate}: write the dtype's own limit, torch.finfo(x.dtype).min or "
            f".max{largest}, for a fill value, or a value the format holds"
        )
    return catalog.make(
        "precision-divergence",
        title=f"The model does not run in {label}",
        message=(
            f"In {label}, the model does not run: {type(exc).__name__}{where}: {text.rstrip('.')}. Nothing past that "
            "point was compared, so the modules' figures cover only what ran before it."
        ),
        fix=fix,
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "candidate-failed",
            "candidate": label,
            "error": f"{type(exc).__name__}: {text}",
            "location": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None,
        },
        trial=trial,
    )


def fp32_lines(check: Check, line: tuple[str, int], error: float, most: int = LINES_AFTER) -> tuple[int, float | None]:
    """An op's line in fp32, then with up to `most` lines after it that read its result (a
    softmax written by hand: exp, then the division by the sum), its results cast back after them:
    (lines after it, the end-to-end error) of the first run whose output is finite and, where the
    error was finite, RAISED_FALLS times below it; else the last run's."""
    more, after = 0, None
    for more in range(most + 1):
        after = check("op", line, more)
        if after is not None and math.isfinite(after) and (not math.isfinite(error) or after * RAISED_FALLS <= error):
            break
    return more, after


_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?[eE][-+]?\d+|\d*\.\d+)")


def rounds_to_zero(code: str, dtype: torch.dtype) -> list[str]:
    """The non-zero numeric literals of a source line that `dtype` holds as 0 (1e-9 in fp16)."""
    code = code.split("#", 1)[0]
    if not dtype.is_floating_point:
        return []
    return [text for text in _NUMBER.findall(code) if below_range([float(text)], dtype)]


def line_of(location: str | None) -> tuple[str, int] | None:
    if not location:
        return None
    file, _, number = location.rpartition(":")
    return (file, int(number)) if number.isdigit() else None


def source_text(location: str | None) -> str:
    """The source text of the line, as the user wrote it (empty when it cannot be read)."""
    line = line_of(location)
    return linecache.getline(line[0], line[1]).strip() if line is not None else ""
