"""`fpdoctor.compare(model, inputs, reference="fp32", candidate="fp16")`: layerwise A/B against fp64.

Two passes over copies of the model. The fp64 pass (the truth) keeps an evenly strided sample of
every module's output and re-runs the candidate's and the reference's copy of each leaf module on
the same fp64 inputs; the candidate pass then reduces its outputs to error numbers against those
samples as it goes. Memory is one forward at a time plus SAMPLE values per module call - never
all activations.

Per module:
  propagated  the candidate run's output against the fp64 output (errors accumulated so far)
  isolated    the candidate's module fed the fp64 run's inputs, against the fp64 output (leaf
              modules; ROWS evenly spread rows of those whose rows are independent): what this
              module adds by itself. A container's: its worst own op (an op of its forward
              outside its submodules: attention scores, a residual add), each re-run on its fp64
              inputs as the fp64 pass runs it (container_ops.py)
  floor       the error that rounding the fp64 output (a container's: that op's) to the
              candidate's format causes, or the reference's own error (fed the same fp64 inputs)
              if that is larger
A module diverges when its isolated error is non-finite or more than DIVERGENCE_RATIO times the
floor: rounding of inputs and outputs stays within a few floors, while accumulation loss,
overflow and cancellation land orders of magnitude above it. Relative L2 error, SQNR and cosine
similarity are reported for both. Each row says what its figures were computed on and, where its
error moves against its inputs' or its submodules', why (profile.annotate).

With `device=`, the candidate runs on another device (device A vs device B): `candidate="fp32",
device="cuda"` judges the GPU's fp32 kernels (TF32, another summation order) against the same
floor, so only what goes beyond the reference's own rounding is called a divergence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import linecache
import math
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog, progress
from fpdoctor.numerics.engine.raising import RaisedLines, RaisedSites, SaturatedCasts
from fpdoctor.numerics.trace.mismatch import mismatch_error
from fpdoctor.precision.audit.audit import as_given, explain_failure
from fpdoctor.precision.audit.boundary import keep_in_fp32
from fpdoctor.precision.candidates import (
    CANDIDATES,
    FP8_KERNELS,
    REFERENCES,
    Given,
    cast_inputs,
    check_device,
    check_name,
    compute_dtype,
    copy_module,
    fp8_format,
    make_run,
    map_tensors,
    model_device,
    run_flags,
    split_inputs,
    uncompiled,
)
from fpdoctor.precision.compare import (
    built_up,
    fp8,
    input_cause,
    made_in_dtype,
    near_limit,
    nonfinite,
    own_code,
    selections,
    stable_forms,
    upstream,
    use,
)
from fpdoctor.precision.compare.compiled import compare_compiled, is_compiled
from fpdoctor.precision.compare.container_ops import Own, OwnOps
from fpdoctor.precision.compare.first_overflow import first_overflow
from fpdoctor.precision.compare.noise import ReplayNoise
from fpdoctor.precision.compare.own_calls import OwnCalls
from fpdoctor.precision.compare.passes import (
    carried_and_raised,
    carried_states,
    error_under,
    hooked,
    input_rounding_error,
    masked_truth,
    raised_error,
    read_rerun,
    record_noise,
    rerun,
    rerun_figures,
    unmasked,
)
from fpdoctor.precision.compare.recurrence import MOST_LINES, Recurrence, loop_state_lines, recurrence
from fpdoctor.precision.compare.transformed import Transform, compare_transformed
from fpdoctor.precision.decide import MASKED, MASKED_LOGIT, Decisions, Kept, id_decisions, ids_agree, rounding_floor
from fpdoctor.precision.decide import kept as kept_sets
from fpdoctor.precision.fit import candidate_format, misfits
from fpdoctor.precision.fit import describe as describe_misfit
from fpdoctor.precision.inputs import describe, input_sets
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import (
    Later,
    Reads,
    all_finite,
    cosine,
    cosine_of,
    device_sample,
    diff_later,
    dot_later,
    floating,
    integral,
    largest,
    norm_later,
    output_format,
    rel_error,
    relative,
    round_to,
    row_subset,
    sample_step,
    to_host,
)
from fpdoctor.precision.names import PLAN_CANDIDATES, default_reference
from fpdoctor.precision.profile import (
    BROKEN_REFERENCE,
    DIVERGENCE_RATIO,
    INPUT_EXPLAINS,
    INPUT_FIX_FALLS,
    RAISED_FALLS,
    UNKNOWN_FLOOR,
    UNTRIED_BY_COMPARE,
    CompareResult,
    ModuleRow,
    ReferenceFailed,
    annotate,
    broken_reference,
    build_report,
    carried_fix,
    causes,
    children,
    forced_causes,
    input_rounding_finding,
    line_spans,
    lines_text,
    merge_sets,
)
from fpdoctor.precision.record.record import CompareRecord
from fpdoctor.precision.record.recording import Link, Samples, decision_record
from fpdoctor.precision.scope import find_module, module_inputs
from fpdoctor.precision.units import InUnits, coarse_finding, given_finding, in_units, lost_finding, plain_fp32
from fpdoctor.preserve import RngState
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Severity, Trial
from fpdoctor.torchprivate import buffers_of
from fpdoctor.userframes import is_user_file

# the lines that make what a running state's update reads, kept in fp32 with it, where they are at most these
FEEDING_LINES = 8
# another line's feeding lines, added to the worst op's, are kept where the checked error falls to this share of
# what it was with them or less (a window's second running sum: 0.0089 -> 0.0061)
KEPT_FALL = 0.8
# the single values of what a fix's lines make, read in fp32 as they are, are the fix where that leaves this many
# times less error than casting them back, or fewer (a DDPM schedule built in fp32: 0.0276 cast back, 0.0061 read
# as it is; a Langevin sampler's, 0.0189 and 0.0107). It is also the simpler code: the dtype changed, no cast. Where
# the lines make no single value the rest reads, the two runs are one and the same.
SCALARS_FALL = 1.1


@dataclass
class _Seen:
    """What the fp64 pass keeps of one module call: samples and a few numbers, never the tensors."""

    truth: torch.Tensor  # float64 sample of the output
    norm: float
    rounding: float  # relative error of rounding the sample to the candidate's format
    leaf: bool
    numel: int
    isolated: float | None = None
    isolated_cosine: float | None = None
    cosine: float | None = None
    single: bool = True  # the output is one tensor (not a tuple, a dict): what a printed cast back can call .to on
    weighted: bool = True  # the module holds floating parameters: a printed fix casts its input to their dtype
    inputs: torch.Tensor | None = None  # float64 sample of the inputs, for the jump test of containers
    isolated_rows: int | None = None  # rows the isolated re-run computed, None for all
    reference: float | None = None  # the reference's isolated error; None: not measured
    propagated: float | None = None
    candidate_inputs: float = 0.0  # the candidate's input error at this module
    inputs_past: str | None = None  # its fp64 inputs are past the format's range: why its isolated run is Inf
    input_error: float | None = None  # the same, where measured on the inputs' samples
    nonfinite: int = 0
    overflow: dict[str, Any] | None = None  # the op inside that overflows (first_overflow.py)
    candidate: torch.Tensor | None = None  # float32 sample of the candidate's output, kept for a compare record
    values: tuple[int, int, int] = (0, 0, 1)  # the output's sample: (values kept, floating values, every k-th)
    isolated_of: int | None = None  # the output's rows, when the isolated re-run computed isolated_rows of them
    isolated_failed: str | None = None  # why the isolated re-run gave no figure
    own: Own | None = None  # a container's own ops, judged in the fp64 pass (container_ops.py)
    # a leaf that diverged while none of its own ops loses anything: the exact module on its inputs
    # rounded to the candidate's format, its error (what any computation given those inputs loses)
    conditioned: float | None = None
    # the candidate's own run fed it floating inputs wider than the candidate's format (positions its
    # caller counts in fp32): their dtype; its isolated re-run rounds them, which that run does not
    wide_inputs: str | None = None


def compare(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str | Transform | None = None,
    reference: str | None = None,
    device: str | None = None,
    fp8_kernel: str | None = None,
    module: str | None = None,
    save_reference: str | os.PathLike[str] | None = None,
    against: str | os.PathLike[str] | CompareRecord | None = None,
    inputs_as_given: bool = False,
    decisions: str | None = None,
) -> CompareResult:
    """Layerwise error of `candidate` against fp64, judged against the fp64 noise floor.

    Two passes at full speed with every core: fp64 (keeping a strided sample of every module
    output, with the candidate's and the reference's leaf modules re-run on the same fp64
    inputs) and the candidate (reduced to error numbers against those samples at once).
    Memory: one forward at a time plus SAMPLE values per module call - never all activations.

    `device` runs the candidate on another device (device A vs device B): e.g. the model on CPU,
    `candidate="fp32", device="cuda"` shows which modules a GPU's kernels (TF32, reduced-precision
    reductions, another summation order) change beyond the reference's own error.

    `fp8_kernel` (fp8 candidates): "scaled_mm" multiplies with the real fp8 GEMM where it runs,
    "fake" dequantizes before an fp32 matmul, "auto" (default) is scaled_mm on GPUs with fp8
    tensor cores; the report says which ran, and why a layer fell back.

    `module` compares just that submodule (e.g. "encoder.layer.3"): it is fed what it receives
    when the whole model runs on `inputs`, and only it is copied (see scope.py).

    `inputs`: one input set (a tensor, a tuple of positional arguments, a dict of keyword
    arguments) or a list of them (or any iterable): each set is compared, and the result is the
    worst set's, with every set's line in the summary (`result.input_sets`, `result.worst_set`).

    `inputs_as_given=True` feeds the candidate the inputs as given, not cast to its dtype: for a
    model that casts them itself (raw fp32 readings standardised in fp32 before its first layer);
    nothing rounds them then, so the input floor is 0.

    Defaults: candidate fp16, reference fp32 (fp64 for an fp32 candidate on the model's own device:
    the floor would be the candidate itself), fp8_kernel auto.

    Across machines (precision/record.py): `save_reference=PATH` writes a compare record of this
    run (per module call the fp64 and the candidate's samples and the row's numbers, the inputs'
    digests, per module a digest of its weights, the machine's facts; the candidate defaults to
    fp32 then); on another machine `against=PATH` (or a CompareRecord) runs the same compare -
    candidate, reference, fp8_kernel and module from the record, a different one given is a
    ValueError - and names the first module where this run departs from the record's, or where
    the inputs, weights or computation differ.

    `decisions="argmax"` declares the output scores whose argmax over their last dim is the decision (a
    ranker's scores over candidates, summed log-probabilities) where compare's own test for logits does not
    take them: they are judged by the decisions they make, as logits are. `decisions="none"` declares an
    output that decides no class where compare's test would take it for logits (a regression of several
    values from a Linear head): it is judged by its error alone.

    `candidate` may be a function of yours that makes the candidate from the model (it is given an fp32
    copy and returns the model to judge: torch.ao.quantization.quantize_dynamic, a pruning, a swapped
    layer): judged against fp64 by what its output decides, with the modules to leave out of the
    transform checked (transformed.py)."""
    if decisions not in (None, "argmax", "none"):
        raise ValueError(
            "decisions must be 'argmax' (the argmax over the output's last dim) or 'none' (the output decides no "
            f"class: judged by its error alone), got {decisions!r}"
        )
    if candidate is not None and not isinstance(candidate, str):
        if not callable(candidate):
            raise ValueError(
                f"candidate must be a precision's name or a function that makes the candidate model, got "
                f"{type(candidate).__name__}"
            )
        given_too = {"reference": reference, "device": device, "fp8_kernel": fp8_kernel, "module": module,
                     "save_reference": save_reference, "against": against,
                     "inputs_as_given": inputs_as_given or None}  # fmt: skip
        extra = [k for k, v in given_too.items() if v is not None]
        if extra:
            raise ValueError(
                f"a candidate your function makes is judged against fp64 in fp32; it takes no {', '.join(extra)}"
            )
        return compare_transformed(model, inputs, transform=candidate, decisions=decisions)
    if candidate is not None and is_compiled(check_name(candidate, CANDIDATES, "candidate")):
        fp8_given = fp8_kernel is not None and check_name(fp8_kernel, FP8_KERNELS, "fp8 kernel") != "auto"
        given_too = {"device": device, "fp8_kernel": fp8_kernel if fp8_given else None, "module": module,
                     "save_reference": save_reference, "against": against,
                     "inputs_as_given": inputs_as_given or None, "decisions": decisions}  # fmt: skip
        extra = [k for k, v in given_too.items() if v is not None]
        if extra:
            raise ValueError(f"candidate {candidate!r} (torch.compile against eager) takes no {', '.join(extra)}")
        return compare_compiled(model, inputs, candidate=check_name(candidate, CANDIDATES, "candidate"),
                                reference=check_name(reference or "fp32", REFERENCES, "reference"))  # fmt: skip
    link = Link.open(save_reference, against) if save_reference is not None or against is not None else None
    if link is not None:
        settings = link.settings(candidate=candidate, reference=reference, fp8_kernel=fp8_kernel, device=device,
                                 module=module)  # fmt: skip
        candidate, reference, fp8_kernel = settings.candidate, settings.reference, settings.fp8_kernel
        device, module = settings.device, settings.module
    candidate = check_name(candidate or "fp16", CANDIDATES, "candidate")
    # a record keeps fp32's floor: the other machine's fp32 run is what it is compared with
    reference = check_name(
        reference or ("fp32" if link is not None else default_reference(candidate, device)), REFERENCES, "reference"
    )
    fp8_kernel = check_name(fp8_kernel or "auto", FP8_KERNELS, "fp8 kernel")
    if device is not None:
        check_device(device)
    elif candidate == reference and link is None:
        raise ValueError(
            f"candidate {candidate} against reference {reference} on the same device compares the model with itself: "
            f"give --reference fp64 for what {candidate} loses, or --device for what another device changes"
        )
    sets = input_sets(inputs)
    given = as_given(uncompiled(model), sets[0])
    samples = [Samples() for _ in sets]
    results = [
        compare_set(model, one, candidate=candidate, reference=reference, device=device, fp8_kernel=fp8_kernel,
                    module=module, samples=samples[k] if link is not None else None, inputs_as_given=inputs_as_given,
                    decisions=decisions)
        for k, one in enumerate(sets)
    ]  # fmt: skip
    described = [describe(one) for one in sets]
    result = merge_sets(results, described, given)
    if link is not None:
        link.finish(result, model=uncompiled(model), settings=settings, described=described, results=results,
                    samples=samples)  # fmt: skip
    return result


def compare_set(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str,
    reference: str = "fp32",
    device: str | None = None,
    fp8_kernel: str = "auto",
    module: str | None = None,
    samples: Samples | None = None,
    inputs_as_given: bool = False,
    decisions: str | None = None,
) -> CompareResult:
    """compare() on one input set, the names already checked. `samples`, when given, gets each
    judged module call's row with its fp64 and candidate samples, for a compare record."""
    _refuse_sparse(model, [inputs])  # compare and plan alike
    cand_device = check_device(device) if device is not None else None
    compiled, model = model is not uncompiled(model), uncompiled(model)
    if module is not None:
        target = find_module(model, module)
        try:
            inputs = module_inputs(model, inputs, target)
        except ValueError:
            raise
        except Exception as exc:
            raise ReferenceFailed(f"the model fails before it reaches `{module}`: {type(exc).__name__}: {exc}") from exc
        model = target
    on = cand_device or model_device(model)  # where the candidate runs: its kernels and flags are chosen for it
    if on.type == "cuda":
        # CUDA starts in this call anyway. Started first, its RNG (with a seed the user set before,
        # which torch applies at start-up) is saved and put back too, not left advanced by our runs.
        torch.cuda.init()
    rng = RngState.capture()  # every pass starts from it; the user's RNG is left as it was
    try:
        with run_flags(candidate, on) as flags:
            result = _compare(
                model,
                inputs,
                candidate=candidate,
                reference=reference,
                cand_device=cand_device,
                on=on,
                fp8_kernel=fp8_kernel,
                rng=rng,
                prefix=module,
                samples=samples,
                given=inputs_as_given,
                decisions=decisions,
            )
    finally:
        rng.restore()
    if module is not None:
        result.report.data["summary"].insert(
            1, ("module", f"`{module}` alone, fed its inputs from a forward of the whole model in its own dtype")
        )
    if inputs_as_given:
        result.report.data["summary"].insert(
            1, ("inputs fed", f"as given to every {candidate} run (--inputs-as-given): the model casts them itself")
        )
    if compiled:
        result.report.data["not_checked"]["torch.compile"] = (
            "the model is compiled; every run went eagerly, module by module (compiled kernels fuse ops and may "
            "round differently)"
        )
    if flags:
        allowed = flags["allow_fp16_reduced_precision_reduction"]
        result.report.data["flags"] = flags
        result.report.data["summary"].append(
            (
                "fp16 GEMM reductions (CUDA)",
                f"{'fp16 allowed' if allowed else 'fp32'} (allow_fp16_reduced_precision_reduction={allowed}; "
                f"yours is {flags['yours']})",
            )
        )
    return result


def _compare(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str,
    reference: str,
    cand_device: torch.device | None,
    on: torch.device,
    fp8_kernel: str,
    rng: RngState,
    prefix: str | None,
    samples: Samples | None = None,
    given: bool = False,
    decisions: str | None = None,
) -> CompareResult:
    """The steps of one comparison, in order (see the module's docstring)."""
    run = _Comparison(
        model, inputs, candidate=candidate, reference=reference, cand_device=cand_device, on=on,
        fp8_kernel=fp8_kernel, rng=rng, keep_candidate=samples is not None, given=given, decisions=decisions,
    )  # fmt: skip
    with progress.task(f"compare {candidate}", total=4, unit="steps") as step:
        step.describe(f"compare {candidate}: the fp64 pass, each module re-run in {candidate}")
        run.truth_pass()
        step.advance()
        step.describe(f"compare {candidate}: the {candidate} pass")
        run.candidate_pass()
        step.advance()
        step.describe(f"compare {candidate}: containers")
        rows = run.judge_containers(_rows(run.seen, run.own_dtype))
        run.weights_lost(rows)
        forced = run.forced(rows)  # may confirm a container by its check: before what reads `diverged`
        step.advance()
        step.describe(f"compare {candidate}: the input rounding floor")
        input_floor = run.input_floor(rows) if not prefix else None
        step.advance()
        accumulation = run.accumulation(rows, input_floor)
        inputs_cause = run.inputs_cause(rows, input_floor) if accumulation is None else None
        # whole numbers the inputs' rounding moved (item ids) are that finding's: their `.long()` is no other cause
        selection = run.selection(rows, accumulation) if not (inputs_cause or {}).get("columns") else None
        own = run.own_code(rows) if accumulation is None and selection is None and not inputs_cause else None
    kept = [(r, run.seen[(r.module, r.call)]) for r in rows] if samples is not None else []
    result = run.result(rows, input_floor, prefix, accumulation, forced, inputs_cause=inputs_cause,
                        selection=selection, own=own)  # fmt: skip
    if samples is not None:  # after result(): the rows carry their names in the whole model now
        samples.extend((r, e.truth, e.candidate) for r, e in kept)
        if not prefix:  # an output of logits, as its rows decide (use.py), for the record's use metrics
            samples.decided = decision_record(run.logits, run.root_truth, run.root_cand, output_format(candidate))
    return result


# Rows a classifier's decisions are judged to hold on at the least (one flip is 1%)
HOLD_ROWS = 100

# An output lost in its units (units.py) has its running states tried where the end-to-end error is this many
# times what any part adds by itself (below DIVERGENCE_RATIO: a rollout half as long loses half as much)
LOST_UNEXPLAINED = 4.0

# An fp32 op whose inputs, rounded to fp32, alone leave its output this many times its own rounding off
# subtracts values far larger than their difference (2^13: fewer than 11 of fp32's 24 bits left): a
# formula, not a kernel, loses the digits, and the formula computed otherwise keeps them
CANCELS = 8192.0

# The lines above an fp32 candidate's worst own op that its fp64 check takes in, one at a time
ROOT_LINES_UP = 4

# A line after a checked fix's lines is added to it where computing it in fp32 too takes the error
# down by this much again (deterministic runs: any such fall is the line's, not noise)
EXTEND_FALLS = 1.25


