"""What the output decides, judged by the decision: compare's use metrics.

An output that holds logits feeds an argmax or a softmax. Its relative error can stay small while
the class that wins changes, when the output's norm is carried by values that take no part in the
decision (a large offset common to every class, masked classes at -1e4) or when the classes' margins
are below the candidate's spacing. So an output of logits is judged by what it decides, over its
rows (every dimension but the last): top-1 agreement with the fp64 referee, top-5 (the referee's
class among the candidate's five best) and KL(referee || candidate) of their softmax. Each beside
its floor: the same metric for the exact output rounded to the candidate's format, what any run
that returns this format loses.

Logits are told by where the output comes from: the model's last leaf call is a Linear that maps
features to classes (in_features != out_features) and its output is the model's, or the module
that made the output (that leaf, or the model's own ops after it) holds a table of one row per
class that the output has a column for (`class_table_source`: prototypes, class embeddings). An
encoder's hidden states (a LayerNorm last, or a square projection) are not judged by an argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.decide import (
    DECISION_RATIO,
    DECISION_SHARE,
    RECOVERED,
    TOP_K,
    Decisions,
    Kept,
    decisions,
    pct,
    top1,
)
from fpdoctor.precision.inputs import describe
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import integral
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Severity, Trial

# The metrics themselves live in the shared core (decide.py), for compare records too; compare and
# plan name them here as before.
__all__ = [
    "DECISION_RATIO", "DECISION_SHARE", "GIVEN", "RECOVERED", "TOP_K", "TRIED_LEAVES", "Decisions",
    "class_table_source", "coarse_finding", "decisions", "finding", "logits_source", "top1",
]  # fmt: skip


def logits_source(name: str, module: nn.Module, output: Any, *, ids: bool = False) -> str | None:
    """How the report names the logits, when the last leaf call (`name`, `module`) made them. A
    square Linear is a projection back to the model's width, unless the model reads token ids
    (`ids`: an integer input): a language model whose vocabulary is its width (256 bytes, 256 wide)."""
    if not isinstance(module, nn.Linear) or module.out_features < 2:
        return None
    if module.in_features == module.out_features and not ids:
        return None
    if not isinstance(output, torch.Tensor) or output.dim() < 1 or output.shape[-1] != module.out_features:
        return None
    where = f"`{name}`" if name else "the model"
    return f"logits of {where} (Linear {module.in_features} -> {module.out_features})"


def class_table_source(
    name: str, module: nn.Module, output: Any, *, made: dict[int, tuple[str, tuple[int, ...]]] | None = None
) -> str | None:  # fmt: skip
    """How the report names scores against a class table: `module` (the last leaf call that made
    the output, or the model whose own ops did) holds a table of one row per class, a 2-D parameter
    or buffer of its own [C, D] with D != C, and the output has C columns: a prototype classifier's
    negative distances, a cosine classifier's similarities. `made`: the 2-D outputs of the forward's
    modules by row count, where the model's own ops made the output: a text tower's class embeddings
    encoded in the forward (zero-shot scores), or 2-D inputs (GIVEN: a kNN's memory bank)."""
    if not isinstance(output, torch.Tensor) or output.dim() < 2 or output.shape[-1] < 2:
        return None
    columns = output.shape[-1]
    where = f"`{name}`" if name else "the model"
    # a plain tensor attribute too: a table kept out of the cast to the model's dtype (compare's own fix for
    # a buffer the cast rounds), so the fixed model is judged by its decisions as the broken one was
    plain = [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]
    tables = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False), *plain]
    for table, t in tables:
        if t is not None and t.dim() == 2 and t.shape[0] == columns and t.shape[1] != t.shape[0]:
            return f"scores of {where} against its `{table}` ({t.shape[0]} x {t.shape[1]}: one row per class)"
    found = (made or {}).get(columns)
    if found is not None and found[1][1] != columns:
        rows, width = found[1]
        maker = "an input's rows" if found[0] == GIVEN else f"the rows `{found[0]}` made"
        return f"scores of {where} against {maker} ({rows} x {width}: one row per class)"
    # last, an embedding of the classes held as a submodule and read whole (a recommender's item table,
    # user @ items.weight.T); an EmbeddingBag sums its rows into an input: a plain Embedding first
    for kind in (nn.Embedding, nn.EmbeddingBag):
        for child_name, child in module.named_modules():
            weight: torch.Tensor | None = child.weight if child is not module and type(child) is kind else None
            if weight is not None and weight.dim() == 2 and weight.shape[0] == columns and weight.shape[1] != columns:
                return (
                    f"scores of {where} against its `{child_name}.weight` ({weight.shape[0]} x {weight.shape[1]}: one "
                    "row per class)"
                )
    return None


# A Linear head to this many outputs or fewer may be a regression's: the decisions finding says how to say so
GUESSED_CLASSES = 16
GIVEN = ""  # class_table_source's `made`: a table the model was given as an input (a kNN's memory bank)


def reads_ids(inputs: Any) -> bool:
    """The model is fed an integer tensor (token ids, class indices): what `logits_source` weighs."""
    return any(integral(t) for t in tensors_in(inputs))


def coarse_finding(
    found: Decisions, label: str, fp32_top1: float, *, inputs: Any, head: str | None = None, ran: float | None = None,
    own: tuple[str, str, float] | None = None,
) -> Finding:  # fmt: skip
    """`output-too-coarse` for logits: rounding the exact output to the candidate's format alone
    changes DECISION_SHARE of the decisions or more (scores near 90 in bf16, spacing 0.5, margins
    below it), where the candidate's computation adds little to it (else decisions-changed speaks).
    The exact output's top-1 held in fp32 (`fp32_top1`) against rounded to `label` says the format is
    the cause; the fix is checked by a run of the candidate with `head` (the layer that makes the
    output) in fp32 returning fp32 (`ran`: its top-1), where there is such a layer; where the model's own
    code makes the scores, by the run of its own ops in fp32 around its submodules (`own`: the fix, what it
    changed, its top-1)."""
    flips = 1.0 - found.floor_top1
    adds = (
        "The computation adds little and every relative figure looks fine: the output's format is the cause."
        if 1.0 - found.top1 <= 2 * flips
        else "The computation adds to it, and would still lose these in fp32: the output's format is a cause."
    )
    message = (
        f"In {label} the output cannot hold the decisions it makes: rounding the exact output ({found.source}) to "
        f"{label} alone changes the top-1 class on {pct(flips)} of its {found.rows} rows (the candidate: "
        f"{pct(1.0 - found.top1)}), as their margins are below {label}'s spacing at those values. {adds}"
    ) + _taken(found)
    exact = (
        f"the exact output gives top-1 agreement {pct(found.floor_top1)} rounded to {label}, {pct(fp32_top1)} held in "
        "fp32"
    )
    on = inputs_text(describe(inputs))
    if head and ran is not None and found.recovered(ran, fp32_top1):  # its fix returns fp32: that floor
        # a sigmoid's scores: the head returns its logits in fp32, and the sigmoid after it then returns fp32
        returned = (
            f"returning fp32, so that the {'softmax' if 'softmax' in found.source else 'sigmoid'} after it returns "
            "fp32 probabilities"
            if found.source.startswith("probabilities")
            else "returning fp32 logits"
        )
        fix = (
            f"Return the scores in fp32: keep `{head}` in fp32, {returned}; checked: top-1 agreement "
            f"{pct(found.top1)} -> {pct(ran)} ({exact})."
        )
        trial = Trial.checked(
            f"`{head}` kept in fp32, returning fp32, the rest in {label}",
            metric="top-1 agreement with fp64", before=pct(found.top1), after=pct(ran), on=on,
        )  # fmt: skip
    elif own is not None and found.recovered(own[2], fp32_top1):
        fix = (
            f"Return the scores in fp32: {own[0][0].lower()}{own[0][1:]}; checked: top-1 agreement "
            f"{pct(found.top1)} -> {pct(own[2])} ({exact})."
        )
        trial = Trial.checked(
            own[1], metric="top-1 agreement with fp64", before=pct(found.top1), after=pct(own[2]), on=on
        )
    else:
        # no run put the fix in place (the model's own ops make the scores), or the one that did is not enough: the
        # values those ops read are already rounded, and what amplifies that rounding must be computed in fp32 too
        fix = (
            "Return the scores in fp32, computed in fp32 from what they are made of: the lines that make the output "
            "(a normalisation, a scale, the product against the table) in fp32 from their inputs (.float()), the "
            f"result not cast back ({exact})."
        )
        tried = (
            f"`{head}` kept in fp32, returning fp32, leaves top-1 agreement at {pct(ran)} (from {pct(found.top1)})"
            if head and ran is not None
            else "the model's own ops make the output: no run put the fix in place"
        )
        trial = Trial.untried(f"{tried}; {exact}")
    return catalog.make(
        "output-too-coarse",
        message=message,
        fix=fix,
        # a candidate that changes this many decisions is not one to ship, whatever the cause: exit 1 in CI
        severity=Severity.ERROR if 1.0 - found.top1 >= COARSE_ERROR else None,
        # the module the checked fix keeps in fp32, returning fp32 (plan starts from it)
        where={"module": head if trial.tried else None, "op": None},
        evidence={"kind": "decisions", "decisions": found.to_dict(), "fp32_top1": fp32_top1},
        trial=trial,
    )