class _Comparison:
    """One comparison's copies of the model and what its passes keep. The copies go into eval
    mode, never the user's model: model.train(flag) on the way back would overwrite every
    submodule's own flag (a frozen BatchNorm inside a training model)."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        candidate: str,
        reference: str,
        cand_device: torch.device | None,
        on: torch.device,
        fp8_kernel: str,
        rng: RngState,
        keep_candidate: bool = False,
        given: bool = False,
        decisions: str | None = None,
    ) -> None:
        self.model, self.inputs, self.rng = model, inputs, rng
        # "argmax": the output's scores decide by their argmax; "none": it decides nothing; as the user says
        self.declared = decisions
        # what the candidate's and the fp64 runs are fed: the inputs as given (the model casts them: the fp64
        # model reads the same values in float64 where it computes with them), or cast to each run's dtype
        self.given = given
        self.run_inputs = Given(*split_inputs(inputs)) if given else inputs
        self._held: Any = None  # the decisions, where they are unchanged (_decisions_hold)
        self.given_ids: dict[int, torch.dtype] = {}  # the fp64 pass's copies of them, by id
        self.keep_candidate = keep_candidate
        self.candidate, self.reference, self.cand_device = candidate, reference, cand_device
        self.on = on  # where the candidate runs (its device type decides which kernels and flags apply)
        self.truth_run = make_run(model, "fp64").eval()
        self.cand_run = make_run(model, candidate, fp8_kernel, on).eval()
        self.ref_run = make_run(model, reference).eval() if reference != "fp64" else None
        if cand_device is not None:
            self.cand_run = self.cand_run.to(cand_device)
        self.cand_dtype = compute_dtype(candidate)
        self.ref_dtype = compute_dtype(reference)
        self.label = candidate if cand_device is None else f"{candidate} on {cand_device}"
        self.leaves = {name for name, m in self.truth_run.named_modules() if not list(m.children())}
        self.cand_modules = dict(self.cand_run.named_modules())
        self.ref_modules = dict(self.ref_run.named_modules()) if self.ref_run is not None else {}
        # the user's own weights (not the fp64 copies): the fp8 statistics convert them to float32 anyway
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.fp8_dtype = fp8_format(candidate)
        self.seen: dict[tuple[str, int], _Seen] = {}
        self.fp8_rows: list[dict[str, Any]] = []
        self.notes: dict[str, str] = {}
        # On another device the kernels are picked by shape, so a few rows would not run the same ones.
        self.subsets = cand_device is None or cand_device.type == "cpu"
        self.noise: ReplayNoise | None = None  # set when the forward draws random numbers itself
        self._pending: dict[tuple[str, int], tuple[Any, Any, tuple[RngState, int] | None]] = {}
        self._cand_inputs: dict[tuple[str, int], Any] = {}
        # op outputs near the candidate's max inside modules (fp16: the one format whose max models reach)
        self.ranges = self.cand_dtype in near_limit.AT_RISK
        self.truth_ranges, self.cand_ranges = near_limit.OpRanges(), near_limit.OpRanges(near_limit.AT_RISK)
        # an output of logits, whole (use.py): the fp64 pass's and the candidate's, and what made it
        self.truth_modules = dict(self.truth_run.named_modules())
        self._last_leaf: str | None = None
        self._truth_nan = 0  # NaN values in the fp64 run's output: nothing for compare to judge (_truth_post)
        self._last_output: Any = None  # the last leaf call's output, until the model's own returns
        # 2-D tensors the forward's modules made, by their row count: a table of class embeddings a text
        # tower encodes in the forward (zero-shot scores), for `use.class_table_source`
        self._tables: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.cand_failed: Exception | None = None  # what the candidate's run raised, if it did
        self.logits: str | None = None
        self.binary = False  # the logits are a sigmoid's probabilities, as _decided gives them (_binary)
        self.softmaxed = False  # ... or a softmax's over the classes (_softmax_of)
        self.ids = False  # ... or the decisions themselves: ids (integers) a decoding loop made
        self._picked = False  # ... or a top-k's indices, returned beside its values (_picked)
        self.root_truth: torch.Tensor | None = None
        # the running states named the cause (step 5) and their checked run's output
        # the states kept, the checked run's output, the lines that make what they read computed in fp32 with them
        self.state_fix: tuple[list[str], torch.Tensor, list[tuple[str, int]]] | None = None
        # the output of the checked run that computed the lines feeding an ill-conditioned op in fp32 (step 5b)
        self.line_fix: torch.Tensor | None = None
        # modules kept in fp32 with fp32 between them, checked (_kept_checked): the fix, what it changed, the output
        self.kept_fix: tuple[str, str, torch.Tensor] | None = None
        # runs that checked a fix at some lines, by (kind, first line, lines after): their outputs
        self._fix_outputs: dict[tuple[str, Any, int], torch.Tensor | None] = {}
        self._keep_fix_outputs = False
        self.made_fix: tuple[Finding, torch.Tensor] | None = None  # NUM020/NUM021 and its checked run's output
        self.selection_fix: tuple[Finding, torch.Tensor] | None = None  # NUM022 and its checked run's output
        self._input_floor: tuple[float | None] | None = None  # the reference fed the rounded inputs, once measured
        self._kept: tuple[Kept | None] | None = None  # _kept_sets' answer, once the candidate pass ran
        self.root_masked = False  # the fp64 output masks entries with -inf (passes.MASKS)
        self._root_filtered = False  # the fp64 output is a filtered distribution (_filter_figures)
        # why the input floor is 0 without a forward (rounding the inputs changes nothing), where it is
        self.input_floor_note: str | None = None
        self.input_fix: tuple[dict[str, Any], torch.Tensor] | None = None  # input_cause's fix and its run's output
        self._root_row: int | None = None  # the output's last dim, where the sample is all of it
        self.root_cand: torch.Tensor | None = None
        self.root_cand_dtype: torch.dtype | None = None  # the dtype the candidate returns its output in
        self.root_units: InUnits | None = None  # an output that is not logits, in its units (units.py)
        self._units_truth: torch.Tensor | None = None  # the fp64 sample root_units is measured on
        # module calls whose candidate output had another size than the fp64 one (rows a selection picked)
        self.unmatched: dict[str, None] = {}

    # -- where the random numbers stand ------------------------------------------------------
    def mark(self) -> tuple[RngState, int]:
        return RngState.capture(), 0 if self.noise is None else self.noise.position

    def goto(self, where: tuple[RngState, int]) -> None:
        where[0].restore()
        if self.noise is not None:
            self.noise.position = where[1]

    def _first_overflow(self, module: Any, name: str, args: Any, kwargs: Any) -> Any:
        """The op inside candidate `module` (called as `name`) that overflows the format, if any."""
        return first_overflow(
            module,
            self.ref_modules.get(name),
            args,
            kwargs,
            dtype=self.cand_dtype,
            reference_dtype=self.ref_dtype,
            device=self.cand_device,
            given=self.given_ids,
        )

    def _fed(self, inputs: Any) -> None:
        """The copies of the inputs an fp64 pass runs on: those given as they are (`given`), by id,
        for the re-runs of what reads them."""
        self.given_ids.clear()
        if self.given:
            map_tensors(inputs, lambda t: self.given_ids.setdefault(id(t), t.dtype) if t.is_floating_point() else None)

    # -- step 1: the fp64 pass (the truth), with each leaf's isolated re-runs ------------------
    def truth_pass(self) -> None:
        self._truth_once()
        if not self.rng.same(RngState.capture()):
            # The forward draws random numbers itself: record them in a plain fp64 run, then run the
            # fp64 pass again, now with every re-run and every other pass getting the same draws.
            self.noise = ReplayNoise(record_noise(self.truth_run, self.run_inputs, self.rng))
            self.subsets = False  # a leaf's draws on fewer rows would not match the recorded ones
            self._truth_once()
        self.overflows()

    def _truth_once(self) -> None:
        self.seen.clear()
        self.reads = Reads()
        self._overflowing: set[str] = set()  # leaves whose isolated re-run turned non-finite (overflows())
        self._last_leaf, self._last_output = None, None
        self._tables.clear()
        self.fp8_rows.clear()
        # a container's own ops, judged as the fp64 pass runs them (row subsets where leaves get them)
        fp8_note = " (fp8 applies to Linear GEMMs only)" if self.fp8_dtype is not None else ""
        self.own_dtype = str(self.cand_dtype).removeprefix("torch.") + fp8_note
        # a leaf the user wrote (no submodules, its own arithmetic: a norm, a pooling) is judged op by
        # op too, for the op and line inside it; torch's leaves (Linear, LayerNorm) are one op each
        written = {n for n, m in self.truth_run.named_modules() if n in self.leaves and not _torch_made(m)}
        ops = OwnOps(
            ({name for name, _ in self.truth_run.named_modules()} - self.leaves) | written,
            dtype=self.cand_dtype,
            reference=self.ref_dtype if self.ref_run is not None else None,
            device=self.cand_device,
            subsets=self.cand_device is None or self.cand_device.type == "cpu",
            torch_made={name for name, m in self.truth_run.named_modules() if _torch_made(m)},
            # the reference (fp64) value of each op output, taken in the same dispatch
            record=self.truth_ranges.record if self.ranges else None,
            reads=self.reads,
            model_storages={
                t.untyped_storage().data_ptr() for t in (*self.truth_run.parameters(), *self.truth_run.buffers())
            },
        )
        # one Python call per torch function, not per aten op (own_calls.py), where every op need not
        # pass through a dispatch mode: the op ranges read them all, the replayed noise sits below it
        self.own: OwnOps | OwnCalls = ops if self.ranges or self.noise is not None else OwnCalls(ops)
        self.made = ops.made  # lines making values the candidate's format rounds (made_in_dtype.py)

        def post(name: str, index: int, args: Any, output: Any) -> None:
            self.own.leave(name, index)
            with self.own.paused():  # what the hook computes is no op of the model's
                self._truth_post(name, index, args, output)

        pre: Any = self._truth_pre
        if self.ranges:
            self.truth_ranges.clear()
            pre, post = self.truth_ranges.pre(pre), self.truth_ranges.post(post)
        try:
            with self.own:
                hooked(
                    self.truth_run, self.run_inputs, torch.float64, pre=pre, post=post, rng=self.rng,
                    noise=self.noise, fed=self._fed,
                )  # fmt: skip
        except ReferenceFailed:
            raise
        except Exception as exc:
            raise self._reference_failed(exc) from exc
        self.reads.read()  # every figure of the pass, in one wait for the device
        if self._truth_nan:
            raise ReferenceFailed(
                f"the model's output holds {self._truth_nan} NaN values in its fp64 run too: no precision makes them "
                "finite, so there is nothing for compare to judge (the output's -inf, a mask, is fine; a NaN is not). "
                "`fpdoctor trace` on a script that runs the model names the op that makes them and the rows"
            )
        self.own.settle()  # the own ops whose figures call for a closer look (container_ops.Own.settle)

    def _reference_failed(self, exc: Exception) -> ReferenceFailed:
        """The one-line error for a model whose fp64 copy raised: the user's line that raised, and for
        a dtype mismatch (a dtype fixed in the forward, `x.to(torch.float16)`) audit's account of it:
        the line where the odd dtype entered and the cast that fixes it."""
        given = (
            " on its inputs as given (inputs_as_given): it does not cast them itself; leave that out, or cast "
            "them in its forward"
            if self.given else ""
        )  # fmt: skip
        head = f"the model fails in the reference run (its fp64 copy){given}"
        quantized = _quantized(self.truth_run)
        if quantized is not None:  # no float copy of an int8 layer exists: a cast of the inputs cannot help
            name, kind = quantized
            return ReferenceFailed(
                f"{head}: `{name}` is a quantized module ({kind}), which runs in no floating dtype, so there is no "
                "fp64 run of this model to judge it against",
                fix="give compare the floating model the quantized one was made from (before quantize_dynamic or "
                "convert) with --candidate the precision you mean; a quantized model is not a candidate it can run",
            )
        if not self.given and mismatch_error(str(exc)) == "dtype":
            explained = explain_failure(self.truth_run, cast_inputs(self.run_inputs, torch.float64, copy=True))
            if explained is not None and explained.fix:
                return ReferenceFailed(f"{head}: {explained.message.rstrip('.')}", fix=explained.fix.splitlines()[0])
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
        at = f" at {frames[-1].filename}:{frames[-1].lineno} (`{(frames[-1].line or '').strip()}`)" if frames else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ReferenceFailed(f"{head}{at}: {type(exc).__name__}: {text}")

    def _truth_pre(self, name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        self.own.enter(name, index)  # the ops from here to its post hook, outside its submodules, are its own
        # where a leaf starts, for its re-runs (containers are re-run from the suspect pass)
        self._pending[(name, index)] = (args, kwargs, self.mark() if name in self.leaves else None)

    def _truth_post(self, name: str, index: int, args: Any, output: Any) -> None:
        key = (name, index)
        call_args, call_kwargs, start = self._pending.pop(key, (args, {}, None))
        own = self.own.take(name, index)
        if isinstance(output, torch.Tensor) and any(a is output for a in call_args):
            return  # an identity in this mode (Dropout in eval, Identity): nothing new to judge
        t = device_sample(output)
        if t is None:
            if name == "" and self._last_leaf is not None:
                self._keep_logits(output)  # no floating output: ids the model decided, if it returns them
            return
        if name == "":  # a NaN the exact run makes (0 / 0 in any precision) is no precision's: one read a compare,
            # with the -inf the output masks with (the entries no run is judged on: passes.MASKS)
            counts = [torch.stack([torch.isnan(x).sum(), torch.isneginf(x).sum()]) for x in floating(output)]
            # and whether it is a filtered distribution (a sampler's), read with them: one host read
            shape = _filter_figures(next(floating(output))) if counts else None
            parts = [torch.stack(counts).double().reshape(-1), *([shape] if shape is not None else [])]
            figures = torch.cat(parts).tolist() if counts else []
            found = [(int(figures[2 * i]), int(figures[2 * i + 1])) for i in range(len(counts))]
            self._root_filtered = shape is not None and _filtered_by(figures[2 * len(counts) :])
            self._truth_nan = sum(nan for nan, _ in found)
            self.root_masked = bool(found) and found[0][1] > 0 and not self._truth_nan
            t = masked_truth(t) if self.root_masked else t
        entry = _Seen(t, 0.0, 0.0, name in self.leaves, sum(x.numel() for x in tensors_in(output)))
        entry.single = isinstance(output, torch.Tensor)
        module = self.truth_modules.get(name)
        entry.weighted = module is not None and any(p.is_floating_point() for p in module.parameters())
        norm = norm_later(t)  # computed and read with the pass's other figures at its end (metrics.Reads)

        def read(norm: float, rounded: float, entry: _Seen = entry) -> None:
            entry.norm, entry.rounding = norm, relative(rounded, norm)

        self.reads.later([norm, diff_later(round_to(t, self.candidate), t)], read)
        total = sum(x.numel() for x in floating(output))
        entry.values, entry.own = (t.numel(), total, sample_step(total)), own
        entry.inputs = device_sample((call_args, call_kwargs))  # the candidate's input error, for every row
        if entry.leaf:
            self._last_leaf = name
            self._last_output = output
        if name and isinstance(output, torch.Tensor) and output.dim() == 2 and output.is_floating_point():
            self._tables[output.shape[0]] = (name, tuple(output.shape))  # the outermost: its post hook runs last
        # logits a leaf made, or a filtered distribution the model's own ops made (a sampler's filter alone)
        if name == "" and (self._last_leaf is not None or self._root_filtered):
            self._keep_logits(output)
        if name == "":
            self._last_output = None
        if entry.leaf:
            self.isolated(name, call_args, call_kwargs, entry, start=start or self.mark(), output=output, norm=norm)
            if self.fp8_dtype is not None and name in self.linears and call_args:
                self.fp8_rows.append(
                    fp8.linear_stats(name, call_args[0], self.linears[name].weight, self.fp8_dtype, self.reads)
                )
        self.seen[key] = entry

    def weights_lost(self, rows: list[ModuleRow]) -> None:
        """A Linear whose fp8 weight loses its values to the scale (fp8.weight_lost, measured) makes its
        error itself: its row says so where its error moves against its inputs', not that it amplifies them."""
        recipe = "rowwise" if self.candidate.endswith("-rowwise") else "tensorwise"
        lost = {r["module"]: text for r in self.fp8_rows if (text := fp8.weight_lost(r, recipe)) is not None}
        for row in rows:
            row.own_loss = lost.get(row.module)
        if lost:
            annotate(rows)

    def _keep_logits(self, output: Any) -> None:
        """The model's output, whole, when it is logits (use.py): the last leaf call made it, and
        what the model returns is that output as it is (a cast at most), not something computed
        from it (an embedding normalised after its projection decides no class), and of another shape
        than every input (a denoiser predicts its input's noise); or a sigmoid's probabilities, one
        per row (`_binary`)."""
        self.binary = self.softmaxed = self.ids = False
        first = next(floating(output), None)
        name = self._last_leaf or ""
        ids = _ids_of(output) if first is None else _picked(output, first)
        self._picked = ids is not None and first is not None
        if ids is not None:  # ids the model decided (greedy decoding, a retrieval's top-k), judged by agreement
            self.ids = True
            beside = "" if first is None else f", {use.PICKED}"
            self.logits = f"ids the model returns ({'x'.join(str(n) for n in ids.shape)} integers{beside})"
            self.root_truth = ids.detach().clone()
            return
        made = next(floating(self._last_output), None)
        if self.declared == "none":
            return  # the user says the output decides no class (a regression of several values)
        if first is None:
            return
        # a filtered distribution (read with the output's NaN count, _truth_post) from the logits' layer, or made
        # by a model with no weights of its own (the filter alone, given logits): not attention weights
        # over causal keys, nor an output normalised per row
        head = self._filter_head(first, name, made) if self._root_filtered else None
        weightless = not any(p.is_floating_point() for p in self.truth_modules[""].parameters())
        # over positions, not classes: a map whose last two dims are equal (attention weights, query by key)
        square = first.dim() >= 2 and first.shape[-1] == first.shape[-2]
        filtered = (
            self._root_filtered and not square and self._softmax_of(first, name, made) is None and (head or weightless)
        )
        if not self.declared and any(t.shape == first.shape for t in floating(self.inputs)) and not filtered:
            # an output in its input's space (a denoiser's noise, a reconstruction) decides no class; a filtered
            # distribution does (a sampler's filter given the logits it keeps a nucleus of)
            return
        ours = device_sample(first)  # the same strided values, no whole copy
        theirs = device_sample(made) if made is not None and first.shape == made.shape else None
        if filtered:
            # a distribution made after the logits, not their softmax (a sampler's filtered, renormalised
            # probabilities, of the last position's logits or of logits it was given; by the model's own ops or a
            # module of its own, the last leaf): judged as a softmax's are, by their logs
            rows = first.numel() // first.shape[-1]
            by = f"`{name}`" if name and name not in (head or "") else "the model's own ops"
            self.logits = (
                f"probabilities over {first.shape[-1]} classes ({rows} rows, each summing to 1, made by {by}"
                f"{f' from the {head}' if head else ' from the logits it is given'})"
            )
            self.softmaxed = True
        elif ours is not None and theirs is not None and _proportional(ours, theirs):
            # as it is, or times a positive constant (a temperature, a learned logit scale): the same argmax
            module = self.truth_modules[name]
            self.logits = use.logits_source(name, module, first, ids=use.reads_ids(self.inputs))
            self.logits = self.logits or use.class_table_source(name, module, first)
            if self.logits is not None and not torch.allclose(ours, theirs, rtol=1e-6, atol=0.0):
                self.logits += ", scaled by a constant after it"
        elif _masked_of(first, made) and (head := self._head_of(first, name, made)) is not None:
            # the logits' layer made them, the model's own ops masked some after it (a filter's -inf)
            self.logits = f"{head}, as the model's own ops after it mask them"
        else:  # the model's own ops made it after its last leaf: scores against a table of its own, one
            # a module made, or one it was given (a memory bank of a kNN passed as an input)
            given = {t.shape[0]: (use.GIVEN, tuple(t.shape)) for t in floating(self.inputs) if t.dim() == 2}
            tables = {**given, **self._tables}
            self.logits = use.class_table_source("", self.truth_modules[""], first, made=tables)
        if self.logits is None:
            self.logits = self._binary(first, name, made)
            self.binary = self.logits is not None
        if self.logits is None:
            self.logits = self._softmax_of(first, name, made)
            self.softmaxed = self.logits is not None
        if self.logits is None:
            self.logits = self._log_softmax_of(first, name, made)
        if self.logits is None and self.declared == "argmax" and first.dim() >= 1 and first.shape[-1] >= 2:
            shape = "x".join(str(n) for n in first.shape)
            self.logits = f"scores [{shape}] decided by their argmax over the last dim (declared: decisions='argmax')"
        self.root_truth = self._decided(first.detach().clone()) if self.logits is not None else None

    def _filter_head(self, first: torch.Tensor, name: str, made: torch.Tensor | None) -> str | None:
        """The logits' layer a filtered distribution comes from: the last leaf (the model's own ops filter its
        logits), or the leaf before a last leaf without weights of its own (a filter module called last)."""
        head = self._head_of(first, name, made)
        module = self.truth_modules.get(name)
        if head is not None or not name or module is None or any(True for _ in module.parameters()):
            return head
        before = self._leaf_before(name)
        if before is None:
            return None
        return use.logits_source(before, self.truth_modules[before], first, ids=use.reads_ids(self.inputs))

    def _head_of(self, first: torch.Tensor, name: str, made: torch.Tensor | None) -> str | None:
        """The logits' layer an output the model's own ops made after it comes from: the last leaf is a
        Linear to the output's classes (use.logits_source) and made an output of its shape (an LM's
        lm_head, before a sampler's filter). None otherwise."""
        # of the output's shape, or of more positions (an LM's last position taken after it: logits[:, -1])
        if made is None or made.shape[-1:] != first.shape[-1:] or made.numel() < first.numel() or not name:
            return None
        return use.logits_source(name, self.truth_modules[name], made, ids=use.reads_ids(self.inputs))

    def _binary(self, first: torch.Tensor, name: str, made: torch.Tensor | None) -> str | None:
        """How the report names an output of probabilities a sigmoid made, one per row, decided at 0.5
        (a detector's, a binary classifier's): the model's last leaf (`name`, its output `made`) is an
        nn.Sigmoid, or the output is the sigmoid of what it made (torch.sigmoid(self.head(h))); None
        for any other output."""
        if first.dim() > 2 or (first.dim() == 2 and first.shape[-1] != 1) or first.numel() < 2:
            return None
        if made is None or made.numel() != first.numel() or not made.is_floating_point():
            return None
        module = self.truth_modules.get(name)
        applied = made if isinstance(module, nn.Sigmoid) else torch.sigmoid(made)
        if not torch.allclose(applied.reshape(-1).to(first.dtype), first.reshape(-1), rtol=1e-6, atol=0.0):
            return None
        return f"probabilities of a sigmoid, one per row, decided at 0.5 ({first.numel()} rows)"

    def _softmax_of(self, first: torch.Tensor, name: str, made: torch.Tensor | None) -> str | None:
        """How the report names an output of probabilities a softmax over the classes made (a
        classifier that returns probabilities): the model's last leaf (`name`, its output `made`, the
        logits of a Linear to the classes) is an nn.Softmax, or the output is the softmax of what it
        made (torch.softmax(self.head(h) / temperature, -1)); None for any other output."""
        if first.dim() < 2 or first.shape[-1] < 2 or made is None or made.shape != first.shape:
            return None
        if not made.is_floating_point():
            return None
        if not _sums_to_one(first):
            return None  # not probabilities (log-probabilities are not above 0: every row would look the same)
        module = self.truth_modules.get(name)
        if isinstance(module, nn.Softmax):
            applied = made
        else:  # softmax(logits / temperature): the scale read off the log-probabilities, where they are held
            lp, z = first.double().clamp_min(1e-300).log(), made.double()
            held = first > 1e-200
            count = held.sum(-1, keepdim=True).clamp_min(1)
            a = torch.where(held, lp - torch.where(held, lp, 0.0).sum(-1, keepdim=True) / count, 0.0)
            b = torch.where(held, z - torch.where(held, z, 0.0).sum(-1, keepdim=True) / count, 0.0)
            scale = float((a * b).sum() / (b * b).sum().clamp_min(1e-300))
            applied = torch.softmax(z * scale, -1) if scale > 0 else z
        if not torch.allclose(applied.to(first.dtype), first, rtol=1e-5, atol=1e-9):
            return None
        rows = first.numel() // first.shape[-1]
        return f"probabilities of a softmax over {first.shape[-1]} classes ({rows} rows)"

    def _log_softmax_of(self, first: torch.Tensor, name: str, made: torch.Tensor | None) -> str | None:
        """How the report names log-probabilities of the last leaf's logits (`name`, its output `made`): the
        output is what it made times a positive constant (a temperature) less one constant per row, its
        log-sum-exp (each row's log-sum-exp is 0: a log-softmax called or written out), which keeps each
        row's argmax and softmax; or an nn.LogSoftmax's output, of the logits (or class-table scores) before
        it. None for any other output. Its relative error is read against values of the size of the
        log-sum-exp (-44 for logits / 0.02), which hides a change of the decided class."""
        if first.dim() < 2 or first.shape[-1] < 2 or made is None or made.shape != first.shape:
            return None
        module = self.truth_modules.get(name)
        if module is None or not made.is_floating_point():
            return None
        if isinstance(module, nn.LogSoftmax):  # an nn.LogSoftmax last (an NLLLoss classifier): its input's logits
            head = self._leaf_before(name)
            scores = self.truth_modules[head] if head else None
            ids = use.reads_ids(self.inputs)
            source = use.logits_source(head, scores, first, ids=ids) if head and scores is not None else None
            # or scores against a class table (a cosine head's): the leaf before holds one row per class
            source = source or (use.class_table_source(head, scores, first) if head and scores is not None else None)
            # or the model's own ops made them, against a table of its own
            source = source or use.class_table_source("", self.truth_modules[""], first)
            return f"log-probabilities of the {source} (an nn.LogSoftmax after it)" if source else None
        source = use.logits_source(name, module, made, ids=use.reads_ids(self.inputs))
        source = source or use.class_table_source(name, module, made)
        if source is None:
            return None
        a, b = first.double(), made.double()
        if not bool((torch.logsumexp(a, -1).abs() < 1e-3).all()):
            return None  # not normalised: a level added per row (a station's climatology) is a regression's
        a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        scale = float((a * b).sum() / (b * b).sum().clamp_min(1e-300))
        if not (math.isfinite(scale) and scale > 0):
            return None
        if not torch.allclose(b * scale, a, rtol=1e-5, atol=1e-6 * float(a.abs().max())):
            return None
        temperature = ", scaled by a constant" if abs(scale - 1.0) > 1e-6 else ""
        return f"log-probabilities of the {source}{temperature} (a log-softmax after it)"

    def _decided(self, t: torch.Tensor) -> torch.Tensor:
        """An output as use.py judges logits: a sigmoid's probabilities p as two classes' log
        probabilities [log(1 - p), log p] (top-1 is p > 0.5; rounding them costs about what rounding p
        does), a softmax's as their logs (log p: the logits less their log-sum-exp), any other output as
        it is."""
        if self.softmaxed:
            return t.detach().double().clamp_min(1e-300).log()
        if self.root_masked:  # logits masked with -inf: a finite logit no softmax keeps (exp(-1e4) is 0)
            return torch.where(torch.isneginf(t), MASKED_LOGIT, t)
        if not self.binary:
            return t
        p = t.detach().double().reshape(-1).clamp(1e-12, 1 - 1e-12)
        return torch.stack([torch.log1p(-p), torch.log(p)], -1)

    def isolated(
        self, name: str, args: Any, kwargs: Any, entry: _Seen, *, start: tuple[RngState, int], output: Any = None,
        norm: Later | float | None = None,
    ) -> None:  # fmt: skip
        """Re-run the candidate's and the reference's `name` on the fp64 inputs (all rows, or ROWS),
        each from where the fp64 module started (`start`: RNG state, next recorded draw), so they
        get the same random numbers; the fp64 pass then goes on from where it was. The figures are
        read with the pass's others (`self.reads`); `norm`: the output sample's norm, if not read yet.
        A re-run whose output is non-finite where the output fits the format is searched for the op
        that overflows after the pass (`overflows`)."""
        after = self.mark()
        module = self.cand_modules[name]
        rows = row_subset(module, args, kwargs, output) if self.subsets and output is not None else None
        truth_norm: Later | float
        if rows is not None:
            x, truth, extra = rows[0], rows[1].reshape(-1), rows[2]
            truth_norm = norm_later(truth)
            entry.isolated_rows, entry.isolated_of = x.shape[0], output.numel() // max(rows[1][0].numel(), 1)
        else:
            x, truth, extra = None, entry.truth, {}
            truth_norm = entry.norm if norm is None else norm
            entry.isolated_rows = entry.isolated_of = None
        try:
            self.goto(start)
            got = rerun(module, x, args, kwargs | extra, dtype=self.cand_dtype, device=self.cand_device, truth=truth,
                        given=self.given_ids)  # fmt: skip
            entry.isolated_failed = None if got is not None else "its re-run's output has another size"
            entry.isolated = entry.isolated_cosine = None
            if got is not None:

                def read(*values: Any) -> None:
                    entry.isolated, entry.isolated_cosine = read_rerun(*values)
                    if math.isinf(entry.isolated) and math.isfinite(entry.rounding):
                        # its output fits the format, yet it is non-finite: which op inside it overflows
                        self._overflowing.add(name)

                self.reads.later(rerun_figures(got, truth, truth_norm), read)
                # a format of narrow range only (fp16: bf16's is fp32's): one reduction of the inputs per call
                if self.cand_dtype.is_floating_point and torch.finfo(self.cand_dtype).max < 1e10:
                    limit = torch.finfo(self.cand_dtype).max

                    def past(biggest: float | None) -> None:
                        # its fp64 inputs are past the format's range: no run of it in the format can take them,
                        # and the Inf is made where they are (an aggregation upstream), not by it
                        if (
                            biggest is not None
                            and math.isfinite(biggest)
                            and biggest > limit
                            and (entry.isolated is not None and math.isinf(entry.isolated))
                        ):
                            entry.inputs_past = (
                                f"its inputs reach {biggest:.3g} in fp64, past {self.label}'s largest value "
                                f"({limit:.6g}): the Inf comes in, made upstream"
                            )
                            self._overflowing.discard(name)

                    self.reads.later([largest((args, kwargs))], past)
        except Exception as exc:  # e.g. an op without a kernel for the candidate's dtype here
            self.notes.setdefault("isolated re-run", f"`{name}` raised {type(exc).__name__} in {self.label}: {exc}")
            entry.isolated = entry.isolated_cosine = None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            entry.isolated_failed = f"re-run raised {type(exc).__name__} in {self.label}: {first}"
        if name in self.ref_modules:
            try:
                self.goto(start)
                got = rerun(self.ref_modules[name], x, args, kwargs, dtype=self.ref_dtype, device=None, truth=truth,
                            given=self.given_ids)  # fmt: skip
            except Exception as exc:
                raise ReferenceFailed(
                    f"the model fails in the {self.reference} reference run, at `{name}`: {type(exc).__name__}: {exc}"
                ) from exc
            entry.reference = None
            if got is not None:

                def reference(*values: Any) -> None:
                    entry.reference = read_rerun(*values)[0]

                self.reads.later(rerun_figures(got, truth, truth_norm), reference)
        self.goto(after)

    def overflows(self) -> None:
        """The op inside each leaf whose isolated re-run turned non-finite while its output fits the
        format (first_overflow.py): one more fp64 forward, where each such leaf's call re-runs the
        candidate's copy op by op on its fp64 inputs, from the RNG state it started at."""
        names, self._overflowing = self._overflowing, set()
        # also a module whose own op (a leaf the user wrote, or a container's outside its submodules)
        # made NaN/Inf while its output stayed finite (x / sqrt(sum(x^2)) with the sum past fp16's
        # range: every output 0; a linear attention's normaliser 1 / (q . sum(k)) past it: 0), searched
        # the same way
        made = {
            name for (name, _), e in self.seen.items()
            if name and e.own is not None and e.own.worst is not None and e.own.worst.overflow
        }  # fmt: skip
        names |= made
        if not names:
            return

        def pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
            entry = self.seen.get((name, index))
            if (
                name in names
                and entry is not None
                and entry.isolated is not None
                and (math.isinf(entry.isolated) or name in made)
            ):
                after = self.mark()
                entry.overflow = self._first_overflow(self.cand_modules[name], name, args, kwargs)
                self.goto(after)

        hooked(self.truth_run, self.run_inputs, torch.float64, pre=pre, post=lambda *a: None, rng=self.rng,
               noise=self.noise, fed=self._fed)  # fmt: skip

    # -- step 2: the candidate pass, reduced to error numbers as it goes ------------------------
    def candidate_pass(self) -> None:
        """The candidate's forward with hooks on every module. Its op outputs are recorded (fp16:
        near_limit.py) only inside the module calls whose fp64 op outputs came near the format's
        max (`near_limit.watched`: the mode is pushed in their pre hook, popped in their post
        hook), and op by op from their inputs afterwards in the calls whose output turned
        non-finite there: the rest of the forward runs under no dispatch mode."""
        self._watch = near_limit.watched(self.truth_ranges.read(), self.cand_dtype) if self.ranges else set()
        self._candidate_once(deferred=True)
        if self._nonfinite_seen:
            # An output turned non-finite: the pass again, each call's figures read as it returns,
            # for where the non-finite values started and the inputs of the calls that made them.
            for entry in self.seen.values():
                entry.propagated = entry.cosine = entry.input_error = entry.candidate = None
                entry.nonfinite, entry.candidate_inputs = 0, 0.0
            self.root_cand = self.root_units = None
            self.notes.pop("candidate run", None)
            if self.ranges:
                self.cand_ranges.clear()
            self._candidate_once(deferred=False)
        # the samples go to the host together: what follows reads them there
        entries = list(self.seen.values())
        kept = [(e, f) for e in entries for f in ("truth", "inputs", "candidate") if getattr(e, f) is not None]
        for (e, f), t in zip(kept, to_host([getattr(e, f) for e, f in kept]), strict=True):
            setattr(e, f, t)

    def _candidate_once(self, *, deferred: bool) -> None:
        """One candidate pass. `deferred`: each call's figures are device values read together at
        the end (`self.reads`); a non-finite output sets `_nonfinite_seen`, for the pass that reads
        as it goes (`_cand_post`) to run instead."""
        self._watching: tuple[str, int] | None = None
        self._made_nonfinite = 0  # calls so far whose output turned non-finite from finite inputs
        self._origins: list[tuple[str, int, Any, Any, int, bool]] = []
        self._nonfinite_seen = False
        self._root_sample: tuple[torch.Tensor, torch.Tensor] | None = None  # an output that is not logits
        self.reads = Reads()
        pre: Any = self._cand_pre
        post: Any = self._cand_post_deferred if deferred else self._cand_post
        if self.ranges:
            pre, post = self.cand_ranges.pre(pre), self.cand_ranges.post(post)
        pre, post = self._watch_pre(pre), self._watch_post(post)
        try:
            hooked(
                self.cand_run, self.run_inputs, self.cand_dtype, pre=pre, post=post, rng=self.rng,
                device=self.cand_device, noise=self.noise, unwind=self._unwatch,
            )  # fmt: skip
        except Exception as exc:  # the candidate failing is a finding, not a usage error
            if (
                self.given and mismatch_error(str(exc)) == "dtype"
            ):  # fed its inputs as given, the model does not cast them
                raise ReferenceFailed(
                    f"the model fed its inputs as given (inputs_as_given) does not cast them itself: its {self.label} "
                    f"run raised {type(exc).__name__}: {str(exc).strip().splitlines()[0]}",
                    "leave --inputs-as-given out (compare casts them), or cast them in the model's forward "
                    "(x.to(p.dtype), p one of its parameters)",
                ) from None
            self.notes["candidate run"] = f"the {self.label} run raised {type(exc).__name__}: {exc}"
            self.cand_failed = exc
        self.reads.read()
        if self._root_sample is not None and not self._nonfinite_seen:
            # an output that is not logits: its error in its own units, on the sample
            self.root_units = in_units(*self._root_sample, self.candidate, row=self._root_row)
            self._units_truth = self._root_sample[0]
        for name, index, args, kwargs, position, watched in self._origins:
            self._origin(name, index, args, kwargs, position=position, watched=watched)
        self._origins.clear()

    def _watch_pre(self, pre: Any) -> Any:
        def on_pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
            pre(name, index, mod, args, kwargs)
            if self._watching is None and (name, index) in self._watch:
                self._watching = (name, index)
                self.cand_ranges.__enter__()

        return on_pre

    def _watch_post(self, post: Any) -> Any:
        def on_post(name: str, index: int, args: Any, output: Any) -> None:
            if self._watching == (name, index):
                self._unwatch()
            post(name, index, args, output)

        return on_post

    def _unwatch(self) -> None:
        if self._watching is not None:
            self._watching = None
            self.cand_ranges.__exit__(None, None, None)

    def _cand_pre(self, name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        position = self.noise.position if self.noise is not None else 0
        self._cand_inputs[(name, index)] = (args, kwargs, self._made_nonfinite, position)

    def _shown(self, name: str, output: Any) -> Any:
        """A call's output as its finiteness is judged: the model's own, where it masks with -inf, with
        its -inf entries 0 (its NaN and +inf count)."""
        if name or not self.root_masked:
            return output
        return map_tensors(output, lambda t: torch.where(torch.isneginf(t), 0.0, t) if t.is_floating_point() else t)

    def _cand_sample(self, name: str, index: int, output: Any) -> tuple[Any, Any, Any, torch.Tensor] | None:
        """A candidate call's fp64 entry, what its pre-hook kept (args, kwargs, ...), its (args,
        kwargs) and its output's sample on the entry's device; None for a call the fp64 pass did not
        see or whose sample does not match (the call's inputs are let go either way)."""
        if name == "" and self.ids:  # the model's ids, judged at the pass's end (_judge_ids)
            ids = _ids_of(output)
            self.root_cand = ids.detach().clone() if ids is not None else None
            self.root_cand_dtype = ids.dtype if ids is not None else None
        entry = self.seen.get((name, index))
        kept = self._cand_inputs.pop((name, index), None)
        c = device_sample(output) if entry is not None else None
        if c is not None and entry is not None and not name and self.root_masked:
            c = unmasked(c, entry.truth)
        if entry is not None and c is not None and c.numel() != entry.truth.numel() and name:
            self.unmatched[name] = None
        if entry is None or c is None or c.numel() != entry.truth.numel():
            return None
        if kept is not None and entry.leaf and self.cand_dtype.is_floating_point:
            bits = torch.finfo(self.cand_dtype).bits
            wide = [t.dtype for t in floating(kept[:2]) if torch.finfo(t.dtype).bits > bits]
            entry.wide_inputs = str(wide[0]).removeprefix("torch.") if wide else None
        return entry, kept, (kept[:2] if kept is not None else None), c.to(entry.truth.device)

    def _cand_post_deferred(self, name: str, index: int, args: Any, output: Any) -> None:
        """_cand_post's figures as device values, read at the pass's end: one wait for the device per
        pass. A non-finite output asks for the pass that reads as it goes (`_nonfinite_seen`)."""
        found = self._cand_sample(name, index, output)
        if found is None:
            return
        entry, _, call, c = found
        biggest = largest(self._shown(name, output))  # non-finite when a value is
        if name == "" and self.root_truth is not None and not self.ids:  # ids: taken by _cand_sample
            first = next(floating(output), None)
            self.root_cand = self._decided(first.detach().clone()) if first is not None else None
            self.root_cand_dtype = first.dtype if first is not None else None
        elif name == "":
            self._root_sample = (entry.truth, c)
            self._root_row = _whole_row(output, c)
        if self.keep_candidate:  # float32 holds every candidate format's values exactly
            entry.candidate = c.to(torch.float32)
        figures: list[torch.Tensor | Later | float | None] = [biggest, diff_later(c, entry.truth), norm_later(c)]
        figures += [dot_later(c, entry.truth), entry.norm]
        if call is not None and entry.inputs is not None:
            c_in = device_sample(call)
            if c_in is not None and c_in.numel() == entry.inputs.numel():
                c_in = c_in.to(entry.inputs.device)
                figures += [largest(call), diff_later(c_in, entry.inputs), norm_later(entry.inputs)]

        def read(biggest: float | None, diff: float, c_norm: float, dot: float, norm: float, *inputs: Any) -> None:
            if biggest is not None and not math.isfinite(biggest):
                self._nonfinite_seen = True
                return
            entry.propagated, entry.cosine = relative(diff, norm), cosine_of(dot, c_norm, norm)
            if inputs:
                in_biggest, in_diff, in_norm = inputs
                finite_in = in_biggest is None or math.isfinite(in_biggest)
                entry.candidate_inputs = relative(in_diff, in_norm) if finite_in else math.inf
                entry.input_error = entry.candidate_inputs

        self.reads.later(figures, read)

    def _cand_post(self, name: str, index: int, args: Any, output: Any) -> None:
        found = self._cand_sample(name, index, output)
        if found is None:
            return
        entry, kept, call, c = found
        finite = all_finite(self._shown(name, output))
        if name == "" and self.root_truth is not None and not self.ids:  # ids: taken by _cand_sample
            first = next(floating(output), None)
            self.root_cand = self._decided(first.detach().clone()) if first is not None else None
            self.root_cand_dtype = first.dtype if first is not None else None
        elif name == "" and finite:  # an output that is not logits: its error in its own units, on the sample
            self.root_units = in_units(entry.truth, c, self.candidate, row=_whole_row(output, c))
            self._units_truth = entry.truth
        if self.keep_candidate:  # float32 holds every candidate format's values exactly
            entry.candidate = c.to(torch.float32)
        entry.propagated = rel_error(c, entry.truth, entry.norm) if finite else math.inf
        entry.cosine = cosine(c, entry.truth, entry.norm) if finite else None
        if not finite:
            entry.nonfinite = sum(int((~torch.isfinite(x)).sum()) for x in floating(self._shown(name, output)))
            if entry.leaf:  # for the jump test: did the non-finite values come in, or start here?
                entry.candidate_inputs = 0.0 if all_finite(args) else math.inf
            if kept is not None and all_finite(call):
                # the innermost call that turned finite inputs non-finite: re-run after the pass, the
                # first such call of each module (the overflows are named per module)
                origin = kept[2] == self._made_nonfinite and name not in {o[0] for o in self._origins}
                if origin and entry.overflow is None and math.isfinite(entry.rounding):
                    inputs = map_tensors(call, lambda t: t.clone())  # the forward may change them in place
                    self._origins.append((name, index, *inputs, kept[3], (name, index) in self._watch))
                self._made_nonfinite += 1
        if call is not None and entry.inputs is not None:
            c_in = device_sample(call)
            if c_in is not None and c_in.numel() == entry.inputs.numel():
                c_in = c_in.to(entry.inputs.device)
                entry.candidate_inputs = rel_error(c_in, entry.inputs) if all_finite(call) else math.inf
                entry.input_error = entry.candidate_inputs

    def _origin(self, name: str, index: int, args: Any, kwargs: Any, *, position: int, watched: bool) -> None:
        """Re-run the candidate's `name` (call `index`, whose output turned non-finite in the
        candidate's pass) on the inputs it got there, op by op: the op that overflows is named
        (first_overflow.py), and, where the pass did not watch it, its ops' ranges are recorded as
        the call's own (a container's submodules' ops under its name)."""
        entry = self.seen[(name, index)]
        ranges = self.cand_ranges if self.ranges and not watched else contextlib.nullcontext()
        if self.ranges and not watched:
            self.cand_ranges.enter(name, index, self.cand_modules[name])
        if self.noise is not None:  # the draws this call made in the pass
            self.noise.position = position
        misaligned = self.noise.misaligned if self.noise is not None else False
        try:
            with ranges, self.noise if self.noise is not None else contextlib.nullcontext():
                entry.overflow = self._first_overflow(self.cand_modules[name], name, args, kwargs)
        finally:
            if self.ranges and not watched:
                self.cand_ranges.leave(name, index)
            if self.noise is not None:  # the reference's re-run draws past the call's: not the forward's
                self.noise.misaligned = misaligned

    # -- step 3: containers re-run whole, where their own ops alone do not say enough --------------
    def judge_containers(self, rows: list[ModuleRow]) -> list[ModuleRow]:
        """A container's own ops were judged op by op in the fp64 pass; one more fp64 pass re-runs a
        container whole where that leaves something open: one whose own op overflows (where, as the
        candidate runs it, for an op-level fix) and the whole model diverging by its own ops while
        no submodule does (its whole error, to weigh against rounding the inputs). So is a leaf that
        turned finite inputs non-finite when its isolated re-run saw only some rows."""
        seen = self.seen
        failed = [f"`{r.module or '<root>'}`: {r.own['failed'][0]}" for r in rows if r.own and r.own["failed"]]
        if failed:  # as a leaf's failed re-run is: the figure is missing or partial, and why
            self.notes["own ops not judged"] = "; ".join(failed[:3]) + (
                f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
            )
        suspects = set()
        # a leaf whose own ops lose nothing run alone, that diverged: its inputs' rounding, amplified? (its
        # weights and buffers stay exact in that run: what their rounding costs is no floor). An fp32 candidate's
        # weights are the fp64 run's values, so any diverged leaf: a readout whose least-squares weights cancel
        # loses in any fp32 computation what the rounding of its inputs costs, its conditioning
        lossless = self.candidate == "fp32"
        conditioned = {
            (r.module, r.call) for r in rows
            if r.leaf and r.diverged and (lossless or (r.own and r.own.get("error_rel") == 0))
            and r.isolated is not None and math.isfinite(r.isolated)
        }  # fmt: skip
        for r in rows:
            entry = seen[(r.module, r.call)]
            if r.leaf:
                subset = entry.isolated_rows is not None
                if _jumped(r, entry) and subset and math.isinf(r.propagated) and not r.diverged:
                    suspects.add((r.module, r.call))
                continue
            overflows = entry.own is not None and entry.own.worst is not None and entry.own.worst.overflow
            alone = r.module == "" and r.diverged and not any(c.diverged for c in children(rows, r.module, r.call))
            if overflows or alone:
                suspects.add((r.module, r.call))
        if not suspects and not conditioned:
            return rows

        def suspect_pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
            if (name, index) in suspects:
                self.isolated(name, args, kwargs, seen[(name, index)], start=self.mark())
            if (name, index) in conditioned:
                self._conditioned(mod, args, kwargs, seen[(name, index)])

        hooked(
            self.truth_run, self.run_inputs, torch.float64, pre=suspect_pre, post=lambda *a: None, rng=self.rng,
            noise=self.noise, fed=self._fed,
        )  # fmt: skip
        self.reads.read()
        self.overflows()
        return _rows(seen, self.own_dtype)

    def _conditioned(self, module: nn.Module, args: Any, kwargs: Any, entry: _Seen) -> None:
        """The exact (fp64) leaf on its inputs rounded to the candidate's format: the error any
        computation of it given those inputs makes (a standardisation of readings near 230 in fp16
        amplifies their rounding ~100 times), its floor (_rows). Run from where the leaf starts, the
        pass goes on from there."""
        start = self.mark()
        try:
            rounded = map_tensors(
                (args, kwargs),
                lambda t: (
                    t.to(self.cand_dtype).to(t.dtype) if t.is_floating_point() and t.dtype == torch.float64 else t
                ),
            )
            with torch.no_grad():
                out = module.forward(*rounded[0], **rounded[1])  # forward, not __call__: no pass hooks
            sample = device_sample(out)
            if sample is not None and sample.numel() == entry.truth.numel() and entry.norm > 0:
                entry.conditioned = float((sample.to(entry.truth.device) - entry.truth).norm()) / entry.norm
        except Exception as exc:  # the figure is ours; the row stands without it
            self.notes.setdefault("inputs' rounding", f"not measured: {type(exc).__name__}: {exc}")
        finally:
            self.goto(start)

    # -- step 4: how much of a whole-model divergence rounding the inputs explains -------------------
    def input_floor(self, rows: list[ModuleRow]) -> float | None:
        # only when the whole model diverges, or its error is far above every part's (an own op's conditioning
        # aside: where it reads inputs rounded to the candidate, a fix of the inputs may take it away)
        if not any(r.module == "" and r.diverged for r in rows) and _unexplained(rows, conditioning=False) is None:
            return None
        kept = _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype)
        if self.given:
            kept = "the inputs are fed as given (--inputs-as-given)"
        if kept is not None:  # rounding the inputs costs nothing: no forward measures it
            self.input_floor_note = f"0: {kept}, so rounding them to {self.label} changes nothing (no forward run)"
            return 0.0
        return self._rounded_inputs_floor()

    def _rounded_inputs_floor(self) -> float | None:
        """_floor_with() on the inputs rounded as the candidate gets them: one reference forward a compare,
        for input_floor and for every forced op's finding."""
        if self._input_floor is None:
            self._input_floor = (self._floor_with(),)
        return self._input_floor[0]

    def _root(self) -> _Seen | None:
        """The model's output as compared (None where it has no floating tensor to measure: ids)."""
        return next((e for (name, _), e in self.seen.items() if name == ""), None)

    def _floor_with(self, rounded: Any = None, keep: list[torch.Tensor] | None = None) -> float | None:
        """The reference's end-to-end error fed the inputs rounded to the candidate's dtype, or as
        `rounded` gives them (some values kept: input_cause.rounded_but); `keep` gets its output."""
        root = self._root()
        if root is None:
            return None
        return input_rounding_error(
            self.ref_run if self.ref_run is not None else self.truth_run,
            self.inputs,
            cand_dtype=self.cand_dtype,
            dtype=self.ref_dtype,
            truth=root.truth,
            norm=root.norm,
            rng=self.rng,
            noise=self.noise,
            rounded=rounded,
            keep=keep,
        )

    def inputs_cause(self, rows: list[ModuleRow], input_floor: float | None) -> dict[str, Any] | None:
        """Where rounding the inputs costs far more than the output's floor: what in them the format
        rounds (input_cause.py: whole numbers past its exact range), with the floor measured without
        rounding those; {} where nothing is found. None where the inputs' rounding costs little."""
        root = rows[-1] if rows else None
        if root is None or input_floor is None or not math.isfinite(input_floor):
            return None
        if input_floor <= DIVERGENCE_RATIO * root.floor:
            return None

        def floor_with(rounded: Any) -> tuple[float | None, torch.Tensor | None]:
            kept: list[torch.Tensor] = []
            return self._floor_with(rounded, kept), kept[-1] if kept else None

        own = "fp64" if self.candidate == "fp32" else "fp32"  # what the inputs stay in before the cast
        found = input_cause.cause(self.inputs, self.cand_dtype, self.candidate, floor_with, own)
        output = found.pop("output", None) if found else None
        if _unexplained(rows) is None and not any(r.module == "" and r.diverged for r in rows):
            # an own op's conditioning at rounded inputs explains the error: said only where a fix of the inputs
            # was found and takes it away (else it is what any computation in the candidate's format loses)
            after = (found or {}).get("floor_without")
            if after is None or after * INPUT_FIX_FALLS >= input_floor:
                return None
        if found and output is not None:
            self.input_fix = (found, output)
        return found or {}

    # -- step 5: an error no part makes alone: the running state that accumulates it ---------------
    def accumulation(self, rows: list[ModuleRow], input_floor: float | None) -> dict[str, Any] | None:
        """Where no module diverges, yet the end-to-end error is DIVERGENCE_RATIO times above all that
        explains it by itself (each module's and own op's isolated error, the output's floor,
        rounding the inputs): the running states of the candidate's forward, tried by one candidate
        run with all of them kept in fp64 together (each state alone only where that run fails). The
        search's own forward is that run where the states it kept in fp64 as it found them are the
        ones tried (passes.carried_and_raised). None when the error is explained."""
        explained = _unexplained(rows)
        root = rows[-1] if rows else None
        # an output lost in its units (units.py: its error a large share of what it varies by) where no part
        # explains it, short of DIVERGENCE_RATIO: the states are tried too (a rollout of 500 steps loses as
        # one of 3000 does, only less), rather than a finding that says no more than "it builds up"
        lost = self.root_units is not None and self.root_units.lost and self.logits is None
        if explained is None and lost and rows and math.isfinite(rows[-1].propagated):
            parts = _explained(rows)  # an op's conditioning included: rounding a timestamp explains its sin
            explained = parts if rows[-1].propagated > LOST_UNEXPLAINED * parts else None
        # or a module of the model leaves what explains it inside (a loop in its own forward: a scan over 512
        # steps, 7.5x, 40x its floor), the output diluted: the states are searched, and said only where one is
        # checked to explain it (an MoE's routed experts leave it too, with no state)
        inside = _unexplained_inside(rows, INSIDE_OPENS) if explained is None else None
        explained = explained if inside is None else inside
        if explained is None or root is None or any(r.diverged for r in rows):
            return None
        if self.ids:  # ids a decoding loop fed back: one flipped choice changes every later one, no rounding adds up
            return None
        explained = max(explained, input_floor or 0.0)
        by_lost = root.propagated <= DIVERGENCE_RATIO * explained and inside is None  # opened by the lost output alone
        if by_lost and not lost:
            return None
        quiet = by_lost or inside is not None  # said only where a state is checked to explain it
        truth = next(e for (name, _), e in self.seen.items() if name == root.module)
        # A forward of its own, where it is needed (a search on every candidate pass costs a model of
        # many small calls, a loop over tokens, more than this one forward where it runs), which is
        # also the joint check below where the lines it kept in fp64 are the states tried.
        kept: list[torch.Tensor] = []
        searched: tuple[set[str], float | None] | None = None
        try:
            states, lines, figure = carried_and_raised(
                self.cand_run, self.run_inputs, self.cand_dtype, truth=truth.truth, norm=truth.norm, rng=self.rng,
                device=self.cand_device, noise=self.noise, keep=kept,
            )  # fmt: skip
            searched = (lines, figure)
        except Exception:  # the raise may be what failed: the search alone, then each check on its own
            try:
                states = carried_states(
                    self.cand_run, self.run_inputs, self.cand_dtype, rng=self.rng, device=self.cand_device,
                    noise=self.noise,
                )  # fmt: skip
            except Exception as exc:  # the search is ours; the finding stands without it
                self.notes["running states"] = f"not searched: {type(exc).__name__}: {exc}"
                states = []
        sites = {id(state): state.pop("sites") for state in states}
        for state in states:  # raised_rel: its own run's figure, where it was tried alone
            state |= {"raised_rel": None, "tried_alone": False, "tried_together": False}
        # an in-place update keeps its tensor's dtype: raising it needs the user's code changed; a
        # state updated by ops that never round (a running max) loses nothing to raise
        tryable = [s for s in states if not s["in_place"] and not s["exact"]]

        def error_with(raised: list[dict[str, Any]], keep: list[torch.Tensor]) -> float | None:
            return raised_error(
                self.cand_run, self.run_inputs, self.cand_dtype, [x for s in raised for x in sites[id(s)]],
                truth=truth.truth, norm=truth.norm, rng=self.rng, device=self.cand_device, noise=self.noise, keep=keep,
            )  # fmt: skip

        # One checked run with every state that rounds kept in fp64 together. States updated in one
        # loop each lose in proportion to its length: one that gains nothing alone at this length is
        # needed at a longer one (a sum and the normaliser it is divided by), so they are one fix.
        # When together they do not take the error away, no subset does: each is then run alone, so
        # that the one whose raise fails is named.
        falls = root.propagated / ACCUMULATION_FALLS
        if searched is not None and tryable and searched[0] == {s["location"] for s in tryable}:
            joint = searched[1]  # the search's own run kept exactly these states in fp64
        else:
            kept = []
            joint = error_with(tryable, kept) if tryable else None
        cause = together = None
        if joint is not None:
            for s in tryable:
                s["tried_together"] = True
            if len(tryable) == 1:  # the joint run is the state's run alone
                tryable[0] |= {"raised_rel": joint, "tried_alone": True}
            if joint <= falls and len(tryable) == 1:
                cause = tryable[0]
                if kept:
                    self.state_fix = ([cause["location"]], kept[-1], [])
            elif joint <= falls:
                together = {"states": tryable, "raised_rel": joint}
                if kept:
                    self.state_fix = ([s["location"] for s in tryable], kept[-1], [])
        elif len(tryable) > 1:  # the joint run failed: each alone, so that the one whose raise fails is named
            outputs: dict[int, list[torch.Tensor]] = {}
            for s in tryable:
                outputs[id(s)] = []
                s["raised_rel"] = error_with([s], outputs[id(s)])
                s["tried_alone"] = s["raised_rel"] is not None
            best = min((s for s in tryable if s["tried_alone"]), key=lambda s: s["raised_rel"], default=None)
            if best is not None and best["raised_rel"] <= falls and outputs[id(best)]:
                cause = best
                self.state_fix = ([best["location"]], outputs[id(best)][-1], [])
        if cause is None and together is None and tryable and joint is not None:
            # each step's update reads values the candidate makes again every step (a decay exp(dt * A) near
            # 1 that rounds to 1 in bf16): the states with the lines that make what their updates read
            try:
                together = self._with_their_feeds(tryable, sites, falls, truth)
            except Exception as exc:  # the search is ours; the finding stands without it
                self.notes["lines the states read"] = f"not searched: {type(exc).__name__}: {exc}"
        if quiet and cause is None and together is None:  # no state explains it: the other causes are tried
            self.state_fix = None
            return None
        return {
            "together": together,
            "joint_rel": joint if len(tryable) > 1 else None,  # every tried state kept in fp64 together
            "inputs": inputs_text(describe(self.inputs)),
            "error_rel": root.propagated,
            "explained_rel": explained,
            "input_floor_rel": input_floor,
            "input_floor_note": self.input_floor_note,
            "states": states,
            "state": cause,
            "dtype": str(self.cand_dtype).removeprefix("torch."),
        }

    def _with_their_feeds(
        self, states: list[dict[str, Any]], sites: dict[int, list[Any]], falls: float, truth: _Seen
    ) -> dict[str, Any] | None:
        """The running states kept in fp64 with the lines that make what their updates read (upstream.
        feeding_lines of each update's first op), where those are a few lines of the states' own code:
        `together` with the feeding lines, where that run takes the error down ACCUMULATION_FALLS."""
        own = [x for s in states for x in sites[id(s)]]
        fed: set[tuple[str, int]] = set()
        for state in states:
            lines, _, _ = upstream.feeding_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, op=state["op"].split(" then ")[0],
                line=state["location"], module=state["module"] or "", rng=self.rng, device=self.cand_device,
                noise=self.noise,
            )  # fmt: skip
            fed |= set(lines)
        updated = {nonfinite.line_of(s["location"]) for s in states}
        feeding = sorted(fed - updated)
        if not feeding or len(feeding) > FEEDING_LINES:  # none, or most of the model: no fix of a few lines
            return None

        def error_with(lines: list[tuple[str, int]], kept: list[torch.Tensor]) -> float | None:
            # the states in fp64 as before; the feeding lines' ops in fp32 and kept so (no cast back: a decay
            # cast back to bf16 is 1 again) for the updates that read them
            return error_under(
                RaisedSites(own, self.cand_dtype), self.cand_run, self.run_inputs, self.cand_dtype, truth=truth.truth,
                norm=truth.norm, rng=self.rng, device=self.cand_device, noise=self.noise, keep=kept,
                watch=RaisedLines(set(lines), self.cand_dtype, cast_back=False),
            )  # fmt: skip

        # the nearest lines first (what the update reads most directly: its decay), one more at a time: the
        # fewest lines that hold; a line further up (a module's input projection in fp32) can fail the run
        nearest = sorted(feeding, key=lambda x: (x[0] != states[0]["location"].rpartition(":")[0], -x[1]))
        error: float | None = None
        kept: list[torch.Tensor] = []
        for k in range(1, len(nearest) + 1):
            kept = []
            error = error_with(nearest[:k], kept)
            if error is not None and error <= falls:
                feeding = sorted(nearest[:k])
                break
        else:
            return None
        if kept:
            self.state_fix = ([s["location"] for s in states], kept[-1], feeding)
        return {"states": states, "raised_rel": error, "feeding": feeding}

    # -- step 5d: the model's own code around its submodules (own_code.py) -----------------------------
    def own_code(self, rows: list[ModuleRow]) -> Finding | None:
        """Where nothing diverged (so no line's check confirmed the model's worst own op), though that
        op leaves its floor DIVERGENCE_RATIO times and the end-to-end error is RAISED_FALLS above its
        own floor: the model's own ops all in fp32, its submodules as the candidate runs them (one
        forward, _output_with_own_fp32). A finding where that divides the error by OWN_FALLS."""
        root = rows[-1] if rows else None
        if root is None or root.module != "" or root.own is None or any(r.diverged for r in rows):
            return None
        if root.leaf or not root.exceeds or root.unconfirmed is None:
            return None
        subs = own_code.submodules(self.model)
        if self.cand_dtype not in (torch.float16, torch.bfloat16) or not subs:
            return None  # an fp32 candidate's own ops are fp32 already; without submodules all is own code
        if not math.isfinite(root.propagated) or root.propagated <= RAISED_FALLS * root.floor:
            return None
        entry = self._root()
        if entry is None:
            return None
        errors: list[str] = []
        sample = device_sample(self._output_with_own_fp32(errors))
        after = (
            rel_error(sample.to(entry.truth.device), entry.truth, entry.norm)
            if sample is not None and sample.numel() == entry.truth.numel()
            else None
        )
        if after is None or not after * own_code.OWN_FALLS <= root.propagated:
            self.notes["the model's own ops in fp32"] = own_code.reason(root.propagated, after, errors)
            return None
        return own_code.finding(
            self.model, subs, fmt=self.label, dtype=str(self.cand_dtype), before=root.propagated, after=after,
            floor=root.floor, op=root.own["op"], location=root.own.get("location"), ratio=root.ratio or math.inf,
            came=entry.candidate_inputs, on=inputs_text(describe(self.inputs)),
        )  # fmt: skip

    # -- step 5c: a selection inside the model the candidate changes (selections.py) -------------------
    def selection(self, rows: list[ModuleRow], accumulation: dict[str, Any] | None) -> Finding | None:
        """Where the error is left unexplained (no part adds near as much by itself, no running state
        its cause): the candidate's first selection that picks other elements than fp64, with the lines
        in fp32 that give its picks back, checked. Two forwards; where one changed, two more (the floor
        model's picks, the candidate's with the lines that made each) and one per line set tried."""
        # an error DIVERGENCE_RATIO above what every part adds by itself (a part that diverges included),
        # even where rounding the inputs would explain it (a threshold that flips on them); never where a
        # running state is the cause
        unexplained = accumulation is None or (accumulation["state"] is None and accumulation["together"] is None)
        root = self._root()
        if not unexplained or root is None or not rows:
            return None
        # or where nothing diverged and a leaf got other non-floating inputs (an embedding fed other buckets): a
        # divergence upstream would explain a leaf far off as well
        # or where module calls got other rows than in fp64 (an expert fed the tokens a router picked)
        fed = not any(r.diverged for r in rows) and (
            bool(self.unmatched) or any(_fed_otherwise(r, self.seen[(r.module, r.call)]) for r in rows)
        )
        # or where the entries a masked output keeps (a sampler's top-p set) differ: a comparison decided them,
        # row by row (a few of each row's values: the rows count)
        sets = self._kept_sets()
        # the comparisons that make a mask over the output's classes: their width is the output's last dim
        by_rows = self.root_truth.shape[-1] if sets is not None and sets.differs and self.root_truth is not None else 0
        if _unexplained(rows) is None and not fed and not by_rows:
            return None
        if self.cand_dtype not in (torch.float16, torch.bfloat16):
            return None
        try:
            truth = self._picks(self.truth_run, torch.float64).picks
            cand = self._picks(self.cand_run, self.cand_dtype).picks
            if selections.first_changed(cand, truth, None, by_rows=by_rows) is None:
                return None
            # one changed: the floor model's picks, and the candidate's again with the lines that made each
            floor = self._picks(self.ref_run, self.ref_dtype).picks if self.ref_run is not None else None
            made = self._picks(self.cand_run, self.cand_dtype, upstream=True, device=self.cand_device)
            found = selections.first_changed(made.picks, truth, floor, by_rows=by_rows)
            if found is None:
                return None
            key, changed = found
            changed.modules, changed.on_indices = made.modules, made.on_indices
            changed.error_before = rows[-1].propagated

            outputs: dict[tuple[frozenset[tuple[str, int]], bool], torch.Tensor] = {}

            def check(lines: set[tuple[str, int]], given: bool) -> tuple[float | None, dict[Any, selections.Pick]]:
                picks = selections.Picks()
                kept: list[torch.Tensor] = []
                error = error_under(
                    RaisedLines(lines, self.cand_dtype, wide_inputs=given), self.cand_run, self.run_inputs,
                    torch.float32 if given else self.cand_dtype, truth=root.truth, norm=root.norm, rng=self.rng,
                    device=self.cand_device, noise=self.noise, watch=picks, keep=kept,
                )  # fmt: skip
                if kept:  # the run's output, for what it decides (_checked_fixes)
                    outputs[(frozenset(lines), given)] = kept[-1]
                return error, picks.picks

            rounded = not self.given and _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is None
            selections.checked(key, changed, truth, check, rounded_inputs=rounded)
        except Exception as exc:  # the search is ours: the rest of the report stands without it
            self.notes["selections"] = f"not searched: {type(exc).__name__}: {exc}"
            return None
        named = selections.finding(changed, label=self.label, dtype=self.cand_dtype, reference=self.reference)
        if changed.lines is not None and not changed.partial:
            output = outputs.get((frozenset(changed.lines), bool(changed.given)))
            self.selection_fix = (named, output) if output is not None else None
        return named

    def _picks(
        self, run: nn.Module, dtype: torch.dtype, *, upstream: bool = False, device: torch.device | None = None
    ) -> selections.Picks:
        """What every selecting op of one forward of `run` picks (selections.Picks); `upstream`: and
        the lines that made what each ranks, and the module each line calls."""
        picks = selections.Picks(upstream=upstream)
        fed = self.inputs if run is self.ref_run else self.run_inputs

        def pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
            picks.stack.append(name)
            if name == "":
                picks.start()
            elif upstream:  # the line that calls it: a fix there names the module, and what it is called on
                first = args[0] if args else None
                picks.called(name, mod, indices=isinstance(first, torch.Tensor) and not first.is_floating_point())

        def post(name: str, index: int, args: Any, output: Any) -> None:
            if picks.stack:
                picks.stack.pop()

        with picks:
            hooked(run, fed, dtype, pre=pre, post=post, rng=self.rng, device=device, noise=self.noise)
        return picks

    # -- step 5b: an op whose inputs' precision forces its error: where they are made, and the check ---
    def forced(self, rows: list[ModuleRow]) -> dict[str, dict[str, Any]]:
        """Per divergent container whose worst own op is as wrong run exactly on its inputs rounded to
        the candidate's dtype (upstream.py): the lines that make those inputs, and the end-to-end error
        with them in fp32. Only the first such container: one more forward for the lines, one for the check.

        Where none diverges, a container whose worst own op is forced and leaves its floor, but whose
        output error grew less than DIVERGENCE_RATIO over what came in (`_unconfirmed`), is decided by
        the same check when the end-to-end error is RAISED_FALLS above its floor: a cancellation
        (log(1 - exp(-h)) at small h) makes a 10x error that no growth threshold tells from a deep
        model's, and the check does. Confirmed, the container diverges; else it stays as it was."""
        if self._root() is None:  # no floating output to measure a check's error on (ids)
            return {}
        row = next((r for r in rows if r.diverged and _forced(r)), None)
        final = rows[-1] if rows else None
        if row is None and final is not None and final.propagated > RAISED_FALLS * final.floor:
            row = next((r for r in rows if _borderline(r, self.seen[(r.module, r.call)]) and _forced(r)), None)
        # (an output past the format's range has its own finding: its ops' result returned in fp32)
        unforced = row is None and final is not None and _own_diverged(rows) and not final.out_of_range
        if unforced:
            # the whole model's own ops diverge, no submodule does, and its worst op is no amplifier: no module
            # to keep in fp32, so the lines that make what it reads are the fix, checked the same way
            row = final
        if row is None or row.own is None or self.cand_dtype not in (torch.float16, torch.bfloat16):
            return {}
        if unforced:  # said only where its check cures: else the finding stands as it was (a stable form, plan)
            found = self._forced_at(rows, row, unforced=True)
            raised = found.get("raised_rel")
            fixed = bool(found.get("lines") or found.get("buffers"))
            cured = raised is not None and _cured(found["error_rel"], raised)
            return {row.module: found | {"unforced": True}} if fixed and cured else {}
        if not row.diverged:
            found = self._forced_at(rows, row)
            raised = found.get("raised_rel")
            if raised is None or not _confirmed(found["error_rel"], raised, final.floor if final else 0.0):
                return {}
            row.unconfirmed = None
            annotate(rows)
            return {row.module: found}
        return {row.module: self._forced_at(rows, row)}

    def _with_other_lines(
        self, row: ModuleRow, lines: list[tuple[str, int]], raised: float | None, final: float,
        check: Callable[[list[tuple[str, int]]], float | None],
    ) -> tuple[list[tuple[str, int]], float | None]:  # fmt: skip
        """`lines` (the worst own op's feeding lines, `raised`: the end-to-end error with them in fp32)
        with the feeding lines of the module's other own ops that leave their floor (`own["others"]`,
        worst first) added one at a time, each kept where the error falls to KEPT_FALL of what it was or
        less; where that leaves the error uncured (against `final`, the end-to-end error), all of them
        held together is checked too (lines that help only together)."""
        best = raised if raised is not None else final
        kept = list(lines)
        tried: list[tuple[str, int]] = list(lines)
        for other in (row.own or {}).get("others") or []:
            more, _, _ = upstream.feeding_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, op=other["op"], line=other["location"] or "",
                module=row.module, rng=self.rng, device=self.cand_device, noise=self.noise,
            )  # fmt: skip
            fresh = [line for line in more if line not in tried]
            if not fresh:
                continue
            tried = sorted({*tried, *fresh})
            got = check(sorted({*kept, *fresh}))
            if got is not None and got <= KEPT_FALL * best:
                kept, best = sorted({*kept, *fresh}), got
            if _cured(final, best):
                break
        if not _cured(final, best) and tried != kept:
            together = check(tried)
            if together is not None and together <= KEPT_FALL * best:
                kept, best = tried, together
        return (kept, best) if kept != lines else (lines, raised)

    def _forced_at(self, rows: list[ModuleRow], row: ModuleRow, unforced: bool = False) -> dict[str, Any]:
        """forced() for `row`: the lines that make its worst op's inputs, and the end-to-end error
        with them in fp32 (`raised_rel`, None where not measured)."""
        assert row.own is not None
        own = row.own
        root = self._root()
        assert root is not None  # forced() asks only where the output was measured
        cause: dict[str, Any] = {"op": own["op"], "conditioned_rel": own["conditioned_rel"]}
        try:
            lines, read, elsewhere = upstream.feeding_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, op=own["op"], line=own["location"] or "",
                module=row.module, rng=self.rng, device=self.cand_device, noise=self.noise,
            )  # fmt: skip
            # the buffers and parameters it reads that the candidate's cast rounded: the user's own
            # values, kept in fp32 (a centring's offset, learned or not)
            user = dict(self.model.named_buffers()) | dict(self.model.named_parameters())

            def rounded(names: list[str]) -> dict[str, torch.Tensor]:
                return {
                    n: user[n] for n in names
                    if n in user and torch.finfo(user[n].dtype).bits > 16 and _rounded_by(user[n], self.cand_dtype)
                }  # fmt: skip

            buffers = rounded(read)
            final = rows[-1]

            outputs: list[torch.Tensor] = []  # the checked run's output, for what it decides
            entry = self.seen[(row.module, row.call)]
            mine: list[float] = []  # the divergent module's own output error in the checked run

            def each(name: str, index: int, output: Any) -> None:
                if name == row.module and index == row.call:
                    sample = device_sample(output)
                    if sample is not None and sample.numel() == entry.truth.numel():
                        mine.append(rel_error(sample.to(entry.truth.device), entry.truth, entry.norm))

            def raised_with(
                lines: list[tuple[str, int]], buffers: dict[str, torch.Tensor], given: bool = False,
                carried: list[tuple[str, int]] | None = None, wide: bool | None = None,
            ) -> float | None:  # fmt: skip
                outputs.clear()
                mine.clear()
                return upstream.raised_error(
                    self.cand_run, self.run_inputs, self.cand_dtype, lines, truth=root.truth, norm=root.norm,
                    rng=self.rng, device=self.cand_device, noise=self.noise, buffers=buffers, keep=outputs,
                    inputs_as_given=given, each=each, carried=carried,
                    cast_back=not (cause.get("kept_wide") if wide is None else wide),
                )  # fmt: skip

            # a rounded buffer alone first: when holding it in fp32 is the whole fix, the lines are not part of it
            raised = raised_with([], buffers) if buffers else None
            if raised is not None and _cured(final.propagated, raised):
                lines = []
            elif lines or buffers:
                raised = raised_with(lines, buffers)
                if raised is None and lines and buffers:
                    # held in fp32 they break the run (a weight the code reads its dtype from, p.dtype, for
                    # the casts back): the lines alone
                    raised = raised_with(lines, {})
                    buffers = {} if raised is not None else buffers
            more = rounded(elsewhere)
            if (lines or buffers) and more and (raised is None or not _cured(final.propagated, raised)):
                # not enough: the module's other ops read rounded buffers too (a table centred beside the
                # input); all of them held, alone first, as above
                for tried in ([], lines) if lines else ([],):
                    wider = raised_with(tried, buffers | more)
                    if wider is not None and (raised is None or _cured(raised, wider)):
                        lines, raised, buffers = tried, wider, buffers | more
                        break
            rounds_inputs = not self.given and _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is None
            if lines and rounds_inputs and (raised is None or not _cured(final.propagated, raised)):
                # what the lines read may be the model's inputs, which the cast rounds before the forward
                # (raw readings standardised inside the model): the lines computed on the inputs as given
                given = raised_with(lines, buffers, given=True)
                if given is not None and _cured(final.propagated, given):
                    raised = given
                    cause["inputs_as_given"] = True
            if raised is None or not _cured(final.propagated, raised):
                # not enough: what it reads is a submodule's output (two large scores of one head subtracted),
                # which the lines that call those modules make: their ops in fp32 too
                called, _, _ = upstream.feeding_lines(
                    self.cand_run, self.run_inputs, self.cand_dtype, op=own["op"], line=own["location"] or "",
                    module=row.module, rng=self.rng, device=self.cand_device, noise=self.noise, through_calls=True,
                )  # fmt: skip
                through = raised_with(called, buffers) if set(called) > set(lines) else None
                if through is not None and _cured(final.propagated, through):
                    lines, raised = called, through
            if lines and (raised is None or not _cured(final.propagated, raised)):
                # not enough: another line of the module's own diverges beside the worst's (a window's two
                # running sums, each subtracted on its own line): each one's feeding lines added in turn,
                # kept where it helps, until the error is cured (greedy, then all of them together)
                found = self._with_other_lines(
                    row, lines, raised, final.propagated, lambda more: raised_with(more, buffers)
                )
                if rounds_inputs and (found[1] is None or not _cured(final.propagated, found[1])):
                    # each line alone was tried on the inputs as given above: together they may need them too
                    # (a sin and a cos of 2^k x on two lines, both reading the rounded coordinates)
                    wide = self._with_other_lines(
                        row, lines, None, final.propagated, lambda more: raised_with(more, buffers, given=True)
                    )
                    if wide[1] is not None and _cured(final.propagated, wide[1]):
                        found, cause["inputs_as_given"] = wide, True
                lines, raised = found
            if lines and (raised is None or not _cured(final.propagated, raised)):
                # not enough: what the module reads is handed to it from module to module, rounded where it is
                # stored between them (a residual stream at an offset of 40 in fp16, which every norm centres):
                # the lines that make what the divergent modules are passed, their results kept in fp32 from
                # module to module (a layer with weights reads them cast), the inputs fed in fp32 where the cast
                # rounds them
                readers = {r.module for r in rows if r.diverged and _forced(r)} | {row.module}
                stream = upstream.input_lines(
                    self.cand_run, self.run_inputs, self.cand_dtype, readers, rng=self.rng, device=self.cand_device,
                    noise=self.noise,
                )  # fmt: skip
                passed = sorted({*lines, *stream})
                # the buffers the lines read held as they were too, and the inputs fed in fp32 (where the cast
                # rounds them), each only where the stream alone is not enough
                tries = [(held, given) for given in ((False, True) if rounds_inputs else (False,))
                         for held in (({}, buffers) if buffers else ({},))]  # fmt: skip
                for held, given in tries if stream else []:
                    carried = raised_with(passed, held, given=given, carried=stream)
                    if carried is not None and _cured(final.propagated, carried):
                        lines, raised, buffers, cause["carried"] = passed, carried, held, stream
                        cause["inputs_as_given"] = given or None
                        break
            far = (
                raised is None
                or not _cured(final.propagated, raised)
                or (unforced and raised > RAISED_FALLS * final.floor)
            )
            if lines and far:
                # not enough (for the whole model's own ops: or far from the floor still): what the lines make is
                # rounded again where it is cast back (a histogram's counts past bf16's 256, a CDF near 1 that
                # bf16 holds to 0.004): kept in fp32 for what reads it, with every rounded buffer the module reads
                # held (a quantile of 0.999 that bf16 makes 1); the fix where it cures, or takes a cure
                # RAISED_FALLS further
                held = buffers | rounded(elsewhere)
                for given in (False, True) if rounds_inputs else (False,):
                    unrounded = raised_with(lines, held, given=given, wide=True, carried=cause.get("carried"))
                    if unrounded is not None and _cured(raised if raised is not None else final.propagated, unrounded):
                        raised, buffers, cause["kept_wide"] = unrounded, held, True
                        cause["inputs_as_given"] = cause.get("inputs_as_given") or given or None
                        break
            if lines and raised is not None and _cured(final.propagated, raised):
                # the lines after them, which read what they make (x - mean after a variance by hand): a fix
                # that cast the mean back before them cured the NaN and left the cancellation
                given, carry = bool(cause.get("inputs_as_given")), cause.get("carried")
                lines, raised = self._lines_after(
                    lines, raised, outputs, lambda more: raised_with(more, buffers, given=given, carried=carry)
                )
                if rounds_inputs and not given and row.leaf:
                    # a leaf's lines are its whole computation: what is left after them may be its inputs'
                    # rounding (readings standardised by hand), the model's inputs fed in fp32 to them
                    kept = list(outputs)
                    wide = self._lines_after(
                        lines, math.inf, outputs, lambda more: raised_with(more, buffers, given=True), first=True
                    )
                    if _cured(raised, wide[1]):
                        (lines, raised), cause["inputs_as_given"] = wide, True
                    else:
                        outputs[:] = kept
            if raised is not None and (lines or buffers):
                # the output of the run the finding prints, for what it decides: tries that were not kept ran
                # after it, so it is run once more as printed (the same figure: the runs are deterministic)
                raised_with(lines, buffers, given=bool(cause.get("inputs_as_given")), carried=cause.get("carried"))
            if rounds_inputs and row.diverged and (raised is None or not _cured(final.propagated, raised)):
                # no line's fix cures it: the op may amplify the model's own inputs' rounding (features near 40
                # held to fp16's 0.031, centred by a norm), which nothing inside the model undoes once the cast
                # has rounded them: the reference fed the rounded inputs says how much of the error that is
                cause["input_floor_rel"] = self._rounded_inputs_floor()
        except Exception as exc:  # the search is ours; the finding stands without it
            self.notes["upstream of the worst op"] = f"not searched: {type(exc).__name__}: {exc}"
            return cause | {"raised_rel": None, "error_rel": rows[-1].propagated}
        if raised is not None and outputs:
            self.line_fix = outputs[-1]
        learned = sorted(n for n in buffers if isinstance(user[n], nn.Parameter))
        return cause | {
            "lines": lines, "buffers": sorted(buffers), "parameters": learned, "raised_rel": raised,
            "error_rel": final.propagated, "floor_rel": final.floor,
            # the module's own output in the run as printed, beside its error before and its floor: a fix
            # that leaves the module within its floor is the fix, however much of the end-to-end error the
            # rest of the model makes
            "module": row.module, "module_rel": row.propagated, "module_floor_rel": row.floor,
            "module_raised_rel": mine[-1] if raised is not None and (lines or buffers) and mine else None,
            # the modules those lines call, as the fix names them: a container's layers each, as the check ran them
            "called": [
                f"`{m}`" + (" (each of its layers)" if self._container(m) else "") for m in self._called_modules(lines)
            ],
        }  # fmt: skip

    # -- step 6: the result and its report ----------------------------------------------------------
    def result(
        self,
        rows: list[ModuleRow],
        input_floor: float | None,
        prefix: str | None,
        accumulation: dict[str, Any] | None = None,
        forced: dict[str, dict[str, Any]] | None = None,
        *,
        inputs_cause: dict[str, Any] | None = None,
        selection: Finding | None = None,
        own: Finding | None = None,
    ) -> CompareResult:
        candidate = self.candidate
        fmt = candidate_format(candidate)
        misfit = misfits(self.model, fmt, skip=(str(self.cand_dtype),)) if fmt is not None else []
        overflows = {key: e.overflow for key, e in self.seen.items() if e.overflow is not None}
        if prefix:  # a submodule compared on its own: names as in the whole model
            overflows = {(f"{prefix}.{n}" if n else prefix, c): v for (n, c), v in overflows.items()}
            for entry in misfit:
                entry["module"] = f"{prefix}.{entry['module']}" if entry["module"] else prefix
                entry["tensor"] = f"{prefix}.{entry['tensor']}"
            for row in rows:
                row.module = f"{prefix}.{row.module}" if row.module else prefix
            for fp8_row in self.fp8_rows:
                fp8_row["module"] = f"{prefix}.{fp8_row['module']}"
        # an output turned non-finite: the op that made it (NUM001), unless a divergence finding names it
        limit = fmt.max if fmt is not None else torch.finfo(self.cand_dtype).max
        mine = nonfinite.handled(rows, overflows, limit)
        # the op a divergence finding names (profile.causes: a divergent module's first call): its fix,
        # checked; a few forwards each, so for the first CHECKED_OVERFLOWS such modules
        divergent: dict[str, tuple[str, int]] = {}
        for r in rows:
            if r.diverged and r.module and (r.module, r.call) in overflows and (r.module, r.call) not in mine:
                divergent.setdefault(r.module, (r.module, r.call))
        for key in list(divergent.values())[:CHECKED_OVERFLOWS]:
            if not nonfinite.is_cast(overflows[key]["op"]):
                row = next(r for r in rows if (r.module, r.call) == key)
                overflows[key]["checked"] = self._overflow_checked(
                    overflows[key], rows[-1].propagated, broken=not row.propagated < BROKEN
                )
                if overflows[key]["checked"] is None:  # no line set cures it: its ops overflow on several lines
                    overflows[key]["module_checked"] = self._module_checked(row, rows[-1].propagated)
        origin = nonfinite.findings(
            rows, overflows, label=self.label, candidate=candidate, dtype=self.cand_dtype, check=self._fix_checked,
            before_cast=self._before_cast_checked, on=inputs_text(describe(self.inputs)),
            named=any(r.diverged for r in rows), mine=mine,
            flushed=[describe_misfit(e) for e in misfit if "flush" in e],
        )  # fmt: skip
        if self.unmatched:  # their rows differ: no error to measure (a selection before them picked others)
            names = list(self.unmatched)
            listed = ", ".join(f"`{prefix}.{n}`" if prefix else f"`{n}`" for n in names[:4])
            self.notes["module calls not compared"] = (
                f"{listed}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: in {self.label} they were "
                "called on inputs of other shapes than in fp64 (rows picked by a selection before them, a "
                "router's top-k), so their outputs have no fp64 counterpart"
            )
        if self.noise is not None and self.noise.misaligned:
            self.notes["random draws"] = (
                "the runs drew random tensors of other shapes: those errors include different noise"
            )
        result = build_report(
            rows,
            candidate=candidate,
            device=self.cand_device,
            on=self.on,
            reference=self.reference,
            notes=self.notes,
            input_floor=input_floor,
            causes=causes(rows, {k: v for k, v in overflows.items() if k not in mine}, misfit, candidate)
            | forced_causes(forced or {}, candidate),
            accumulation=accumulation,
            inputs_cause=inputs_cause,
            # the samples stay until the end, so their total is the peak of what compare itself keeps
            peak=sum(e.truth.nbytes + (0 if e.inputs is None else e.inputs.nbytes) for e in self.seen.values()),
        )
        if origin:  # one cause, one finding: a divergence finding of the same op at the same line says no more
            named = (origin[0].where.get("op"), origin[0].evidence.get("location"))
            result.report.findings[:] = [
                f for f in result.report.findings
                if f.name != "precision-divergence" or (f.where.get("op"), f.evidence.get("own_op_location")) != named
            ]  # fmt: skip
        result.report.findings[:0] = [self._finite_but_far(f, rows) for f in origin]
        self._kept_checked(result.report.findings, rows)
        made = self._made_checked(rows, forced or {}) or self._buffers_checked(rows, result.report.findings)
        if made is not None:  # checked to take most of the error away: the cause, before what it makes
            # an error "made by accumulation" is what compare concludes when no part explains it: this does;
            # a divergence whose own fix was not found to help is what these values do downstream
            findings = result.report.findings
            findings[:] = [made, *(f for f in findings if not _explained_by_made(f))]
            summary = result.report.data["summary"]
            for i, (label, text) in enumerate(summary):
                if label == "first divergent module" and "accumulation" in text:  # what compare found instead
                    line = str(made.evidence.get("location", "")).rpartition(":")[2]
                    said = (
                        f"buffers of whole numbers the model's cast rounds, read at line {line}"
                        if made.evidence.get("buffers")
                        else f"values line {line} makes in the model's dtype, rounded"
                    )
                    summary[i] = (label, f"none by itself: {said}")
        elif self.made:
            result.report.findings[:] = made_in_dtype.told(result.report.findings, self.made, self.cand_dtype)
        if selection is not None:  # the cause of an error nothing else explained: first
            fixed = selection.trial is not None and selection.trial.tried
            findings = result.report.findings
            at = selection.evidence["location"]
            # the lines its checked fix computes in fp32 (the scores and the selection): an op among them
            # named by its isolated error is the same cause, said once
            file = at.rpartition(":")[0]
            fixed_lines = {at, *(f"{file}:{n}" for n in selection.evidence.get("lines_raised") or [])}
            rest = [
                f for f in findings
                if not (fixed and f.evidence.get("kind") == "accumulation")
                and not (fixed and str(f.evidence.get("own_op_location", "")).split(" in ")[0] in fixed_lines)
            ]  # fmt: skip
            dropped = fixed and any(f.name == "precision-divergence" and f not in rest for f in findings)
            if made is not None and made.evidence.get("location") in selection.evidence.get("upstream_lines", ()):
                # the whole numbers made upstream are what the selection then rounds: the origin first
                findings[:] = [made, selection, *(f for f in rest if f is not made)]
            else:
                # a selection whose fix no run found goes after a divergence whose fix was checked (its lines
                # make what the selection reads: the counts and the CDF a searchsorted picks from)
                checked = [] if fixed else [
                    f for f in rest if f.name == "precision-divergence" and f.trial is not None and f.trial.tried
                ]  # fmt: skip
                findings[:] = [*checked, selection, *(f for f in rest if f not in checked)]
            summary = result.report.data["summary"]
            for i, (label, text) in enumerate(summary):
                if label == "first divergent module" and fixed and (text.startswith("none") or dropped):
                    ev = selection.evidence
                    where = ev["location"].rpartition(":")[2]
                    share = f"{100 * ev['share_changed']:.1f}%"
                    what = (
                        "rounds {} of its values otherwise" if ev["op"] in selections.ROUNDS
                        else "decides otherwise for {} of its values" if ev["op"] in selections.COMPARING
                        else "picks otherwise in {} of its rows"
                    )  # fmt: skip
                    if ev.get("by_rows"):  # values per row of a mask over a vocabulary
                        share, what = f"{ev['share_changed']:.1f}", "decides otherwise for {} values a row"
                    said = f"none by itself: {selections.named(ev['op'])} at line {where} {what.format(share)}"
                    moved = ", which move the entries it keeps" if ev.get("by_rows") else ", which make the error"
                    summary[i] = (label, said + moved)
        if own is not None:  # the model's own code around its submodules (own_code.py), checked
            findings = result.report.findings
            findings.insert(0 if not any(f.severity == Severity.ERROR for f in findings) else len(findings), own)
        if self.cand_failed is not None:  # a model that cannot run in the candidate is never OK
            result.report.findings.insert(
                0,
                nonfinite.failed(
                    self.cand_failed, label=self.label, candidate=candidate, check=self._fix_checked,
                    on=inputs_text(describe(self.inputs)),
                ),
            )  # fmt: skip
        result.overflows = {name: found for (name, _), found in overflows.items()}
        if self.input_floor_note is not None:
            result.report.data["input_floor_note"] = self.input_floor_note
        if self.ranges:  # op outputs near the max that did not overflow (those are named above)
            near = near_limit.near_limit(
                self.cand_ranges.read(),
                self.truth_ranges.read(),
                exclude={(_unprefixed(n, prefix), f["op"]) for n, f in result.overflows.items()},
                prefix=prefix,
            )
            result.report.findings.extend(near_limit.findings(near, label=self.label))
            if near:
                result.report.data["near_limit_ops"] = near
        summary = result.report.data["summary"]
        if self.logits is not None and not prefix:
            self._judge_decisions(result, rows)
        elif self.root_units is not None and not prefix:
            self._judge_units(result, self.root_units)
        if misfit:
            result.report.data["misfits"] = misfit
            listed = "; ".join(describe_misfit(e) for e in misfit[:3])
            more = f"; and {len(misfit) - 3} more (JSON has all)" if len(misfit) > 3 else ""
            summary.append((f"parameters/buffers that do not fit {candidate}", listed + more))
        # a floor of 0 raised nothing: inputs already in the candidate's format, which rounding leaves as they are
        held = {name or "<root>": e.conditioned for (name, _), e in self.seen.items() if e.conditioned}
        if held:  # a floor raised by the inputs' rounding: the OK (or the verdict) says what it judged
            result.report.data["conditioned_floors"] = held
            summary.append((
                "floor from the inputs' rounding",
                "; ".join(f"`{m}` {v:.3g}" for m, v in list(held.items())[:3])
                + f": the exact module on its inputs rounded to {self.label} is about as wrong: it amplifies the "
                "rounding of what it reads, which no precision inside it undoes"
                + (
                    "; fed inputs made in fp32 (the readings fed in fp32, standardised before the cast), it would not "
                    "be (`--inputs-as-given` judges a model that casts them itself)"
                    if self.candidate != "fp32"
                    else " (its conditioning: any fp32 computation of it loses as much)"
                ),
            ))  # fmt: skip
        if self.fp8_dtype is not None:
            result.report.findings.extend(fp8.findings(self.fp8_rows))
            result.report.data["fp8"] = self.fp8_rows
            kernels = fp8.kernels_used(self.cand_run)
            result.report.data["fp8_kernel"] = kernels
            summary.append(("fp8 GEMM", kernels["text"]))
        if self.noise is not None:
            result.noise = self.noise.draws
            summary.append(
                (
                    "random draws",
                    f"{len(self.noise.draws)} made by the forward itself, the fp64 run's replayed in every run",
                )
            )
        self._broken_reference(result)
        self._fed_as_given(result)
        self._amplified_inputs(result)
        self._stable_form(result)
        self._composed_form(result)
        self._root_line_checked(result)
        self._cancellation_checked(result)
        self._amplified_submodules(result)
        if self._held is not None:  # after the steps that replace findings: their severity is the decisions'
            self._decisions_hold(result, self._held)
        _cure_first(result.report.findings)
        if not prefix:
            self._built_up(result)
        return result

    def _built_up(self, result: CompareResult) -> None:
        """Where nothing else was found and the output's error is past plan's target all the same: the
        error the format builds up across the model, said with the worst modules kept in fp32 (built_up.py)."""
        rows = result.rows
        unit = torch.finfo(self.cand_dtype).eps / 2
        found = any(f.severity.rank >= Severity.WARNING.rank for f in result.report.findings)
        if found or not built_up.above_floor(rows, unit):
            return
        if self.logits is not None or self.ids or self.fp8_dtype is not None or self.cand_failed is not None:
            return  # decisions are judged by what they decide; fp8 by its scaling
        if self.candidate not in PLAN_CANDIDATES:
            return  # plan's target, and its fix of modules kept in fp32, are for a narrower candidate than fp32
        kept = self.given or _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is not None
        floor = result.input_floor if result.input_floor is not None else None if kept else self._rounded_inputs_floor()
        aim = built_up.target(rows, floor, unit)
        if not rows[-1].propagated > aim:
            return
        tried = built_up.search(
            built_up.ranked(rows), lambda names: self._error_with_fp32(names, fp32_outputs=set()), aim
        )
        result.report.findings.append(
            built_up.finding(rows, label=self.label, aim=aim, input_floor=floor, tried=tried,
                             on=inputs_text(describe(self.inputs)), children=own_code.submodules(self.model))
        )  # fmt: skip

    def _amplified_submodules(self, result: CompareResult) -> None:
        """The whole model's own op amplifies the rounding of what it reads (run exactly on its inputs rounded,
        it is as wrong), and the lines that make that, in fp32, were measured not to take it away: what it reads
        is rounded where the model's submodules return it (x - net(x) with net nearly the identity; a sampler's
        x0 from its denoiser's noise). Those submodules kept in fp32, returning fp32, is one forward: the fix
        where it cures; where it does not, this is what the candidate's format costs here, a warning."""
        rows, findings = result.rows, result.report.findings
        if self.cand_dtype not in (torch.float16, torch.bfloat16):  # fp32's own fix is fp64 (_root_line_checked)
            return
        for i, f in enumerate(findings):
            ev = f.evidence
            forced, isolated = ev.get("conditioned_rel"), ev.get("isolated_rel")
            if (
                f.name != "precision-divergence" or f.where.get("module") != "" or ev.get("kind") != "divergence"
                or forced is None or isolated is None or 2 * forced < isolated or ev.get("raised_rel") is None
                or f.trial is None or f.trial.tried or not rows
            ):  # fmt: skip
                continue
            subs = own_code.submodules(self.model)
            before = rows[-1].propagated
            after = self._error_with_fp32(subs, fp32_outputs=set(subs)) if subs else None
            listed = " and ".join(f"`{n}`" for n in subs) or "its submodules"
            many = len(subs) > 1
            it, mods = ("their", "modules") if many else ("its", "module")
            op = f.where.get("op") or "the op"
            if after is not None and _cured(before, after):
                findings[i] = dataclasses.replace(
                    f,
                    fix=f"Keep {listed} in fp32 with {it} fp32 weights, returning fp32: after the model's cast to "
                    f"{self.label}, assign {it} fp32 {mods} again (a copy made before the cast: .float() after it "
                    f"gives the rounded weights back), {it} output not cast back. {op} reads what {listed} "
                    f"{'return' if many else 'returns'}, and rounded it amplifies it; checked: the end-to-end error "
                    f"goes from {before:.3g} to {after:.3g}",
                    trial=Trial.checked(f"{listed} kept in fp32, returning fp32, the rest in {self.label}",
                                        on=inputs_text(describe(self.inputs)), metric="end-to-end error",
                                        before=before, after=after),
                )  # fmt: skip
                continue
            tried = f"; {listed} in fp32 returning fp32 leave {after:.3g}" if after is not None else ""
            findings[i] = dataclasses.replace(
                f,
                severity=Severity.WARNING,
                fix=f"Nothing in the model's own lines or in {listed} alone is the fix: {self.label} costs this here; "
                "keep the model in fp32 where this error matters (`fpdoctor plan` checks larger sets)",
                message=f.message + (
                    f" No line of the model's own code in fp32 takes it away (measured: {ev['raised_rel']:.3g} from "
                    f"{before:.3g}){tried}: what {op} reads is rounded where the submodules return it, and it "
                    f"amplifies that, so this is what {self.label} costs here: a warning."
                ),
            )  # fmt: skip

    def _stable_form(self, result: CompareResult) -> None:
        """A finding whose op has a stable form torch offers by an argument (stable_forms.py), its fix
        untried: the candidate re-run with that argument; its edit printed where that is checked to
        take the end-to-end error down RAISED_FALLS times."""
        root = self.seen.get(("", 0))
        if root is None or not result.rows or not math.isfinite(result.rows[-1].propagated):
            return
        before = result.rows[-1].propagated
        for i, finding in enumerate(result.report.findings):
            form = stable_forms.form_for(finding.evidence.get("own_op"))
            if form is None or (finding.trial is not None and finding.trial.tried):
                continue
            # the line the finding names first; where that is not enough, every line that calls it: the fix
            # names the lines that run rewrote
            location = finding.evidence.get("own_op_location")
            for where in [location, None] if location else [None]:
                mode = stable_forms.Rewritten(form, where)
                with mode:
                    _, after = self._against_truth(self._root_output(self.cand_run, self.run_inputs, self.cand_dtype))
                if after is None or not math.isfinite(after):
                    continue
                if after * RAISED_FALLS <= before and mode.lines:
                    break
            else:
                continue
            args = ", ".join(f"{k}={v!r}" for k, v in form.kwargs.items())
            result.report.findings[i] = dataclasses.replace(
                finding,
                fix=stable_forms.fix_text(form, mode.lines),
                trial=Trial.checked(f"{form.call} at {' and '.join(mode.lines)} called with {args}",
                                    on=inputs_text(describe(self.inputs)), metric="end-to-end error", before=before,
                                    after=after),
            )  # fmt: skip

    def _cancellation_checked(self, result: CompareResult) -> None:
        """An fp32 candidate with an op whose conditioning forces an error (container_ops: the op run
        exactly on its inputs rounded to fp32 is as wrong) CANCELS times its output's rounding: the
        difference of two large totals, which amplifies whatever error they carry. No fp32 kernel does better on what it
        reads, so no op diverges and the verdict was OK on an output 8% off; the lines that make what it
        reads, with its own, computed in fp64 keep the digits. Where that takes the end-to-end error down
        RAISED_FALLS times it is the first finding, checked; the root finding it explains goes. Two
        forwards, only then."""
        if self.candidate != "fp32" or not result.rows or not math.isfinite(result.rows[-1].propagated):
            return
        before = result.rows[-1].propagated
        row = max(
            (r for r in result.rows if r.own and r.own.get("forced_rel") and r.own.get("forced_location")),
            key=lambda r: r.own["forced_rel"] if r.own else 0.0, default=None,
        )  # fmt: skip
        if row is None or row.own is None:
            return
        forced, op, at = row.own["forced_rel"], row.own["forced_op"], row.own["forced_location"]
        # against fp32's unit roundoff, what rounding any value costs at most: one value's own rounding (a 0-d
        # loss) can be near 0 by chance, and a healthy loss 24x it would read as a cancellation
        unit = torch.finfo(torch.float32).eps / 2
        if forced < CANCELS * unit or before <= DIVERGENCE_RATIO * max(row.floor, unit):
            return  # an op that keeps most of its digits, or an output within its noise
        # (what it reads may be off by more than its rounding, a mean of 4096 large squares: the check below,
        # the lines that make it in fp64, is what says the subtraction is where the digits go)
        if any(f.severity == "error" and f.trial is not None and f.trial.tried for f in result.report.findings):
            return  # a checked fix already stands first
        root = self._root()
        if root is None:
            return
        try:
            lines, _, _ = upstream.feeding_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, op=op, line=at, module=row.module, rng=self.rng,
                device=self.cand_device, noise=self.noise,
            )  # fmt: skip
            after = None
            if lines:
                after = error_under(
                    RaisedLines(set(lines), self.cand_dtype, wide=torch.float64), self.cand_run, self.run_inputs,
                    self.cand_dtype, truth=root.truth, norm=root.norm, rng=self.rng, device=self.cand_device,
                    noise=self.noise,
                )  # fmt: skip
        except Exception as exc:  # the check is ours: the report stands without it
            self.notes["cancellation"] = f"not checked: {type(exc).__name__}: {exc}"
            return
        if not lines or not _takes_down(after, before):
            return
        named = lines_text(lines)
        where = f"`{row.module}`'s own ops" if row.module else "the model's own ops"
        amplified = f" ({forced / unit:.2g}x fp32's unit roundoff)"
        called = self._called_modules(lines)  # a module a line calls ran in fp64 whole in the check: named so
        modules = (
            f", with {' and '.join(f'`{m}`' for m in called)} they call in fp64 too (.double() on "
            f"{'each' if len(called) > 1 else 'it'}: the check ran {'them' if len(called) > 1 else 'it'} so)"
            if called
            else ""
        )
        does, otherwise = _amplifies(op)
        found = catalog.make(
            "precision-divergence",
            title=f"{op.removeprefix('aten.').split('.')[0]} amplifies the rounding of what it reads beyond what fp32 "
            "holds: computed in fp64 from what it is made of, the output keeps its digits",
            message=(
                f"In fp32 the output is {before:.3g} off fp64, and no op computes worse than fp32 allows: {op} at "
                f"{at}, in {where}: {does}. Rounding what it reads to fp32 alone leaves its result {forced:.3g} "
                f"off{amplified}, whatever computes it in fp32. Computed in fp64 from what they are made of "
                f"({named}), the end-to-end error is {after:.3g}."
            ),
            where={"module": row.module, "op": op, "phase": "forward"},
            evidence={"kind": "cancellation", "op": op, "location": at, "forced_rel": forced,
                      "propagated_rel": before, "raised_rel": after, "lines": [f"{f}:{n}" for f, n in lines]},
            fix=f"compute {named} in fp64 (their operands .double(); a sum as .sum(dtype=torch.float64)){modules}, "
            f"and what they make cast back to the model's dtype where the rest of the model reads it ({BACK}); "
            f"{otherwise}",
            trial=Trial.checked(f"{named} in fp64{' with the modules they call' if called else ''}, what they make "
                                "cast back where the rest reads it", on=inputs_text(describe(self.inputs)),
                                metric="end-to-end error", before=before, after=after),
        )  # fmt: skip
        # a finding on the same container whose fix was not tried (its worst op is not what makes the error)
        result.report.findings[:] = [found] + [
            f for f in result.report.findings
            if not (f.name == "precision-divergence" and f.where.get("module") == row.module
                    and (f.trial is None or not f.trial.tried))
        ]  # fmt: skip

    def _root_line_checked(self, result: CompareResult) -> None:
        """An fp32 candidate whose error the model's own ops make (no submodule), its fix untried: the
        worst op's line computed in fp64, its result cast back, end to end. Checked where that takes the
        error down RAISED_FALLS times; where it does not, that fix is not printed (a recurrence that
        carries its state from step to step loses it there, not in the op that reads it: a covariance
        update whose fp32 form loses positive-definiteness over the steps, not the gain that reads it)."""
        if self.candidate != "fp32" or not result.rows or not math.isfinite(result.rows[-1].propagated):
            return
        before = result.rows[-1].propagated
        for i, finding in enumerate(result.report.findings):
            location = finding.evidence.get("own_op_location")
            if (
                finding.name != "precision-divergence" or finding.where.get("module") != "" or not location
                or (finding.trial is not None and finding.trial.tried)
            ):  # fmt: skip
                continue
            file, _, number = str(location).rpartition(":")
            if not number.isdigit():
                continue
            on = inputs_text(describe(self.inputs))
            # the line, then with the lines above it that make what it reads (y = x + 3000 rounds x before
            # y * y - 9e6 cancels): the first span whose fp64 takes the error down is the fix
            tried: list[tuple[int, float | None]] = []  # (first line, the error with it .. the op's line in fp64)
            for first in _lines_above(file, int(number), ROOT_LINES_UP):
                tried.append((first, self._fix_checked("fp64", (file, first), int(number) - first)))
                if _takes_down(tried[-1][1], before):
                    break
            first, after = tried[-1] if tried and _takes_down(tried[-1][1], before) else (int(number), tried[0][1])
            if _takes_down(after, before):
                lines = f"line {number}" if first == int(number) else f"lines {first}-{number}"
                result.report.findings[i] = dataclasses.replace(
                    finding,
                    fix=f"compute {lines} of {file} in fp64 (the operands they read from the rest of the model "
                    ".double(), what the last makes cast back to their dtype), or rewrite them in a stable form",
                    trial=Trial.checked(f"{lines} of {file} in fp64, the result cast back", on=on,
                                        metric="end-to-end error", before=before, after=after),
                )  # fmt: skip
            else:
                widest = tried[-1][1] if tried else after  # the span walked furthest up, the figure it left
                left = f"{widest:.3g}" if widest is not None else "an error of its own"
                span = f"line {number}" if len(tried) < 2 else f"lines {tried[-1][0]}-{number}"
                # the recurrence through the op's line; else the one that makes the output (a tracker's estimate
                # at a large offset, rounded every step, while the worst op is its covariance's update)
                carried, through = self._recurrence_checked(f"{file}:{number}", before), "through it"
                if carried is None:
                    carried, through = self._recurrence_checked(None, before), "that makes the output"
                if carried is not None:
                    cycle, fixed = carried
                    result.report.findings[i] = _recurrence_finding(
                        finding, cycle, span=span, left=left, before=before, after=fixed, on=on, through=through
                    )
                    continue
                held = self._states_checked(before)
                if held is not None:
                    states, fixed = held
                    result.report.findings[i] = _states_finding(
                        finding, states, span=span, left=left, before=before, after=fixed, on=on
                    )
                    continue
                result.report.findings[i] = dataclasses.replace(
                    finding,
                    fix=f"the error is not made where it shows: {span} of {file} in fp64 leave it at {left} (from "
                    f"{before:.3g}). It is made further up, or carried: a value rounded before those lines read it "
                    "(a large offset added in fp32 further up, before a difference of close values: compute the "
                    "difference from the offset first), or, in a loop, a state carried from one step to the next, "
                    "whose update needs a form that keeps its "
                    "properties in fp32 (a covariance as (I - KH) P (I - KH)^T + K R K^T, the Joseph form, not "
                    "(I - KH) P; a sum by compensated or pairwise summation) or that state in fp64",
                    trial=Trial.untried(
                        f"no run can write a stable form; {span} in fp64, the result cast back, was tried and leaves "
                        f"the end-to-end error at {left} (from {before:.3g}) on {on}, so it is not the fix"
                    ),
                )

    def _states_checked(self, before: float) -> tuple[list[str], float] | None:
        """Where no recurrence of a few lines is found (a loop's cycle of more than MOST_LINES: an RK4 step):
        the loop's state updates that make the output (recurrence.loop_state_lines: x = x + dt * v, t = t + dt)
        computed in fp64 from the first step, what they make read as it is (torch's promotion then computes
        every line that reads them in fp64, as holding the state in fp64 does in the user's code). (The lines,
        the end-to-end error then) where that takes the error down RAISED_FALLS times; else None. Two
        forwards."""
        root = self._root()
        if root is None:
            return None
        try:
            states = loop_state_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, rng=self.rng, device=self.cand_device,
                noise=self.noise,
            )  # fmt: skip
            if not states or len(states) > MOST_LINES:
                return None
            lines = {(file, int(n)) for file, _, n in (at.rpartition(":") for at in states)}
            kept: list[torch.Tensor] = []
            ran = error_under(
                RaisedLines(lines, self.cand_dtype, cast_back=False, wide=torch.float64), self.cand_run,
                self.run_inputs, self.cand_dtype, truth=root.truth, norm=root.norm, rng=self.rng,
                device=self.cand_device, noise=self.noise, keep=kept,
            )  # fmt: skip
            # measured as the fix leaves it: the output cast back to the model's dtype
            after = _error_of(kept[0].to(self.cand_dtype), root) if ran is not None and kept else None
            if after is None:
                return None
        except Exception as exc:  # the search is ours: the finding stands without it
            self.notes["loop state"] = f"not searched: {type(exc).__name__}: {exc}"
            return None
        return (states, after) if _takes_down(after, before) else None

    def _recurrence_checked(self, line: str | None, before: float) -> tuple[Recurrence, float] | None:
        """Where no span of lines above the worst op (at `line`; None: the line that makes the output)
        cures an fp32 error: the recurrence through its line (recurrence.py: the lines that carry a value
        from one step of a loop to the next through it) kept in fp64 from the first step, end to end; where that is not
        enough, with the lines that make what it reads in fp64 too, not cast back (a filter's
        coefficients, made once and read every step: rounded to fp32 they move its poles). (The cycle,
        the error then) where that takes the error down RAISED_FALLS times; else None. Two forwards,
        only then (two more for the feeding lines)."""
        try:
            cycle = recurrence(
                self.cand_run, self.run_inputs, self.cand_dtype, line, rng=self.rng, device=self.cand_device,
                noise=self.noise,
            )  # fmt: skip
            if cycle is None or not cycle.sites:
                return None
            root = self._root()
            if root is None:
                return None

            def error_with(kept: Recurrence) -> float | None:
                fed = RaisedLines(set(kept.fed), self.cand_dtype, cast_back=False, wide=torch.float64)
                return error_under(
                    RaisedSites(kept.sites, self.cand_dtype, views=kept.views), self.cand_run, self.run_inputs,
                    self.cand_dtype, truth=root.truth, norm=root.norm, rng=self.rng, device=self.cand_device,
                    noise=self.noise, watch=fed if kept.fed else None,
                )  # fmt: skip

            after = error_with(cycle)
            if after is None or not _takes_down(after, before):
                fed = cycle.feeders
                if not fed or len(fed) > FEEDING_LINES:
                    return None
                cycle = dataclasses.replace(cycle, fed=fed)
                after = error_with(cycle)
                if after is None or not _takes_down(after, before):
                    return None
            # a cycle it only reads from that the fix does not need (a loop counter carried as a tensor): left out,
            # where the rest alone still takes the error down as far (within 2x)
            # (where the line is on no cycle, any of them: the first in the source is not the line's own)
            own = cycle.groups[0] if line in cycle.groups[0] else None
            for group in [g for g in cycle.groups if g is not own]:
                fewer = cycle.without(group)
                got = error_with(fewer) if fewer.sites else None
                if got is not None and _takes_down(got, before) and got <= 2 * after:
                    cycle, after = fewer, got
        except Exception as exc:  # the search is ours: the finding stands without it
            self.notes["recurrence"] = f"not searched: {type(exc).__name__}: {exc}"
            return None
        return cycle, after

    def _composed_form(self, result: CompareResult) -> None:
        """An error whose first finding has no checked fix, or one that leaves it far above the output's
        floor: the candidate re-run with each pair of calls whose stable form torch computes in one
        function (stable_forms.COMPOSED: the log of a det, acos of a dot product, 1 - exp(-y), ...)
        computed so, where the forward makes one. Where that takes the end-to-end error down
        RAISED_FALLS times (or makes a non-finite output finite), and to half what the checked fix
        leaves, it is the first finding, its edit checked; a finding at those lines says no more. One
        forward, only then."""
        root = self.seen.get(("", 0))
        first = next((f for f in result.report.findings if f.severity == "error"), None)
        if root is None or not result.rows or first is None:
            return
        before, floor = result.rows[-1].propagated, result.rows[-1].floor
        done = first.trial.after if first.trial is not None and first.trial.tried else None
        if isinstance(done, (int, float)) and done <= DIVERGENCE_RATIO * floor:
            return  # its checked fix takes the error to the output's floor: nothing left to find
        mode = stable_forms.Composed()
        try:
            with mode:
                _, after = self._against_truth(self._root_output(self.cand_run, self.run_inputs, self.cand_dtype))
        except Exception as exc:  # the try is ours: the report stands without it
            self.notes["stable forms"] = f"not tried: {type(exc).__name__}: {exc}"
            return
        if not mode.lines or after is None or not math.isfinite(after):
            return
        if math.isfinite(before) and after * RAISED_FALLS > before:
            return
        if isinstance(done, (int, float)) and math.isfinite(done) and after * 2 > done:
            return  # the checked fix does as well: it stays the first
        pairs = dict(mode.lines)
        if len(pairs) > 1:  # each line alone: the ones that take the error down by themselves are the cause
            alone = {}
            for line, kind in pairs.items():
                one = stable_forms.Composed(only={line})
                with one:
                    _, got = self._against_truth(self._root_output(self.cand_run, self.run_inputs, self.cand_dtype))
                if (
                    got is not None
                    and math.isfinite(got)
                    and (not math.isfinite(before) or got * RAISED_FALLS <= before)
                ):
                    alone[line] = (kind, got)
            if len(alone) == 1:
                ((line, (kind, after)),) = alone.items()
                pairs = {line: kind}
            elif alone and len(alone) < len(pairs):  # several, each enough: those, their figure from one run
                pairs = {line: kind for line, (kind, _) in alone.items()}
                some = stable_forms.Composed(only=set(pairs))
                with some:
                    _, got = self._against_truth(self._root_output(self.cand_run, self.run_inputs, self.cand_dtype))
                if got is not None and math.isfinite(got):
                    after = got
        dtype = str(self.cand_dtype).removeprefix("torch.")
        names, fix = stable_forms.composed_text(pairs, dtype)
        lines = " and ".join(pairs)
        found = catalog.make(
            "precision-divergence",
            title=(
                f"Computed as written, {names} {'lose' if len(pairs) > 1 else 'loses'} what {self.label} holds: "
                f"{'their stable forms take' if len(pairs) > 1 else 'its stable form takes'} the error away"
            ),
            message=(
                f"In {self.label}, {names} at {lines} "
                + ("makes the output non-finite" if not math.isfinite(before) else f"makes an error of {before:.3g}")
                + f" ({stable_forms.composed_why(pairs, dtype)}): computed by the stable form torch offers, the "
                f"end-to-end error is {after:.3g}."
            ),
            where={"module": None, "op": None, "phase": "forward"},
            evidence={"kind": "stable-form", "pairs": pairs, "propagated_rel": before, "raised_rel": after},
            fix=fix,
            trial=Trial.checked(
                f"{names} at {lines} computed by {'their' if len(pairs) > 1 else 'its'} stable form",
                on=inputs_text(describe(self.inputs)), metric="end-to-end error", before=before, after=after,
            ),
        )  # fmt: skip
        said = set(pairs)  # a finding at those lines (their op named by its isolated error) is this cause
        result.report.findings[:] = [found] + [
            f for f in result.report.findings
            if str(f.evidence.get("own_op_location") or f.evidence.get("location") or "").split(" in ")[0] not in said
        ]  # fmt: skip

    def _broken_reference(self, result: CompareResult) -> None:
        """The floor model (fp32) run end to end against fp64, where the output's floor is large enough
        that it may be: off by BROKEN_REFERENCE or more, it is no floor, and that is said first."""
        root = self.seen.get(("", 0))
        row = result.rows[-1] if result.rows else None
        if self.ref_run is None or root is None or row is None or row.module != "" or not row.floor >= BROKEN_REFERENCE:
            return  # the root's floor holds the floor model's error where it is the larger: none, none to measure
        _, off = self._against_truth(self._root_output(self.ref_run, self.inputs, self.ref_dtype, device=None))
        if off is None:
            return
        if off >= BROKEN_REFERENCE or not math.isfinite(off):
            result.report.findings.insert(0, broken_reference(off, row.propagated, self.reference, self.candidate))

    def _fed_as_given(self, result: CompareResult) -> None:
        """An error put down to rounding the inputs, its fix untried: the candidate fed them as given
        tried (a model that casts its raw inputs where it computes with them, as one fixed to centre
        them in fp32 does). Where that takes the end-to-end error down INPUT_FIX_FALLS times, the
        finding says to pass them unrounded, checked; elsewhere it stands as it was."""
        at = next((i for i, f in enumerate(result.report.findings) if f.evidence.get("kind") == "input-rounding"), None)
        if at is None or self.given or not result.rows or self.seen.get(("", 0)) is None:
            return
        trial = result.report.findings[at].trial
        if trial is not None and trial.tried:
            return
        before = result.rows[-1].propagated
        if not math.isfinite(before):
            return
        fed = self._given_try(before)
        if isinstance(fed, str):
            old = result.report.findings[at]
            reason = old.trial.reason if old.trial is not None and old.trial.reason else ""
            result.report.findings[at] = dataclasses.replace(
                old, trial=Trial.untried(f"{reason}; {fed}" if reason else fed)
            )
            return
        floor = result.input_floor if result.input_floor is not None else before
        result.report.findings[at] = self._given_finding(before, floor, *fed)

    def _amplified_inputs(self, result: CompareResult) -> None:
        """An OK whose error is far above the output's own rounding, made by a module that amplifies the
        rounding of its inputs (its floor raised to what the exact module on them rounded makes: a
        standardisation of raw readings near 300, done in fp32 after the fix): no part diverges, yet the
        inputs' rounding is the whole error. Where the candidate fed them as given (the model casts them
        itself) takes it down INPUT_FIX_FALLS times, that is the finding, checked; else the OK stands, the
        floor row saying what it judged."""
        rows = result.rows
        if self.given or not rows or self.cand_dtype not in (torch.float16, torch.bfloat16):
            return
        if any(f.severity in ("error", "warning") for f in result.report.findings):
            return
        if not any(e.conditioned is not None for e in self.seen.values()) or self.seen.get(("", 0)) is None:
            return
        before, root = rows[-1].propagated, rows[-1]
        if not math.isfinite(before) or before <= DIVERGENCE_RATIO * root.floor:
            return
        if _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is not None:
            return
        floor = self._floor_with()  # the exact model fed the inputs rounded: the error it explains
        if floor is None or not math.isfinite(floor) or before > INPUT_EXPLAINS * floor:
            return
        fed = self._given_try(before)
        if isinstance(fed, str):
            return
        result.report.data["input_floor"] = result.input_floor = floor
        result.report.findings.insert(0, self._given_finding(before, floor, *fed))

    def _given_try(self, before: float) -> tuple[float, list[str], torch.Tensor | None] | str:
        """The candidate fed the inputs as given, then with the user's own buffers the format rounds
        kept in fp32 too (a reference pressure of 1013.25 hPa is 1016 in bf16, as the model computes
        with it): the first run that takes the end-to-end error `before` down INPUT_FIX_FALLS times, as
        (its error, the buffers kept, its output's sample); else why none is the fix."""
        rounded = [
            name for name, b in self.model.named_buffers()
            if b.is_floating_point() and not _torch_made(self.model.get_submodule(name.rpartition(".")[0]))
            and _rounded_by(b, self.cand_dtype)
        ]  # fmt: skip
        ran: list[float] = []
        failed = ""  # why a try gave no figure
        for kept in ([], rounded) if rounded else ([],):
            out = self._given_output(kept)
            sample, after = self._against_truth(out)
            if out is None:
                failed = "its forward failed on them (it computes with them without casting them)"
                continue
            if sample is None or after is None or not math.isfinite(after):
                failed = "its output differs" if sample is None else "its output was not finite"
                continue
            ran.append(after)
            if after * INPUT_FIX_FALLS <= before:
                return after, kept, sample
        return (
            f"the {self.candidate} model fed the inputs as given was run and is not the fix ({before:.3g} -> "
            f"{min(ran):.3g})"
            if ran
            else f"the {self.candidate} model fed the inputs as given was tried: {failed}"
        )

    def _given_finding(
        self, before: float, floor: float, after: float, kept: list[str], sample: torch.Tensor | None
    ) -> Finding:
        """The input-rounding finding with its fix checked (units.given_finding): `after`, the candidate's
        error fed the inputs as given with `kept` (buffers) in fp32, `sample` its output's sample."""
        units = fed = None
        if self.root_units is not None and self._units_truth is not None and self.logits is None and sample is not None:
            units, fed = self.root_units, in_units(self._units_truth, sample, self.candidate, row=self.root_units.row)
        return given_finding(
            self.candidate, before=before, after=after, input_floor=floor, units=units, fed=fed,
            on=inputs_text(describe(self.inputs)), buffers=kept,
        )  # fmt: skip

    def _against_truth(self, out: torch.Tensor | None) -> tuple[torch.Tensor | None, float | None]:
        """`out`'s sample, as the candidate pass samples the output, and its end-to-end error against the
        fp64 run (inf or nan where it is not finite); (None, None) where there is no output, or it is not
        the output the pass sampled."""
        root = self.seen.get(("", 0))
        sample = device_sample(out) if out is not None else None
        if root is None or sample is None or sample.numel() != root.truth.numel():
            return None, None
        return sample, rel_error(sample.to(root.truth.device), root.truth, root.norm)

    def _given_output(self, buffers: list[str]) -> torch.Tensor | None:
        """The candidate's output fed the inputs as given, with `buffers` (the user's model's names) put
        back in fp32, its exact values, for that forward only."""
        swapped = []
        try:
            for name in buffers:
                path, _, leaf = name.rpartition(".")
                holder = self.cand_run.get_submodule(path)
                # a copy: a forward that updates its buffer in place never writes into the user's model
                value = self.model.get_buffer(name).detach().to(torch.float32, copy=True)
                stored = buffers_of(holder)
                swapped.append((stored, leaf, stored[leaf]))
                stored[leaf] = value if self.cand_device is None else value.to(self.cand_device)
            out = self._root_output(self.cand_run, Given(*split_inputs(self.inputs)), self.cand_dtype)
        except Exception:
            out = None
        finally:
            for held, leaf, original in reversed(swapped):
                held[leaf] = original
        return out

    def _lines_after(
        self, lines: list[tuple[str, int]], error: float, outputs: list[torch.Tensor],
        run: Callable[[list[tuple[str, int]]], float | None], *, first: bool = False,
    ) -> tuple[list[tuple[str, int]], float]:  # fmt: skip
        """`lines` with up to nonfinite.LINES_AFTER lines after the last of them, one at a time, where
        computing them in fp32 too takes the error down by EXTEND_FALLS again: the first set that is
        checked to cure may not be the whole fix (a variance by hand in fp32 whose mean is cast back
        before `x - mean`: the NaN cured, 1.35x of the error left in that line). `first`: `lines`
        themselves run first (in another way `run` says). It stops at a line that calls a module of the
        model (`return self.mlp(x)`): that whole module in fp32 helps, and is no part of the fix.
        `outputs` ends as the kept run's."""
        kept = list(outputs)
        file, last = lines[-1]
        current = list(lines)
        for k in range(0 if first else 1, nonfinite.LINES_AFTER + 1):
            if k and self._calls_module(file, last + k):
                break
            more = [*current, *((file, n) for n in range(current[-1][1] + 1, last + k + 1))]
            after = run(more)
            if after is not None and math.isfinite(after) and after * EXTEND_FALLS <= error:
                current, error, kept = more, after, list(outputs)
        outputs[:] = kept
        return current, error

    def _calls_module(self, file: str, number: int) -> bool:
        """Whether the source line calls one of the model's modules by its attribute (self.mlp(x), block.mlp(x))."""
        code = linecache.getline(file, number)
        return any(m.group(1) in self._attributes for m in re.finditer(r"\.(\w+)\s*\(", code))

    @functools.cached_property
    def _attributes(self) -> set[str]:
        """The attribute names the model's modules are called by (the last part of each name)."""
        return {name.rpartition(".")[2] for name in self.truth_modules if name}

    def _container(self, attribute: str) -> bool:
        """Whether the model's module of that attribute name (the first such) holds submodules."""
        module = next((m for n, m in self.truth_modules.items() if n and n.rpartition(".")[2] == attribute), None)
        return module is not None and any(True for _ in module.children())

    def _called_modules(self, lines: list[tuple[str, int]]) -> list[str]:
        """The attributes by which the source lines call the model's modules (self.rate_head(self.body(x)):
        rate_head, body), in order: a check that raised those lines ran them in fp32 whole."""
        called: list[str] = []
        for file, number in lines:  # self.<attribute>(...): x.norm(...) is a tensor's method, not a module `norm`
            for m in re.finditer(r"\bself\.(\w+)\s*\(", linecache.getline(file, number)):
                if m.group(1) in self._attributes and m.group(1) not in called:
                    called.append(m.group(1))
        return called

    def _made_checked(self, rows: list[ModuleRow], forced: dict[str, dict[str, Any]]) -> Finding | None:
        """NUM020/NUM021 for the first line that makes values the candidate's format rounds, where
        computing it (and the lines after it that read them) in fp32 is checked to cure; None where
        none is, or where a divergence finding's check already raised that line (upstream of its op)."""
        error = rows[-1].propagated if rows else math.nan
        self._fix_outputs.clear()  # the overflow checks' runs: only this check's are read
        if not self.made or not math.isfinite(error) or self.cand_dtype not in (torch.float16, torch.bfloat16):
            return None
        raised = {at for found in forced.values() for at in found.get("lines") or []}
        sites = [m for m in self.made if nonfinite.line_of(m.location) not in raised]
        self._keep_fix_outputs = True
        try:
            found = made_in_dtype.checked(sites, self._fix_checked, error)
        finally:
            self._keep_fix_outputs = False
        if found is None:
            return None
        site, more, after, wide = found
        made = made_in_dtype.finding(site, more, error, after, label=self.label, dtype=self.cand_dtype, wide=wide)
        output = self._fix_outputs.get(("wide" if wide else "op", nonfinite.line_of(site.location), more))
        self.made_fix = (made, output) if output is not None else None
        self._fix_outputs.clear()
        return made

    def _buffers_checked(self, rows: list[ModuleRow], findings: list[Finding]) -> Finding | None:
        """NUM020 for a buffer of whole numbers the model's cast rounds (positions held as a float buffer
        past fp16's 2048), where no finding's fix was checked: the buffer held in fp32 and the lines that
        read it computed in fp32 from it, their results cast back (a mask the attention reads in its dtype),
        checked to divide the end-to-end error by RAISED_FALLS."""
        error = rows[-1].propagated if rows else math.nan
        if not math.isfinite(error) or self.cand_dtype not in (torch.float16, torch.bfloat16):
            return None
        if any(f.trial is not None and f.trial.tried for f in findings):
            return None
        root = self._root()
        if root is None:
            return None
        # by attribute: every block's own `positions` (one module class's code) is one fix
        groups: dict[str, list[tuple[str, float]]] = {}
        for name, top in made_in_dtype.whole_buffers(self.model, self.cand_dtype):
            groups.setdefault(name.rpartition(".")[2], []).append((name, top))
        try:
            for held in list(groups.values())[:2]:
                lines = upstream.reader_lines(
                    self.cand_run, self.run_inputs, self.cand_dtype, [name for name, _ in held], rng=self.rng,
                    device=self.cand_device, noise=self.noise,
                )  # fmt: skip
                kept: list[torch.Tensor] = []
                after = upstream.raised_error(
                    self.cand_run, self.run_inputs, self.cand_dtype, lines, truth=root.truth, norm=root.norm,
                    rng=self.rng, device=self.cand_device, noise=self.noise,
                    buffers={name: self.model.get_buffer(name) for name, _ in held}, keep=kept,
                )  # fmt: skip
                if after is not None and after * RAISED_FALLS <= error and kept:
                    found = made_in_dtype.buffer_finding(
                        [name for name, _ in held], max(x for _, x in held), lines, error, after, label=self.label,
                        dtype=self.cand_dtype, held=plain_fp32([name for name, _ in held]),
                    )  # fmt: skip
                    self.made_fix = (found, kept[-1])
                    return found
        except Exception as exc:  # the check is ours: the report stands without it
            self.notes["buffers of whole numbers"] = f"not checked: {type(exc).__name__}: {exc}"
        return None

    def _fix_checked(self, kind: str, line: tuple[str, int], more: int = 0) -> float | None:
        """The end-to-end error with an overflow's fix in place (nonfinite.py, profile.causes): the
        cast at `line` held at the format's largest finite value ("cast"), or the ops at `line` and
        the `more` lines after it in fp32, their results cast back after them ("op"; "fp64": in fp64,
        for an fp32 candidate)."""
        root = self._root()
        if root is None:
            return None
        lines = {(line[0], line[1] + k) for k in range(more + 1)}
        mode = (
            SaturatedCasts(lines, self.cand_dtype)
            if kind == "cast"
            else RaisedLines(
                lines,
                self.cand_dtype,
                cast_back=kind != "wide",
                wide=torch.float64 if kind == "fp64" else torch.float32,
            )
        )
        kept: list[torch.Tensor] = []  # the run's output, for what it decides (_checked_fixes)
        broken: list[str] = []  # modules whose output the fix leaves off by BROKEN of its norm or more

        def each(name: str, index: int, output: Any) -> None:
            # a fix judged end to end alone can pass where a residual dilutes a module it left dead
            # (a variance cast back past fp16's range: a norm's output all 0, 30x diluted, trial80)
            seen = self.seen.get((name, index))
            got = device_sample(output) if seen is not None and name else None
            if got is None or got.numel() != seen.truth.numel() or not seen.norm > 0:  # type: ignore[union-attr]
                return
            off = float((got.to(seen.truth.device) - seen.truth).norm()) / seen.norm  # type: ignore[union-attr]
            if not off < BROKEN:
                broken.append(name)

        error = error_under(mode, self.cand_run, self.run_inputs, self.cand_dtype, truth=root.truth, norm=root.norm,
                            rng=self.rng, device=self.cand_device, noise=self.noise, keep=kept, each=each,
                            restart=broken.clear)  # fmt: skip
        if self._keep_fix_outputs:  # only the runs _made_checked reads: an LM's logits are large
            self._fix_outputs[(kind, line, more)] = kept[0] if kept else None
        return math.inf if broken and error is not None else error

    def _before_cast_checked(
        self, op: str, module: str, location: str
    ) -> tuple[list[tuple[str, int]], float | None, bool, bool]:
        """The lines that feed `op` at `location` (its own included, and up to nonfinite.LINES_AFTER
        lines after it) computed in fp32: first on the inputs as the candidate gets them (an exp two
        lines up that underflows: line 33 in fp32 alone still takes the log of its 0), then on the
        model's inputs fed in fp32, not rounded by the cast before the forward (raw readings scaled by
        their batch's statistics: rounded, a column's spread is 0, then 0/0): (the lines, the
        end-to-end error, whether the inputs were fed as given, whether their single values are read
        in fp32) of the first run whose output is finite, else the last; ([], None, False, False) where
        the op was not seen or the lines not found. Where the output is finite with what the lines make
        cast back, the same lines are run once more with the single values they make (alphas[t] of a
        schedule they build) read in fp32 as they are (raising.RaisedLines.scalars_kept): where that
        leaves SCALARS_FALL times less error, it is the fix."""
        line = nonfinite.line_of(location)
        if line is None or self.given:
            return [], None, False, False
        rounded = _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is None
        root = self._root()
        if root is None:
            return [], None, False, False

        def raised(lines: list[tuple[str, int]], given: bool, scalars_kept: bool = False) -> float | None:
            return upstream.raised_error(
                self.cand_run, self.run_inputs, self.cand_dtype, lines, truth=root.truth, norm=root.norm, rng=self.rng,
                device=self.cand_device, noise=self.noise, inputs_as_given=given, scalars_kept=scalars_kept,
            )  # fmt: skip

        lines: list[tuple[str, int]] = []
        error: float | None = None
        try:  # the check is ours: where it fails, the finding stands with the fix untried
            fed, _, _ = upstream.feeding_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, op=op, line=location, module=module, rng=self.rng,
                device=self.cand_device, noise=self.noise,
            )  # fmt: skip
            for given in (False, True) if rounded else (False,):
                for more in range(nonfinite.LINES_AFTER + 1):
                    lines = sorted({*fed, line, *((line[0], line[1] + k) for k in range(1, more + 1))})
                    error = raised(lines, given)
                    if error is not None and math.isfinite(error):
                        kept = raised(lines, given, scalars_kept=True)
                        if kept is not None and kept * SCALARS_FALL < error:
                            return lines, kept, given, True
                        return lines, error, given, False
        except Exception as exc:
            self.notes["the computation before the cast"] = f"not checked: {type(exc).__name__}: {exc}"
            return [], None, False, False
        return lines, error, rounded, False

    def _kept_checked(self, findings: list[Finding], rows: list[ModuleRow]) -> None:
        """A divergence whose fix is "keep the module in fp32" and was left untried: the model run once
        with that module in fp32 (`_module_checked`), and the fix checked by it where that cures the
        end-to-end error. Where it does not, what the module reads may be what the format lost (values near
        2000 that vary by 0.2, rounded to fp16's spacing of 1 there): the leaf that ran before it kept too,
        its output left in fp32 for it, is tried, and is the fix where it cures; else the fix says that
        keeping the module does not help, with the figure, and sends to plan."""
        for k, f in enumerate(findings):
            module = f.where.get("module")
            untried = f.trial is not None and not f.trial.tried and f.trial.reason == UNTRIED_BY_COMPARE
            if f.name != "precision-divergence" or not module or not untried or not f.fix.startswith("keep `"):
                continue
            row = next((r for r in rows if r.module == module), None)
            if row is None or not rows:
                return
            error = rows[-1].propagated
            on = inputs_text(describe(self.inputs))
            metric = "end-to-end relative error against fp64"
            # one run of the module kept in fp32 (its output left in fp32 where its exact output passes the
            # format's range): the check where it cures, the figure the message gives where it does not
            alone = self._error_with_fp32([module], fp32_outputs={module} if row.out_of_range else set())
            if alone is not None and _cured(error, alone):
                findings[k] = dataclasses.replace(
                    f,
                    fix=f"{f.fix}; checked: the end-to-end error goes from {error:.3g} to {alone:.3g}",
                    trial=Trial.checked(
                        f"`{module}` kept in fp32, its output cast back to {self.label}, the rest in {self.label}",
                        metric=metric, before=error, after=alone, on=on,
                    ),
                )  # fmt: skip
                return
            if alone is None or row.out_of_range:
                return
            before_it = self._leaf_before(module)
            ran = self._run_with_fp32([before_it, module], fp32_outputs={before_it}) if before_it else None
            pair = None if ran is None else ran[0]
            if before_it is not None and ran is not None and pair is not None and _cured(error, pair):
                changed = f"`{before_it}` and `{module}` kept in fp32, fp32 between them, the rest in {self.label}"
                fix = (
                    f"keep `{before_it}` and `{module}` in fp32, `{before_it}`'s output left in fp32 for "
                    f"`{module}` to read (`{module}`'s cast back to {self.label}): in your forward, "
                    f"`self.{module}(self.{before_it}(x.float()))` computed in fp32, then .to(x.dtype) "
                    "(`fpdoctor plan` writes it as code)"
                )
                self.kept_fix = (fix, changed, ran[1])
                findings[k] = dataclasses.replace(
                    f,
                    message=f.message + (
                        f" Kept in fp32 alone, `{module}` leaves the end-to-end error at {alone:.3g}: what it reads, "
                        f"`{before_it}`'s output, loses in {self.label} what `{module}` needs, before `{module}` "
                        "computes anything."
                    ),
                    fix=f"{fix}; checked: the end-to-end error goes from {error:.3g} to {pair:.3g}",
                    evidence={**f.evidence, "kept_fp32": [before_it, module], "fp32_between": before_it},
                    trial=Trial.checked(changed, metric=metric, before=error, after=pair, on=on),
                )  # fmt: skip
                return
            carried = self._carried_checked(rows, error)
            if carried is not None:
                self.line_fix = carried.pop("output")
                findings[k] = dataclasses.replace(
                    f,
                    message=f.message + (
                        f" Kept in fp32 alone, `{module}` leaves the end-to-end error at {alone:.3g}: what it reads "
                        f"is rounded to {self.label} where it is stored between modules, before `{module}` computes "
                        "anything."
                    ),
                    fix=carried["fix"],
                    evidence={**f.evidence, "carried_lines": carried["lines"], "kept_fp32": carried["modules"]},
                    trial=Trial.checked(carried["changed"], metric=metric, before=error, after=carried["after"], on=on),
                )  # fmt: skip
                return
            tried = f"`{module}` alone in fp32: {error:.3g} -> {alone:.3g}"
            if before_it is not None and pair is not None:
                tried += f"; with `{before_it}` before it, fp32 between them: {pair:.3g}"
            findings[k] = dataclasses.replace(
                f,
                fix=(
                    f"keeping `{module}` in fp32 does not cure it ({tried}): `fpdoctor plan` searches the sets of "
                    "modules that do and verifies the one it gives"
                ),
                trial=Trial.untried(f"the module kept in fp32 was run and does not cure it ({tried})"),
            )
            return

    def _carried_checked(self, rows: list[ModuleRow], error: float) -> dict[str, Any] | None:
        """Where the divergent modules read a value handed from module to module (a residual stream at an
        offset of 300 that every norm centres, rounded to bf16's spacing of 2 wherever it is stored): the
        lines that make what they are passed in fp32, their results kept in fp32 from module to module (a
        layer with weights reads them cast), the divergent modules in fp32 reading them as they are and
        returning the candidate's dtype, the inputs fed in fp32 where the cast rounds them. The fix, its
        figures and its output where that cures the end-to-end `error`; None where it does not, or the run
        fails."""
        readers = sorted({r.module for r in rows if r.diverged and r.module})
        root = self._root()
        if not readers or root is None:
            return None
        rounds = not self.given and _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is None
        outputs: list[torch.Tensor] = []
        after, given = None, False
        try:
            stream = upstream.input_lines(
                self.cand_run, self.run_inputs, self.cand_dtype, set(readers), rng=self.rng,
                device=self.cand_device, noise=self.noise,
            )  # fmt: skip
            # the inputs fed in fp32 only where the cast's rounding of them is part of it (readings near 300)
            for given in ((False, True) if rounds else (False,)) if stream else ():
                outputs.clear()
                after = upstream.raised_error(
                    self.cand_run, self.run_inputs, self.cand_dtype, stream, truth=root.truth, norm=root.norm,
                    rng=self.rng, device=self.cand_device, noise=self.noise, keep=outputs, inputs_as_given=given,
                    carried=stream, modules=readers,
                )  # fmt: skip
                if after is not None and _cured(error, after):
                    break
        except Exception as exc:  # the check is ours: the finding stands without it
            self.notes["the value the divergent modules are passed"] = f"not checked: {type(exc).__name__}: {exc}"
            return None
        if after is None or not _cured(error, after) or not outputs:
            return None
        where, dtype = lines_text(stream), self.label
        kept = ", ".join(f"`{m}`" for m in readers)
        reading = (
            f"; compute {kept} in fp32 reading it as it is (.float() on each after your cast of the model; where the "
            "code that casts is not yours, `fpdoctor compare` included, in the forward: each one's functional form on "
            "x.float() with its parameters .float(), a LayerNorm m as F.layer_norm(x.float(), m.normalized_shape, "
            f"m.weight.float(), m.bias.float(), m.eps)), and cast what they return to {dtype} where it is read "
            "(self.mlp(self.norm(x).to(p.dtype)), p a parameter of the model); any other layer that reads the "
            "stream reads it as .to(p.dtype)"
        )
        checked = f"the end-to-end error goes from {error:.3g} to {after:.3g}"
        fix = carried_fix(f"what {kept} read", where, dtype, reading, given=given, checked=checked)
        changed = (
            f"the ops at {where} in fp32, their results kept in fp32 from module to module, {kept} in fp32 reading "
            f"them as they are" + (", the inputs fed in fp32" if given else "") + f", what else reads them cast to "
            f"{dtype}"
        )  # fmt: skip
        return {"fix": fix, "changed": changed, "after": after, "lines": [f"{f}:{n}" for f, n in stream],
                "modules": readers, "output": outputs[-1]}  # fmt: skip

    def _finite_but_far(self, finding: Finding, rows: list[ModuleRow]) -> Finding:
        """A non-finite output's checked fix that leaves the output finite but DIVERGENCE_RATIO past its
        floor (a log's line in fp32 under a power spectrum that underflowed before it): the fix of the NaN,
        not of the run. The module the op runs in kept in fp32 is checked beside it and leads where it takes
        the error down RAISED_FALLS further; else the fix says what it leaves."""
        trial = finding.trial
        after = trial.after if trial is not None and trial.tried else None
        floor = rows[-1].floor if rows else 0.0
        if finding.name != "nonfinite-produced" or not isinstance(after, float) or not math.isfinite(after):
            return finding
        if not floor > 0 or after <= DIVERGENCE_RATIO * floor:
            return finding
        left = f"{after:.3g}, {after / floor:.0f}x the output's floor ({floor:.2g})"
        narrower = trial.changed if trial is not None else "its line in fp32"
        module = finding.where.get("module") or ""
        whole = self._error_with_fp32([module], fp32_outputs=set()) if module else None
        if whole is not None and math.isfinite(whole) and whole * RAISED_FALLS <= after:
            return dataclasses.replace(
                finding,
                fix=f"keep `{module}` in fp32 (its inputs cast to fp32, its output cast back to {self.label}): the "
                f"output is finite and its error {whole:.3g} (checked). With only {narrower}, the output is finite "
                f"but its error is {left}: `{module}` loses precision before that line too (values it makes that "
                "underflow or round to 0 before they reach it)",
                trial=Trial.checked(
                    f"`{module}` kept in fp32, the rest in {self.label}", on=trial.on if trial else "",
                    metric=trial.metric if trial else "end-to-end error", before="non-finite", after=whole,
                ),
            )  # fmt: skip
        tried = f"; `{module}` whole in fp32 does not take it further" if whole is not None else ""
        return dataclasses.replace(
            finding,
            fix=f"{finding.fix}. That fixes the NaN/Inf, not all of the error: it leaves {left}{tried}; "
            "`fpdoctor compare` on the fixed model names what loses the rest",
        )

    def _module_checked(self, row: ModuleRow, error: float) -> dict[str, Any] | None:
        """The module whose op overflows, kept whole in fp32 (its output left in fp32 where its exact
        output passes the format's range): its end-to-end error, where that cures the output (finite,
        or RAISED_FALLS below); None where it does not or cannot run so."""
        if not row.module:
            return None
        after = self._error_with_fp32([row.module], fp32_outputs={row.module} if row.out_of_range else set())
        if after is None or not _cured(error, after):
            return None
        return {"before": error, "after": after, "fp32_output": row.out_of_range}

    def _error_with_fp32(self, modules: list[str], *, fp32_outputs: set[str]) -> float | None:
        """The end-to-end error with `modules` computed in fp32 (those in `fp32_outputs` returning fp32, the
        others cast back); None where it cannot run so."""
        ran = self._run_with_fp32(modules, fp32_outputs=fp32_outputs)
        return None if ran is None else ran[0]

    def _run_with_fp32(self, modules: list[str], *, fp32_outputs: set[str]) -> tuple[float, torch.Tensor] | None:
        """`_error_with_fp32`'s figure and the output it was read from."""
        root = self._root()
        if root is None or not root.norm > 0:
            return None
        try:
            out = self._output_with_fp32(modules, fp32_output=fp32_outputs)
        except Exception:  # the check is ours: the finding stands without it
            return None
        if out is None:
            return None
        error = _error_of(out, root)
        return None if error is None else (error, out)

    def _overflow_checked(self, found: dict[str, Any], error: float, *, broken: bool = False) -> dict[str, Any] | None:
        """An op that overflows inside a divergent module, computed in fp32 with the ops after it that
        consume its result (its line, then up to nonfinite.LINES_AFTER more: a softmax written by hand),
        cast back after them: the first set of lines that takes the end-to-end error down by
        RAISED_FALLS, with its figure; None where none does or the line is not known. Where the module
        was `broken` (its output off by BROKEN or more, which a residual around the model dilutes end
        to end), a set that leaves no module broken is the fix however little the end-to-end error falls."""
        line = nonfinite.line_of(found.get("location"))
        if line is None:
            return None
        more, after = nonfinite.fp32_lines(self._fix_checked, line, math.inf if broken else error)
        if after is None or not math.isfinite(after):
            return None
        if math.isfinite(error) and after * RAISED_FALLS > error and not broken:
            return None
        lines = [line[1], line[1] + more]
        # a module those lines call (self.o(num / den)): torch's own runs its ops at the line, which the check
        # raised with it; a module of the user's runs them at its own lines, which read what the lines made cast back
        called = self._called_modules([(line[0], n) for n in range(lines[0], lines[1] + 1)])
        mine = [c for c in called if self._users_module(c)]
        return {
            "lines": lines, "file": line[0], "before": error, "after": after,
            "called": [c for c in called if c not in mine], "called_user": mine,
        }  # fmt: skip

    def _users_module(self, attribute: str) -> bool:
        """Whether a module the model holds by `attribute` has a forward of the user's own code."""
        for module in self.model.modules():
            child = module._modules.get(attribute)
            if child is not None:
                file = inspect.getsourcefile(inspect.unwrap(type(child).forward)) or ""
                return is_user_file(file)
        return False

    # -- the output judged by what it decides (use.py) ---------------------------------------------
    def _kept_sets(self) -> Kept | None:
        """What the candidate does to the entries a masked output keeps (decide.kept: a sampler's
        filter), against rounding the exact output to its format; None where the output masks none."""
        if self.root_truth is None or self.root_cand is None or self.ids or self.binary:
            return None
        truth = self.root_truth
        if self._kept is not None:
            return self._kept[0]
        if not bool((truth <= MASKED).any()):  # most outputs mask nothing: one pass, no rounded copy
            self._kept = (None,)
            return None
        rounded = (
            self._decided(round_to(truth.exp(), self.candidate)) if self.softmaxed else round_to(truth, self.candidate)
        )
        self._kept = (kept_sets(truth, self.root_cand, rounded),)
        return self._kept[0]

    def _judge_decisions(self, result: CompareResult, rows: list[ModuleRow]) -> None:
        """Top-1, top-5 and KL of an output of logits beside their floor, in the summary and the
        JSON; a finding when the candidate changes the decisions, with the module kept in fp32
        that gives most of them back (each of the worst leaves and the logits' own layer, tried)."""
        if self.root_truth is None or self.root_cand is None or self.logits is None:
            return
        floor_format = output_format(self.candidate)
        returned = self.root_cand_dtype
        if returned == torch.float32 and self.cand_dtype in (torch.float16, torch.bfloat16):
            # the candidate returns its output in fp32 (its last layer kept in fp32, a fix in place): what
            # rounding costs is fp32's, not the format's, which would call flips of its own rounding
            floor_format = "fp32"
        if self.ids:
            self._judge_ids(result, rows)
            return
        sets = self._kept_sets()
        if sets is not None:
            result.report.data["kept"] = sets.to_dict()
            _beside_error(result.report.data["summary"], ("kept entries (" + self.logits + ")", sets.text()))
            selected = any(f.name == "selection-changed" and f.trial is not None and f.trial.tried
                           for f in result.report.findings)  # fmt: skip
            if sets.differs and not selected:  # a selection found and checked is their cause: it speaks for them
                result.report.findings.append(use.kept_finding(sets, self.label, inputs=self.inputs))
        found = use.decisions(self.root_truth, self.root_cand, floor_format, self.logits)
        if found is None:
            return
        if self.binary or self.softmaxed:  # the floor: the probabilities rounded to the format, not their logs
            p = round_to((self.root_truth[:, 1] if self.binary else self.root_truth).exp(), self.candidate)
            floor = use.top1(self.root_truth, self._decided(p))
            found = found if floor is None else dataclasses.replace(found, floor_top1=floor)
        result.report.data["decisions"] = found.to_dict()
        _beside_error(result.report.data["summary"], ("decisions (" + found.source + ")", found.text()))
        # the output's format alone, where the candidate returns it (an fp8 candidate's GEMMs return wider),
        # on two rows or more
        floor_flips = 1.0 - found.floor_top1
        coarse = floor_flips >= use.DECISION_SHARE and floor_flips * found.rows >= 2
        # an output the candidate returns wider than its format (the fix in place: fp32 scores) is not rounded
        coarse = coarse and self.root_cand_dtype == self.cand_dtype
        if not found.changed and coarse and self.cand_dtype in (torch.float16, torch.bfloat16):
            held = rounding_floor(self.root_truth, "fp32")
            if held is not None and 1.0 - held[0] <= use.RECOVERED * floor_flips:  # fp32 holds them
                # the fix as a run: the layer that makes the output kept in fp32, returning fp32; where the
                # model's own ops make it (scores against a table), no run puts the fix in place
                made_by_leaf = self.logits is not None and self.logits.startswith(("logits of", "log-probabilities of"))
                # scores declared decided by their argmax (a sum of log-probabilities over a hypothesis): their last
                # layer is tried too, a run that checks itself
                made_by_leaf = made_by_leaf or self.declared == "argmax"
                head = self._last_leaf if made_by_leaf else None
                if (made_by_leaf or self.binary or self.softmaxed) and self._last_leaf is not None:
                    last = self._last_leaf  # what the sigmoid, softmax or log-softmax reads
                    squash = isinstance(self.truth_modules[last], (nn.Sigmoid, nn.Softmax, nn.LogSoftmax))
                    head = self._leaf_before(last) if squash else last
                ran = self._top1_with_fp32([head], fp32_output=True) if head else None
                own = self._own_scores() if head is None else None  # scores the model's own code makes
                checked = None
                if own is not None and own[2] is not None:
                    got = use.top1(self.root_truth, self._decided(own[2].to(self.root_truth.device)))
                    checked = None if got is None else (own[0], own[1], got)
                result.report.findings.append(
                    use.coarse_finding(found, self.label, held[0], inputs=self.inputs, head=head, ran=ran, own=checked)
                )
        if not found.changed:
            self._held = found
            return
        head = self._last_leaf or ""
        fixes = self._checked_fixes(result)
        if any(found.recovered(c.top1) for c in fixes):  # a checked fix of the error gives them back too
            result.report.findings.append(use.finding(found, self.label, [], head=head, inputs=self.inputs,
                                                      checked_fixes=fixes))  # fmt: skip
            return
        leaves = sorted(
            (r for r in rows if r.module in self.leaves and r.module != head), key=lambda r: -(r.ratio or 0.0)
        )
        # the logits' layer alone; each of the worst leaves alone; the logits' layer and the leaf that
        # ran before it, with fp32 between them (what the candidate rounds may be the activation itself)
        trials: list[tuple[list[str], bool]] = [([head], True)]
        trials += [([r.module], False) for r in leaves[: use.TRIED_LEAVES]]
        before = self._leaf_before(head)
        if before is not None:
            trials.append(([before, head], True))
        if self.candidate == "fp32":  # a module kept in fp32 is the candidate itself: nothing to try
            trials = []
        tried: list[tuple[list[str], float]] = []
        for modules, fp32_output in trials:
            top1 = self._top1_with_fp32(modules, fp32_output=fp32_output)
            if top1 is not None:
                tried.append((modules, top1))
            if top1 is not None and found.recovered(top1):
                break  # the first that gives the decisions back, in the order of what it changes least
        result.report.findings.append(use.finding(found, self.label, tried, head=head, inputs=self.inputs,
                                                  checked_fixes=fixes))  # fmt: skip

    def _judge_ids(self, result: CompareResult, rows: list[ModuleRow]) -> None:
        """An output of ids, judged by the share equal to fp64's beside the reference model's share
        (one forward of it); where the candidate's is far below, a finding with the modules kept in
        fp32 that give them back (the leaf that made the last decision, the worst leaves), tried."""
        assert self.root_truth is not None and self.root_cand is not None and self.logits is not None
        reference = 1.0
        if self.ref_run is not None:
            ref = self._root_output(self.ref_run, self.run_inputs, self.ref_dtype)
            agreed = ids_agree(self.root_truth, ref) if ref is not None else None
            reference = agreed if agreed is not None else 1.0
        found = id_decisions(self.root_truth, self.root_cand, reference, self.logits)
        if found is None:
            return
        result.report.data["decisions"] = found.to_dict()
        _beside_error(result.report.data["summary"], ("decisions (" + found.source + ")", found.text()))
        if not found.changed:
            return
        head = self._last_leaf or ""
        leaves = sorted(
            (r for r in rows if r.module in self.leaves and r.module != head), key=lambda r: -(r.ratio or 0.0)
        )
        trials = [[head]] if head else []
        trials += [[r.module] for r in leaves[: use.TRIED_LEAVES]]
        tried: list[tuple[list[str], float]] = []
        for modules in trials:
            got = self._top1_with_fp32(modules, fp32_output=False)
            if got is not None:
                tried.append((modules, got))
            if got is not None and found.recovered(got):
                break
        own = self._picked_by_own_code(found, tried)
        result.report.findings.insert(
            0, use.finding(found, self.label, tried, head=head, inputs=self.inputs, checked_fixes=own)
        )

    def _picked_by_own_code(self, found: Decisions, tried: list[tuple[list[str], float]]) -> list[use.CheckedFix]:
        """Ids the model's own code picks from scores it computes (a retrieval's q @ index.T, then topk):
        where no module kept in fp32 gives them back, _own_scores' run, judged by the ids."""
        if not self._picked or any(found.recovered(t) for _, t in tried) or self.root_truth is None:
            return []
        ran = self._own_scores()
        got = ids_agree(self.root_truth, ran[2]) if ran is not None and ran[2] is not None else None
        if ran is None or got is None:
            return []
        fix, changed, _ = ran
        where = own_code.span(self.model, None)
        return [use.CheckedFix(fix=fix, changed=changed, top1=got, kind="own_ops_in_fp32", locations=where)]

    def _own_scores(self) -> tuple[str, str, torch.Tensor | None] | None:
        """Scores the model's own code makes around its submodules (q @ self.index.T), run with its own ops in
        fp32, its own tensors in fp32 and only its submodules in the candidate (_output_with_own_fp32, one
        forward): (the fix as printed, what the run changed, its output). None without submodules."""
        subs = own_code.submodules(self.model)
        if not subs:
            return None
        own = own_code.own_tensors(self.model)
        kept = f", from fp32 copies of its own {', '.join(f'`{n}`' for n in own)} ({plain_fp32(own)})" if own else ""
        listed = " and ".join(f"`{n}`" for n in subs)
        fix = (
            f"Compute the scores, and any pick from them, in fp32 in {own_code.span(self.model, None)}"
            f"{kept}, with only {listed} in {self.label} (its output taken back .float())"
        )
        return fix, f"the model's own ops in fp32, {listed} in {self.label}", self._output_with_own_fp32()

    @staticmethod
    def _decisions_hold(result: CompareResult, found: Any) -> None:
        """The candidate decides as the exact model does (within rounding's floor, on HOLD_ROWS rows or
        more): an error that rounding the inputs alone explains is a warning, not an error that keeps
        failing a CI job on a model whose decisions are right (a router's lines fixed: top-1 99.8%, its
        inputs' rounding left). A module's divergence stays an error: an output read as logits may be a
        regression head's (two outputs of a Linear), and an output that is not finite decides nothing."""
        flipped, floor = 1.0 - found.top1, 1.0 - found.floor_top1
        if found.kind != "logits" or found.rows < HOLD_ROWS or flipped > floor + use.DECISION_SHARE:
            return  # too few rows to tell, or more flips than rounding the output makes
        for i, f in enumerate(result.report.findings):
            finite = math.isfinite(f.evidence.get("propagated_rel") or 0.0)
            if f.severity is Severity.ERROR and f.evidence.get("kind") == "input-rounding" and finite:
                said = f" The decisions hold all the same: {found.text()}."
                result.report.findings[i] = dataclasses.replace(f, severity=Severity.WARNING, message=f.message + said)

    def _checked_fixes(self, result: CompareResult) -> list[use.CheckedFix]:
        """The fixes of the error that ran the model (step 5's running states kept in fp64, step 5b's
        lines computed in fp32), each judged by what its run's output decides: the figure comes
        from the run that checked the fix, no forward of its own."""
        if self.root_truth is None or self.logits is None:
            return []
        fixes: list[use.CheckedFix] = []
        emitted = any(  # the fix the finding on the end-to-end error printed, not one another finding outranked
            f.evidence.get("kind") == "input-rounding" and "whole_numbers" in f.evidence for f in result.report.findings
        )
        if self.input_fix is not None and emitted:  # the inputs' values the format rounds (input_cause.py)
            found, output = self.input_fix
            got = use.top1(self.root_truth, self._decided(output.to(self.root_truth.device)))
            if got is not None:
                fix = found["fix"][0].upper() + found["fix"][1:]
                fixes.append(use.CheckedFix(fix, found["changed"], got, "inputs_kept", ""))
        if self.state_fix is not None:
            lines, output, feeding = self.state_fix
            got = use.top1(self.root_truth, self._decided(output.to(self.root_truth.device)))
            where = ", ".join(lines)
            noun = "running states" if len(lines) > 1 else "running state"
            fed = f" and compute {lines_text(feeding)} in fp32 too" if feeding else ""
            if got is not None:
                fixes.append(use.CheckedFix(
                    f"Keep the {noun} updated at {where} in fp32{fed}",
                    f"the {noun} at {where} kept in fp64"
                    + (f", {lines_text(feeding)} in fp32" if feeding else "") + f", the rest in {self.label}",
                    got, "running_state_kept", where,
                ))  # fmt: skip
        if self.made_fix is not None:  # values the format rounds, made in fp32 (made_in_dtype.py)
            made, output = self.made_fix
            got = use.top1(self.root_truth, self._decided(output.to(self.root_truth.device)))
            if got is not None and made.trial is not None:
                fix = made.fix.partition("; checked:")[0]
                where = str(made.evidence.get("location") or "")
                fixes.append(use.CheckedFix(fix, made.trial.changed, got, "made_in_fp32", where))
        if self.selection_fix is not None:  # a selection's lines in fp32, its picks given back (selections.py)
            chosen, output = self.selection_fix
            got = use.top1(self.root_truth, self._decided(output.to(self.root_truth.device)))
            if got is not None and chosen.trial is not None and chosen.trial.tried:
                fix = chosen.fix.partition("; checked:")[0]
                where = ", ".join(f"line {n}" for n in chosen.evidence.get("lines_raised") or [])
                fixes.append(use.CheckedFix(fix, chosen.trial.changed, got, "selection_lines", where))
        if self.kept_fix is not None:  # modules kept in fp32 with fp32 between them (_kept_checked)
            fix, changed, output = self.kept_fix
            got = use.top1(self.root_truth, self._decided(output.to(self.root_truth.device)))
            if got is not None:
                fixes.append(use.CheckedFix(fix, changed, got, "modules_in_fp32", ""))
        if self.line_fix is not None:
            # the finding that printed the fix, checked (a trial only where it helped: profile.forced_causes)
            forced = next(
                (
                    f for f in result.report.findings
                    if f.name == "precision-divergence" and "conditioned_rel" in f.evidence
                    and f.trial is not None and f.trial.tried
                ),
                None,
            )  # fmt: skip
            got = use.top1(self.root_truth, self._decided(self.line_fix.to(self.root_truth.device)))
            if forced is not None and forced.trial is not None and got is not None:
                where = ", ".join(forced.evidence.get("feeding_lines") or forced.evidence.get("rounded_buffers") or [])
                # its fix without the figures it was checked by (the end-to-end error): these are top-1's
                fix = forced.fix.partition("; checked:")[0]
                fixes.append(use.CheckedFix(fix, forced.trial.changed, got, "lines_in_fp32", where))
        return fixes

    def _leaf_before(self, head: str) -> str | None:
        """The leaf whose call ended last before the logits' layer's (the fp64 pass's order)."""
        order = [name for (name, _), entry in self.seen.items() if entry.leaf and name != ""]
        last = max((i for i, name in enumerate(order) if name == head), default=None)
        return order[last - 1] if last else None

    def _judge_units(self, result: CompareResult, units: InUnits) -> None:
        """An output that is not logits, in its units beside its floor and its spread; a finding where
        the format's rounding alone costs a large share of the spread (units.py), with the output's
        layer kept in fp32 tried."""
        result.report.data["output_error"] = units.to_dict()
        _beside_error(result.report.data["summary"], ("output error, in its units", units.text(self.candidate)))
        if not units.coarse or self._units_truth is None or self.cand_failed is not None:
            if units.lost and not any(f.severity is Severity.ERROR for f in result.report.findings):
                # no module's own error stands out, and the output is lost all the same: never OK. Where
                # rounding the inputs explains it, that is the cause (the model may read them in fp32 itself)
                found = self._lost_to_inputs(result, units)
                if found is not None:  # its fix tried by _fed_as_given
                    result.report.findings.append(found)
                    return
                worst = "; ".join(text for key, text in result.report.data["summary"] if key.startswith("largest"))
                result.report.findings.append(lost_finding(units, self.candidate, worst=worst or "none measured"))
            return
        head = self._last_leaf or ""
        out = self._output_with_fp32([head], fp32_output=True) if head else None
        sample = device_sample(out) if out is not None else None  # as the candidate pass samples it
        kept = in_units(self._units_truth, sample, self.candidate, row=units.row) if sample is not None else None
        own = None
        if kept is None or kept.mean > units.mean / 4:  # the output made by the model's own ops (a de-normalisation)
            out = self._output_with_own_fp32()
            sample = device_sample(out) if out is not None else None
            own = in_units(self._units_truth, sample, self.candidate, row=units.row) if sample is not None else None
        on = inputs_text(describe(self.inputs))
        children = own_code.submodules(self.model)
        result.report.findings.append(coarse_finding(units, self.label, head, kept, on=on, own=own, children=children))

    def _lost_to_inputs(self, result: CompareResult, units: InUnits) -> Finding | None:
        """A lost output whose error rounding the inputs explains (the exact model fed them rounded is
        within INPUT_EXPLAINS of it): the inputs' rounding named (its fix tried by _fed_as_given). None
        where the inputs are not rounded or do not explain it."""
        root = result.rows[-1] if result.rows else None
        if root is None or self.given or self._units_truth is None:
            return None
        if _inputs_kept(self.inputs, self.cand_dtype, self.ref_dtype) is not None:
            return None
        floor = result.input_floor
        if floor is None:
            floor = self._floor_with()
        if floor is None or not math.isfinite(floor) or root.propagated > INPUT_EXPLAINS * floor:
            return None
        result.report.data["input_floor"] = result.input_floor = floor
        return input_rounding_finding(root, self.label, self.candidate, self.reference, floor, found=None)

    def _top1_with_fp32(self, modules: list[str], *, fp32_output: bool) -> float | None:
        """The candidate's top-1 agreement with `modules` computed in fp32 (_output_with_fp32)."""
        if self.root_truth is None or self.logits is None:
            return None
        got = self._output_with_fp32(modules, fp32_output=fp32_output)
        if got is None:
            return None
        if self.ids:
            return ids_agree(self.root_truth, got)
        return use.top1(self.root_truth, self._decided(got.to(self.root_truth.device)))

    def _output_with_fp32(self, modules: list[str], *, fp32_output: bool | set[str]) -> torch.Tensor | None:
        """The candidate's output (its first floating tensor) with `modules` computed in fp32 (the
        user's modules, their inputs raised; their outputs cast back to the candidate's dtype unless
        `fp32_output`, or unless they are among it): the candidate's copy holds the swap for one forward only."""
        if "" in modules:
            return None
        swapped = []
        for module in modules:
            parent, _, child = module.rpartition(".")
            holder = self.cand_run.get_submodule(parent)
            wide = fp32_output if isinstance(fp32_output, bool) else module in fp32_output
            back = None if wide else self.cand_dtype
            kept = keep_in_fp32(copy_module(self.model.get_submodule(module)), back)
            swapped.append((holder, child, getattr(holder, child)))
            setattr(holder, child, kept if self.cand_device is None else kept.to(self.cand_device))
        try:
            return self._root_output(self.cand_run, self.run_inputs, self.cand_dtype)
        finally:
            for holder, child, original in reversed(swapped):
                setattr(holder, child, original)

    def _output_with_own_fp32(self, errors: list[str] | None = None) -> torch.Tensor | None:
        """The output (its first floating tensor) with the model's own ops in fp32 on its inputs as
        given, and its submodules as the candidate runs them (their inputs cast to its dtype, their
        outputs back to fp32; own_code.submodules: inside a ModuleList, and not those that hold no
        weights, which are own code): a copy of the user's model holds the swap. `errors` gets why
        the run failed, where it did."""
        run = copy_module(self.model).to(torch.float32)
        dtype = self.cand_dtype
        for name in own_code.submodules(self.model):
            child = copy_module(self.cand_run.get_submodule(name))
            child.register_forward_pre_hook(
                lambda m, args, kwargs: (cast_inputs(args, dtype), cast_inputs(kwargs, dtype)), with_kwargs=True
            )
            child.register_forward_hook(lambda m, args, output: cast_inputs(output, torch.float32))
            parent, _, leaf = name.rpartition(".")
            setattr(run.get_submodule(parent), leaf, child)
        return self._root_output(run if self.cand_device is None else run.to(self.cand_device), self.inputs,
                                 torch.float32, errors=errors)  # fmt: skip

    def _root_output(
        self, run: nn.Module, inputs: Any, dtype: torch.dtype, device: torch.device | str | None = "candidate",
        errors: list[str] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """`run`'s output (its first floating tensor) on `inputs` cast to `dtype`, as the candidate's pass
        runs it (its RNG, its draws replayed), on the candidate's device unless `device` says where;
        None where it cannot run so (a swap that does not fit: not tried)."""
        on = self.cand_device if isinstance(device, str) else device
        got: list[torch.Tensor] = []

        def post(name: str, index: int, args: Any, output: Any) -> None:
            first = (_ids_of(output) if self.ids else next(floating(output), None)) if name == "" else None
            if first is not None:
                got.append(first.detach())

        try:
            hooked(run, inputs, dtype, pre=None, post=post, rng=self.rng, device=on, noise=self.noise)
        except Exception as exc:
            if errors is not None:
                errors.append(f"{type(exc).__name__}: {exc}")
            return None
        return got[-1] if got else None


# The divergent modules whose overflowing op gets its fix checked (each check: up to three forwards)
CHECKED_OVERFLOWS = 2
# A fix that leaves a module's output off by this share of its norm or more has not fixed it, however
# small the end-to-end error (a residual around it dilutes the broken module's error)
BROKEN = 0.5
# A running state is named the cause when keeping it alone in fp64 divides the end-to-end error
# by at least this much (12 dB): the rest of the model still runs in the candidate's dtype.
ACCUMULATION_FALLS = 4.0


def _cure_first(findings: list[Finding]) -> None:
    """A non-finite output whose first finding's fix was not found to help, where another error's checked
    fix makes it finite: that one first. The op that made the NaN is where it shows; what it read was made
    wrong before it (a schedule's buffer the cast rounded to 0, that the op divides by the root of)."""
    first = findings[0] if findings else None
    if first is None or first.name != "nonfinite-produced" or (first.trial is not None and first.trial.tried):
        return
    for i, f in enumerate(findings[1:], 1):
        trial = f.trial
        if f.severity != Severity.ERROR or trial is None or not trial.tried:
            continue
        before, after = trial.before, trial.after
        gone = before in ("inf", "nan", "non-finite") or (isinstance(before, float) and not math.isfinite(before))
        if gone and isinstance(after, float | int) and math.isfinite(after) and after < BROKEN:  # not finite garbage
            findings.insert(0, findings.pop(i))
            return


def _explained_by_made(finding: Finding) -> bool:
    """A finding that a checked fix of values made in the candidate's format (made_in_dtype) explains:
    an accumulation (no part explained the error), or a divergence without a fix that helped."""
    if finding.evidence.get("kind") == "accumulation":
        return True
    return finding.name == "precision-divergence" and not (finding.trial is not None and finding.trial.tried)


def _inputs_kept(inputs: Any, dtype: torch.dtype, reference: torch.dtype) -> str | None:
    """Why rounding `inputs` to the candidate's `dtype` changes nothing (no floating-point tensor
    among them, token ids; or each value already one of `dtype`'s), so the input floor is 0 by
    definition; None when it may change them. Also None when the candidate's dtype is not coarser
    than the reference's (fp32 on another device against fp32): the forward on unchanged inputs
    measures the reference's own end-to-end error, which is what explains the candidate's there.
    Coarser, the candidate's output rounding (in the root's floor) stands above that error."""
    if torch.finfo(dtype).eps <= torch.finfo(reference).eps:
        return None
    floats: list[torch.Tensor] = []
    map_tensors(inputs, lambda t: floats.append(t) if t.is_floating_point() else None)
    if not floats:
        return "no floating-point tensor among the inputs"
    for t in floats:  # NaN is unequal to itself: such inputs keep their forward
        if t.dtype != dtype and not torch.equal(t.to(dtype).to(t.dtype), t):
            return None
    return f"every floating-point value among the inputs is already a {str(dtype).removeprefix('torch.')} value"


def _rounded_by(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether casting `t` to `dtype` changes a value (ALiBi's slopes 2^-k are held exactly in fp16)."""
    with torch.no_grad():
        return not torch.equal(t.to(dtype).to(t.dtype), t)


def _torch_made(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.")


def _own_diverged(rows: list[ModuleRow]) -> bool:
    """The whole model diverges by its own ops (it has some), and no submodule diverges."""
    root = rows[-1] if rows else None
    return (
        root is not None and root.module == "" and root.diverged and root.own is not None
        and not any(r.diverged for r in rows[:-1])
    )  # fmt: skip


def _forced(row: ModuleRow) -> bool:
    """The container's worst own op is as wrong run exactly on its inputs in the candidate's dtype."""
    own = row.own or {}
    conditioned, error = own.get("conditioned_rel"), own.get("error_rel")
    return conditioned is not None and error is not None and conditioned >= upstream.FORCED * error


def _whole_row(output: Any, sample: torch.Tensor) -> int | None:
    """The output's last dim, where the sample holds the whole output (in order): its rows' own
    spread can be read from it (units.in_units)."""
    first = next(floating(output), None)
    if first is None or first.dim() < 2 or first.numel() != sample.numel():
        return None
    return int(first.shape[-1])


def _quantized(model: nn.Module) -> tuple[str, str] | None:
    """The first module of torch's quantized layers (torch.ao.nn.quantized: quantize_dynamic's Linear,
    convert's), by name and class; None for a floating model."""
    for name, module in model.named_modules():
        where = type(module).__module__
        if where.startswith(("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")):
            return name, f"{where}.{type(module).__name__}"
    return None


def _masked_of(first: torch.Tensor, made: torch.Tensor | None) -> bool:
    """Whether an output is what its last leaf made (times a positive constant, a temperature) with some
    entries set to -inf after it: logits a sampler's filter masked."""
    if made is None or made.shape != first.shape or not made.is_floating_point():
        return False
    mask = torch.isneginf(first)
    if not bool(mask.any()) or bool(mask.all()):
        return False
    ours, theirs = device_sample(first[~mask]), device_sample(made[~mask])
    return ours is not None and theirs is not None and _proportional(ours, theirs)


def _sums_to_one(t: torch.Tensor) -> bool:
    """Probabilities over the last dim: none below 0, each row summing to 1."""
    sums = t.double().sum(-1)
    return not bool((t < 0).any()) and torch.allclose(sums, torch.ones_like(sums), atol=1e-3)


def _filter_figures(t: torch.Tensor) -> torch.Tensor | None:
    """What says whether an output is a filtered distribution over its last dim (`_filtered_by`), on
    the device, to be read with other figures: its values below 0, its rows' largest distance from a
    sum of 1, the share of rows with an exact zero, of rows with more than one entry kept. None for an
    output of one dim or one class."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.numel() == 0:
        return None
    rows = t.detach().reshape(-1, t.shape[-1])
    zeros = rows == 0
    return torch.stack([
        (rows < 0).sum().double(), (rows.double().sum(-1) - 1.0).abs().max(), zeros.any(-1).double().mean(),
        ((~zeros).sum(-1) > 1).double().mean(),
    ])  # fmt: skip


def _filtered_by(figures: list[float]) -> bool:
    """A filtered distribution (a sampler's top-p or top-k probabilities, renormalised): none below 0,
    each row summing to 1, exact zeros in most rows and more than one entry kept in most (an argmax's
    one-hot, attention weights over every key are not)."""
    below, off, zero_rows, kept_rows = figures
    return below == 0 and off <= 1e-3 + 1e-5 and zero_rows >= 0.5 and kept_rows >= 0.5


def _unexplained(rows: list[ModuleRow], conditioning: bool = True) -> float | None:
    """The largest error any part adds by itself (a module's or an own op's isolated error, the
    output's floor; with `conditioning`, an own op's error computed in fp32 from its inputs rounded)
    when the end-to-end error is DIVERGENCE_RATIO times above it; else None."""
    if not rows or not math.isfinite(rows[-1].propagated):
        return None
    explained = _explained(rows, conditioning)
    return explained if rows[-1].propagated > DIVERGENCE_RATIO * explained else None


def _lines_above(file: str, number: int, up: int) -> list[int]:
    """`number`, then the lines above it, `up` at most, within its function (never a `def`, a decorator
    or a class line: what runs above them is another function's)."""
    lines = [number]
    for k in range(number - 1, max(number - up, 1) - 1, -1):
        if linecache.getline(file, k).strip().startswith(("def ", "async def ", "class ", "@")):
            break
        lines.append(k)
    return lines


# How a fix computed in fp64 casts back to an fp32 model: to the dtype of what the model reads, never a
# hard .float(), which would also turn compare's fp64 run of the same code to fp32 (and fail its matmuls)
BACK = (
    "`.to(x.dtype)`, x an input the line reads in the model's dtype; not `.float()`, which would turn the model's "
    "fp64 run to fp32"
)


def _amplifies(op: str) -> tuple[str, str]:
    """What an op whose conditioning forces an error does with what it reads, and the rewrite that
    keeps fp32 (the other fix beside fp64), by its kind."""
    name = op.removeprefix("aten.").split(".")[0]
    if name in ("sub", "rsub", "add", "sum", "mean", "cumsum"):
        return (
            "it takes the difference of values far larger than the result",
            "or, where few terms differ between the two totals (one particle moved, a few prices changed), the "
            "difference from those terms alone, so that no two large totals are subtracted (where every term differs "
            "a little, as two models' log-likelihoods do, each term's own fp32 rounding is as large: fp64 is the fix)",
        )
    if name in ("sin", "cos", "tan", "polar"):
        return (
            "its argument is large, and the argument's rounding is a large share of a period",
            "or make the argument small before it is rounded (an offset from a recent epoch, reduced modulo 2*pi "
            "in fp64)",
        )
    if name in ("mm", "bmm", "matmul", "addmm", "baddbmm", "mv", "linear"):
        return (
            "it multiplies by a matrix whose rows nearly cancel (close to singular)",
            "or rewrite it in a form that keeps its properties in fp32 (a covariance update in the Joseph form)",
        )
    return "it amplifies the rounding of what it reads", "or rewrite it in a stable form"


def _states_finding(
    finding: Finding, states: list[str], *, span: str, left: str, before: float, after: float, on: str
) -> Finding:  # fmt: skip
    """The root's divergence whose fix is its loop's state held in fp64 (Comparison._states_checked)."""
    lines = _named(states)
    names = [n for at in states if (n := _assigned(at))]
    held = f"`{'`, `'.join(names)}`" if names else "what they assign"
    return dataclasses.replace(
        finding,
        fix=f"the error is carried by the loop's state from one step to the next, not made where it shows ({span} "
        f"in fp64 leave it at {left}): hold {held} in fp64 from the first step ({lines} update "
        f"{'it' if len(names) == 1 else 'them'}: create {'it' if len(names) == 1 else 'them'} with "
        "dtype=torch.float64, or .double() before the loop), so that every line that reads them computes in fp64 "
        "by torch's promotion while the model's weights stay in its dtype, and cast what the model returns back "
        "(`.to(x.dtype)`, x an input in the model's dtype); or carry the state as an offset from a fixed origin "
        "(its start subtracted) where its values are large beside their changes",
        evidence={**finding.evidence, "loop_state": {"lines": states, "names": names}},
        trial=Trial.checked(
            f"{lines} in fp64 from their first run, what they make read as it is (the lines that read it in fp64)",
            on=on, metric="end-to-end error", before=before, after=after,
        ),
    )  # fmt: skip


def _assigned(at: str) -> str | None:
    """The name a state line assigns (`x = x + dt * v` -> x), where it is one plain name."""
    file, _, number = at.rpartition(":")
    code = linecache.getline(file, int(number)) if number.isdigit() else ""
    target = code.split("=", 1)[0].strip() if "=" in code and "==" not in code.split("=", 1)[0] else ""
    return target if target.isidentifier() else None


def _recurrence_finding(
    finding: Finding, cycle: Recurrence, *, span: str, left: str, before: float, after: float, on: str,
    through: str = "through it",
) -> Finding:  # fmt: skip
    """The root's divergence whose fix is its recurrence kept in fp64 (Comparison._recurrence_checked)."""
    lines = _named(cycle.lines)
    fed = (  # what the recurrence reads, made in fp64 too and read so (a filter's coefficients)
        f", and {lines_text(cycle.fed)}, which make what it reads, in fp64 too, read by it as they are (not cast back)"
        if cycle.fed
        else ""
    )
    readers = ""
    if cycle.readers:  # named by number alone where the cycle's file holds them too
        files = {line.rpartition(":")[0] for line in cycle.lines + cycle.readers}
        numbers = [int(r.rpartition(":")[2]) for r in cycle.readers]
        outside = line_spans(numbers) if len(files) == 1 else _named(cycle.readers)
        reads = "reads" if len(cycle.readers) == 1 else "read"
        readers = f", and cast what {outside} {reads} of them back to the model's dtype ({BACK})"
    return dataclasses.replace(
        finding,
        fix=f"the error is carried from one run of these lines to the next (a loop's steps, or a function called on "
        f"what it made), not made where it shows ({span} in fp64 leave it at {left}): keep the recurrence "
        f"{through} in fp64 from the first run, {lines} (the fp32 operands they read from the rest of the model "
        f".double(), so that what they carry stays fp64){fed}{readers}; or rewrite the state's update in a form that "
        "keeps its properties in fp32 (a covariance as (I - KH) P (I - KH)^T + K R K^T, the Joseph form, not "
        "(I - KH) P; a sum by compensated summation)",
        evidence={
            **finding.evidence,
            "recurrence": {"lines": cycle.lines, "readers": cycle.readers, "fed": [f"{f}:{n}" for f, n in cycle.fed]},
        },
        trial=Trial.checked(
            f"{lines} in fp64 from their first run{f', with {lines_text(cycle.fed)} in fp64' if cycle.fed else ''}, "
            "the lines outside them reading their values cast back to fp32",
            on=on, metric="end-to-end error", before=before, after=after,
        ),
    )  # fmt: skip


def _named(lines: list[str]) -> str:
    """file:line names as profile.lines_text says them ("lines 36, 38-39 and 42 of f.py")."""
    return lines_text([(file, int(number)) for file, _, number in (line.rpartition(":") for line in lines)])


def _takes_down(after: float | None, before: float) -> bool:
    """A checked run's error `after` is RAISED_FALLS below `before`."""
    return after is not None and math.isfinite(after) and after * RAISED_FALLS <= before


# A module whose output error is this far above what explains it inside (and DIVERGENCE_RATIO above its
# floor) opens the search for running states, said only where one is checked to explain it
INSIDE_OPENS = 4.0


def _unexplained_inside(rows: list[ModuleRow], ratio: float) -> float | None:
    """Where the end-to-end error is not DIVERGENCE_RATIO above what explains it (the output reads the
    error diluted: through a residual, a head that takes a small share), the first container whose own
    output error is `ratio` times above all that explains it by itself up to it (every part's isolated
    error before and inside it, its floor), and DIVERGENCE_RATIO above its floor. An error its own loop
    builds up (a selective scan over 2048 steps: 0.23 at its output from parts of 0.0097 at most), which
    an output 4x below it hides. That bound; else None."""
    for at, row in enumerate(rows):
        if row.leaf or not row.module or row.propagated is None or not math.isfinite(row.propagated):
            continue
        explained = _explained(rows[: at + 1])
        if row.propagated > ratio * explained and row.propagated > DIVERGENCE_RATIO * row.floor:
            return explained
    return None


def _explained(rows: list[ModuleRow], conditioning: bool = True) -> float:
    """The largest error any part adds by itself (see _unexplained)."""
    alone = [_by_itself(r) for r in rows if r.isolated is not None and math.isfinite(r.isolated)]
    if conditioning:  # fp32's conditioning
        alone += built_up.forced(rows)
    return max([rows[-1].floor, *alone])


def _by_itself(row: ModuleRow) -> float:
    """What a part adds by itself: its isolated error, or, for a leaf whose forward holds ops of the
    user's (its own ops judged one by one) that each add DIVERGENCE_RATIO less than the leaf's re-run,
    the worst of them: what makes the rest is no op's rounding (a top-k that picks other neighbours
    from distances each a little off, a model with no submodules)."""
    assert row.isolated is not None
    own = (row.own or {}).get("error_rel") if row.leaf else None
    if own is None or not math.isfinite(own) or not row.isolated > DIVERGENCE_RATIO * max(own, row.floor):
        return row.isolated
    return max(own, row.floor)


def _fed_otherwise(row: ModuleRow, entry: _Seen) -> bool:
    """A leaf whose output is DIVERGENCE_RATIO above what its own computation, its floor and its
    floating inputs' error explain: what it got otherwise is not floating (an embedding's indices, a
    bucket a rounding picked): a selection upstream changed."""
    if not row.leaf or row.propagated is None or not math.isfinite(row.propagated):
        return False
    explained = max(row.isolated or 0.0, row.floor, entry.candidate_inputs)
    return math.isfinite(explained) and row.propagated > DIVERGENCE_RATIO * explained


def _whole_within(row: ModuleRow, entry: _Seen) -> bool:
    """The container re-run whole, as its code is written, stays within DIVERGENCE_RATIO of its floor."""
    whole = entry.isolated  # the container re-run whole (overflow suspects), where compare did
    return whole is not None and math.isfinite(whole) and whole <= DIVERGENCE_RATIO * row.floor


def _borderline(row: ModuleRow, entry: _Seen) -> bool:
    """A container whose worst own op leaves its floor alone, unconfirmed only because its output
    error grew less than DIVERGENCE_RATIO over what came in (not because its whole re-run stays
    within the floor): what a check of the fix decides (forced())."""
    unconfirmed = row.unconfirmed is not None and not _whole_within(row, entry) and not _jumped(row, entry)
    return not row.leaf and row.exceeds and unconfirmed


def _jumped(row: ModuleRow, entry: _Seen) -> bool:
    if row.propagated is None:
        return False
    if math.isinf(row.propagated):
        return not math.isinf(entry.candidate_inputs)
    return row.propagated > DIVERGENCE_RATIO * max(entry.candidate_inputs, row.floor)


def _unprefixed(name: str, prefix: str | None) -> str:
    """A module's name inside the submodule compared alone (`prefix`), as its passes saw it."""
    if not prefix:
        return name
    return "" if name == prefix else name.removeprefix(f"{prefix}.")


def _unconfirmed(row: ModuleRow, entry: _Seen) -> str | None:
    """Why the worst own op's divergence, measured on that op alone, is not the container's as
    the candidate runs its code; None when the candidate's run confirms it."""
    op = (row.own or {}).get("op") or "its worst own op"
    if _whole_within(row, entry):
        whole = entry.isolated
        return (
            f"{op} run alone in the candidate's dtype leaves the floor, but the module run whole as its code "
            f"is written stays within it ({whole:.3g} against a floor of {row.floor:.3g}): what the op loses "
            "alone does not reach the module's output (its code may compute it in another dtype, or a later op "
            "absorb it, as a softmax does a -inf score)"
        )
    if not _jumped(row, entry):
        came = "NaN/Inf" if math.isinf(entry.candidate_inputs) else f"{entry.candidate_inputs:.3g}"
        grew = (
            f"{row.propagated / entry.candidate_inputs:.2g}x"
            if math.isfinite(entry.candidate_inputs) and entry.candidate_inputs > 0 and row.propagated is not None
            else "no more than"
        )
        return (
            f"{op} run alone in the candidate's dtype leaves the floor, but in the candidate's own run this "
            f"module's output error is {grew} what came in (output error {row.propagated:.3g}, inputs' {came}), "
            f"under the {DIVERGENCE_RATIO:g}x a divergence takes: what the op loses alone reaches the module's "
            "output only in part (its code may compute it in another dtype, or a later op absorb it)"
        )
    return None


def _rows(seen: dict[tuple[str, int], _Seen], own_dtype: str) -> list[ModuleRow]:
    """The rows, in the fp64 pass's post-order; a container's isolated figure is its worst own op's."""
    rows = []
    for (name, call), e in seen.items():  # insertion order: the fp64 pass's post-order
        if e.propagated is None:
            continue  # the candidate never produced this output
        out_of_range = math.isinf(e.rounding)
        floor = max(0.0 if out_of_range else e.rounding, e.reference or 0.0, e.conditioned or 0.0, UNKNOWN_FLOOR)
        row = ModuleRow(
            name,
            call,
            e.leaf,
            e.numel,
            e.propagated,
            e.isolated,
            floor,
            e.reference,
            e.nonfinite,
            out_of_range,
            e.cosine,
            e.isolated_cosine,
            e.isolated_rows,
            isolated_of=e.isolated_of,
            input_error=e.input_error,
            rms=e.norm / math.sqrt(e.truth.numel()) if e.truth.numel() else 0.0,
            values=e.values,
            missing=e.isolated_failed,
            single=e.single,
            weighted=e.weighted,
        )
        if e.leaf and e.own is not None and e.own.worst is not None:
            # a leaf the user wrote: judged whole as every leaf is; its worst op names the line inside it
            row.own = e.own.as_dict(own_dtype)
        if not e.leaf and e.own is not None:
            # the whole re-run (where there was one) stays beside it; the output floor stays the output's
            worst = e.own.worst
            row.whole_isolated, row.own = e.isolated, e.own.as_dict(own_dtype)
            row.isolated = None if worst is None else worst.error
            row.isolated_floor = None if worst is None else worst.floor
            row.reference = None if worst is None else worst.reference
            row.isolated_cosine = None if worst is None else worst.cosine
            row.isolated_rows, row.isolated_of = worst.rows if worst is not None and worst.rows else (None, None)
            if row.exceeds:
                row.unconfirmed = _unconfirmed(row, e)
        elif e.inputs_past is not None and row.exceeds:  # non-finite on inputs no run in the format takes
            row.unconfirmed = e.inputs_past
        elif e.leaf and row.exceeds and e.wide_inputs and row.propagated <= DIVERGENCE_RATIO * floor:
            # re-run alone on inputs rounded to the format; the candidate's model feeds it wider ones (a fix
            # that makes them in fp32) and its output there stays near its floor: not its divergence
            row.unconfirmed = (
                f"re-run alone on its inputs rounded to the candidate's format it loses {row.isolated:.3g}; the "
                f"candidate's own run feeds it {e.wide_inputs} inputs, and there its output error is "
                f"{row.propagated:.3g} (floor {floor:.3g}): what it reads is made wide, and it adds nothing of its own"
            )
        rows.append(row)
    annotate(rows)
    return rows


def _beside_error(summary: list[tuple[str, str]], row: tuple[str, str]) -> None:
    """The output judged by its use, right after the end-to-end error it reads beside: a clean
    report shows its first rows only, and this is the one a user's tolerance is written in."""
    at = next((i + 1 for i, (label, _) in enumerate(summary) if label == "end-to-end error"), len(summary))
    summary.insert(at, row)


def _error_of(out: Any, root: _Seen) -> float | None:
    """A checked run's end-to-end error from its output, sampled as the fp64 run's was; None where the
    sample is not the truth's size."""
    got = device_sample(out)
    if got is None or got.numel() != root.truth.numel():
        return None
    return float((got.to(root.truth.device).double() - root.truth).norm()) / root.norm


def _refuse_sparse(model: nn.Module, sets: list[Any]) -> None:
    """A one-line error where the model holds or is given a sparse tensor: its passes sample, cast and
    compare strided tensors, and a sparse one has no storage to read."""
    held = [*model.named_parameters(), *model.named_buffers()]
    given: list[torch.Tensor] = []
    for one in sets:
        map_tensors(one, given.append)
    found = next((f"`{n}` (in the model) is {t.layout}" for n, t in held if t.layout is not torch.strided), None)
    found = found or next((f"an input is {t.layout}" for t in given if t.layout is not torch.strided), None)
    if found is not None:
        raise ValueError(
            f"compare reads dense tensors only, and {found}: hold it dense for the comparison "
            "(.to_dense(), where it fits in memory), or compare the modules before and after the sparse product"
        )


def _cured(before: float, after: float) -> bool:
    """A checked run that took the error down RAISED_FALLS times, or made a non-finite output finite."""
    return math.isfinite(after) and (not math.isfinite(before) or after * RAISED_FALLS <= before)


def _confirmed(before: float, after: float, floor: float) -> bool:
    """A borderline container's lines, checked: the end-to-end error cured (`_cured`), or down by a third
    and brought within RAISED_FALLS of its floor (a window's running sums in fp32 take 0.0123 to 0.0061, the
    rest of the model's own rounding: the divergence was what stood out)."""
    return _cured(before, after) or (math.isfinite(after) and 1.5 * after <= before and after <= RAISED_FALLS * floor)


def _proportional(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """`ours` is `theirs` times one positive constant (1 included): a model that returns its last
    layer's logits divided by a temperature decides what they decide."""
    if torch.allclose(ours, theirs, rtol=1e-6, atol=0.0):
        return True
    a, b = ours.double().reshape(-1), theirs.double().reshape(-1)
    both = (a != 0) & (b != 0)
    if int(both.sum()) < 2 or not bool(((a == 0) == (b == 0)).all()):
        return False
    ratio = a[both] / b[both]
    c = float(ratio[0])
    return math.isfinite(c) and c > 0 and bool(torch.allclose(ratio, torch.full_like(ratio, c), rtol=1e-5, atol=0.0))


def _picked(output: Any, values: torch.Tensor) -> torch.Tensor | None:
    """The indices of a (values, indices) pair the model returns as torch's topk, sort, max and kthvalue
    give them: an integer tensor of the values' shape. What it picks is the decision (a retrieval's
    top-10 documents), not the scores it picked them by."""
    found = [t for t in tensors_in(output) if integral(t) and t.dtype != torch.bool and t.shape == values.shape]
    return found[0] if len(found) == 1 and values.numel() >= 2 else None


def _ids_of(output: Any) -> torch.Tensor | None:
    """The first integer tensor of an output with no floating one, of two values or more: ids."""
    found = next((t for t in tensors_in(output) if integral(t) and t.dtype != torch.bool), None)
    return found if found is not None and found.numel() >= 2 else None