def _taken(found: Decisions) -> str:
    """Where the output is taken for class scores from its last layer's shape alone (a Linear to a few
    outputs, which a regression head is too), how to say it is not."""
    if not found.source.startswith("logits of") or found.classes > GUESSED_CLASSES:
        return ""
    return (
        f" The output is taken for class scores from its last layer ({found.source}); where it is not (a "
        f'regression of {found.classes} values), `--decisions none` (decisions="none" in Python) judges it by '
        "its error alone."
    )


def kept_finding(sets: Kept, label: str, *, inputs: Any) -> Finding:
    """`decisions-changed` for a masked output (a sampler's top-p or top-k distribution, logits set to
    -inf outside the allowed tokens) whose kept sets the candidate changes, where no selection inside
    the model was found to decide them otherwise (selections.py): what changed, and no fix claimed."""
    message = (
        f"In {label} {sets.text()}: what is sampled or decided from them changes, while every relative error "
        "figure can look fine (the entries that move are small). No comparison or selection inside the model "
        "(a cumulative sum against top_p, a top-k) was found that decides otherwise in the candidate, so no "
        "line is named."
    )
    fix = (
        "Compute the filter that masks the output (its sort, cumulative sum, threshold and top-k) in fp32 from "
        "fp32 scores (.float() on the logits before it), and cast its result back where the rest reads it"
    )
    return catalog.make(
        "decisions-changed",
        message=message,
        fix=fix,
        # no selection found to explain it, no fix checked: a warning, the figures said
        severity=Severity.WARNING,
        where={"module": None, "op": None},
        evidence={"kind": "kept", "kept": sets.to_dict(), "on": inputs_text(describe(inputs))},
        trial=Trial.untried(
            "no selection inside the model was found to change the kept entries, so no run put a fix in place"
        ),
    )


COARSE_ERROR = 0.05  # output-too-coarse is an error where the candidate changes this share of the decisions

# Besides the logits' own layer, the leaves with the largest error against their floor are tried kept
# in fp32, one forward each.
TRIED_LEAVES = 2


# What compare's decisions source says of ids a top-k picked, returned beside their values
PICKED = "beside the values they were picked by"


@dataclass(frozen=True)
class CheckedFix:
    """A fix another finding of the same report checked by a run of the model (a running state kept
    in fp32, the lines that feed an ill-conditioned op computed in fp32), that run's output judged
    by what it decides: no forward of its own."""

    fix: str  # as the other finding prints it, without its own figures
    changed: str  # what its run changed, as that finding's trial says
    top1: float  # that run's top-1 agreement with fp64
    kind: str  # its evidence key: "running_state_kept" or "lines_in_fp32"
    locations: str  # the source lines it changes


def finding(
    found: Decisions, label: str, tried: list[tuple[list[str], float]], *, head: str, inputs: Any,
    checked_fixes: list[CheckedFix] | None = None,
) -> Finding:  # fmt: skip
    """`decisions-changed`: what the candidate does to the decisions, and the fix, checked: the best of
    the fixes the report's other findings checked (`checked_fixes`: each with the top-1 agreement of
    its own run) when it gives them back; else the modules kept in fp32 (`tried`: each set with the
    candidate's top-1 agreement then) that give most of them back. A fix that was tried and did not
    give them back is never printed as the fix: where none did, the next step is, not tried."""
    flipped = 1.0 - found.top1
    floor = 1.0 - found.floor_top1
    # an fp8 candidate returns its output wider than fp8: the floor rounds it to what it returns
    to = label if found.floor_format in ("", label) else f"{found.floor_format} (what {label} returns it in)"
    against = (
        f"{flipped / floor:.0f}x what rounding the exact output to {to} changes ({pct(floor)})"
        if floor > 0
        else f"where rounding the exact output to {to} changes none"
    )
    picked = found.kind == "ids" and PICKED in found.source
    if found.kind == "ids":
        ref = found.floor_top1
        first = f", first at position {found.first} (the median over the rows that differ)" if found.first else ""
        how = (
            "each is a pick among scores the model computed (a top-k): scores closer than the format's spacing "
            "swap, and a pick changes"
            if picked
            else "each is an argmax the model made, and where one made in a loop is fed back (greedy decoding), a "
            "near-tie that flips changes what follows"
        )
        message = (
            f"In {label}, the output's ids ({found.source}) differ from fp64's on {pct(flipped)} of its "
            f"{found.rows * found.classes} values{first}, where the reference model's differ on {pct(1.0 - ref)}: "
            f"{how}. Their relative error says nothing of this."
        )
    else:
        message = (
            f"In {label}, the output's top-1 class differs from fp64's on {pct(flipped)} of its {found.rows} rows, "
            f"{against}: the computation changes the decisions, whatever its relative error (KL "
            f"{found.kl:.3g} nats)."
        )
        message += _taken(found)
    on = inputs_text(describe(inputs))
    fixes = checked_fixes or []

    def names(modules: list[str]) -> str:
        return " and ".join(f"`{m}`" for m in modules)

    metric = "ids equal to fp64's" if found.kind == "ids" else "top-1 agreement with fp64"
    short = "ids equal" if found.kind == "ids" else "top-1"

    def checked(what: str, after: str) -> Trial:
        return Trial.checked(what, metric=metric, before=pct(found.top1), after=after, on=on)

    best = max(tried, key=lambda t: t[1], default=None)
    back = max((c for c in fixes if found.recovered(c.top1)), key=lambda c: c.top1, default=None)
    most = max((c for c in fixes if picked and 1 - c.top1 <= RECOVERED * flipped), key=lambda c: c.top1, default=None)
    if back is not None:
        fix = (
            f"{back.fix}, as the finding on the end-to-end error says: the same run gives the decisions back; "
            f"checked: {short} {pct(found.top1)} -> {pct(back.top1)}."
        )
        trial = checked(back.changed, pct(back.top1))
    elif best is not None and found.recovered(best[1]):
        modules, top1 = best
        output = ", returning fp32 logits" if head in modules and found.kind != "ids" else ""
        fix = (
            f"Keep {names(modules)} in fp32{output} (fpdoctor plan writes the code); checked: {short} "
            f"{pct(found.top1)} -> {pct(top1)}."
        )
        trial = checked(f"{names(modules)} kept in fp32{output}, the rest in {label}", pct(top1))
    elif most is not None:
        # a top-k's picks most of the way back, not all (a retrieval's scores in fp32 around its fp16 encoder:
        # 62.9% -> 98.6%): the rest is what the modules left in the candidate round, each near-tie among thousands
        # of documents a pick; logits' decisions keep the rule that a fix leaving them changed is no fix
        fix = (
            f"{most.fix}; checked: {short} {pct(found.top1)} -> {pct(most.top1)}, most of the way: the rest is what "
            f"the modules left in {label} round (keep them in fp32 too where every decision must match: `fpdoctor "
            "plan --metric top1` checks which)."
        )
        trial = checked(most.changed, pct(most.top1))
    elif best is not None or fixes:
        each = "; ".join(
            [*(f"{c.changed}: {pct(c.top1)}" for c in fixes), *(f"{names(m)} in fp32: {pct(t)}" for m, t in tried)]
        )
        at_best = max([c.top1 for c in fixes] + [t for _, t in tried])
        fix = (
            "No fix tried gives the decisions back: run `fpdoctor plan` for a larger set of modules and check it "
            f"by {metric}."
        )
        if label == "fp32":  # plan keeps modules in fp32, which this candidate already is
            fix = (
                "No fix tried gives the decisions back. Keeping modules in fp32 (what `fpdoctor plan` does) cannot, "
                "as the candidate is fp32: the rows above name the modules whose error is largest against their "
                "floor; compute those in fp64 (.double()) where the decisions must match fp64's."
            )
        if picked:
            fix = (
                "No fix tried gives the picks back: compute the scores and the pick in fp32 with fp32 copies of "
                "what they read (the table compared against, the queries), or keep the whole model in fp32 where "
                "the ids must match; `fpdoctor plan --metric top1` checks larger sets."
            )
        elif found.kind == "ids":  # a free-running loop parts at its first near-tie whatever is kept
            fix = (
                "No module kept in fp32 gives the ids back: a decoding loop that feeds its own argmax back parts "
                "from the reference at the first near-tie either format breaks differently, and every id after it "
                "follows. Judge each step's decision teacher-forced instead: a make() that returns the model's "
                "logits over a fixed sequence (one forward, no loop), where compare judges top-1 and KL at each "
                "position and names the module to keep; or keep the whole model in fp32 where the ids themselves "
                "must match."
            )
        trial = Trial.untried(
            f"the next step, not a fix that was tried: each one tried left {metric} at {pct(at_best)} at "
            f"best against {pct(found.top1)} ({each})"
        )
    elif label == "fp32":
        fix = (
            "Compute the modules whose error is largest against their floor (the rows above) in fp64 (.double()) "
            "where the decisions must match fp64's: keeping modules in fp32 (what `fpdoctor plan` does) is the "
            "candidate itself."
        )
        trial = Trial.untried("a module kept in fp32 is the fp32 candidate itself: no run could put a fix in place")
    elif head:
        fix = f"Keep {names([head])} in fp32, returning fp32 logits."
        trial = Trial.untried("no module of the model could be re-run in fp32 in its place")
    else:  # the scores are the model's own ops' (no submodule makes them): no module to keep
        fix = (
            "Compute the model's own ops that make the scores in fp32 (their operands .float(), the scores cast "
            "back after them): no module of the model makes them, so none can be kept in fp32 in their place."
        )
        trial = Trial.untried("the scores are made by the model's own ops, in no module a run could keep in fp32")
    return catalog.make(
        "decisions-changed",
        message=message,
        fix=fix,
        where={"module": head, "op": None},
        evidence={
            "decisions": found.to_dict(),
            "kept_in_fp32_tried": [{"modules": m, "top1": t} for m, t in tried],
            **{c.kind: {"locations": c.locations, "top1": c.top1} for c in fixes},
        },
        trial=trial,
    )
