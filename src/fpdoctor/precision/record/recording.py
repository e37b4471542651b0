"""How compare() makes a compare record from its run, and writes it or judges against one.

`Link` is what compare() holds while it runs with `save_reference=` or `against=`: it settles
the run's settings first (against a record they are the record's), and once every input set
is judged, turns the run into a CompareRecord: per module call compare's own samples and row
numbers, per input set its description and the digest of the random draws the forward made,
per module a digest of its own parameters and buffers, and the machine's facts; and when the
output is logits, its decisions (decision_record: what the use metrics need of it). Machine A
saves it; machine B judges its own against A's (against.py) and adds that to the report
(against_report.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import model_device
from fpdoctor.precision.decide import TOP_K, agreement, kl, logit_rows
from fpdoctor.precision.metrics import SAMPLE, all_finite, l2_norm, round_to
from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, REFERENCES, check_name
from fpdoctor.precision.profile import CompareResult, ModuleRow
from fpdoctor.precision.record import against as judging
from fpdoctor.precision.record import against_report, machine
from fpdoctor.precision.record.record import (
    VERSION,
    CallRecord,
    CompareRecord,
    DecisionRecord,
    SetRecord,
    Settings,
    decided_rows,
    kept_rows,
    spread,
)
from fpdoctor.precision.scope import find_module


class Samples(list[tuple[ModuleRow, torch.Tensor, torch.Tensor | None]]):
    """(row, compare's fp64 sample, the candidate's sample) per judged module call, as compare_set
    gives them; and `decided`, the output's decisions when it is logits (decision_record)."""

    decided: DecisionRecord | str | None = None


# Without a candidate, a record is of the model's own precision: what a machine's kernels change
# (TF32, reduced-precision reductions, another summation order) shows there first.
RECORD_CANDIDATE = "fp32"


def thin(sample: torch.Tensor) -> torch.Tensor:
    """SAMPLE values evenly spread over a longer sample, first and last included. Integer
    arithmetic: both machines pick the same positions from samples of one length, whatever
    their torch (a float linspace may round an index the other way)."""
    n = sample.numel()
    if n <= SAMPLE:
        return sample
    return sample[spread(n, SAMPLE).to(sample.device)]


def decision_record(
    source: str | None, truth: torch.Tensor | None, candidate: torch.Tensor | None, fmt: str
) -> DecisionRecord | str | None:
    """What the use metrics need of an output of logits (`source`: use.logits_source; None when the
    output is not logits): per decided row the fp64 class, the candidate's class and its TOP_K
    best; the decided rows' top-1 floor, and the kept rows whole with their KL floor. The floors
    round the whole output to the candidate's format (an fp8 scale is the whole tensor's), as
    compare's own do. A string says why an output of logits has none."""
    if source is None or truth is None:
        return None
    if candidate is None or candidate.shape != truth.shape:
        return "the candidate's output was not kept whole"
    rows = logit_rows(truth, candidate)
    if rows is None:
        return "the candidate's logits hold NaN or Inf" if not all_finite(candidate) else "the output has no rows"
    ref, cand = rows
    n, classes = ref.shape
    rounded = round_to(ref, fmt)
    decided = decided_rows(n)
    if decided < n:  # else every row, without copying the logits to gather them
        at = spread(n, decided).to(ref.device)
        ref, cand, rounded = ref[at], cand[at], rounded[at]
    keep = spread(decided, kept_rows(n, classes)).to(ref.device)
    best = ref.argmax(-1)
    return DecisionRecord(
        source=source,
        rows=n,
        classes=classes,
        floor_top1=agreement(rounded, best),
        floor_kl=kl(ref[keep], rounded[keep]),
        truth_top1=best.to(torch.int32).cpu(),
        candidate_top1=cand.argmax(-1).to(torch.int32).cpu(),
        candidate_topk=cand.topk(min(TOP_K, classes), -1).indices.to(torch.int32).cpu(),
        truth_rows=ref[keep].cpu(),
        candidate_rows=cand[keep].to(torch.float32).cpu(),
    )


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes in memory order, without numpy."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    data = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return ctypes.string_at(data.data_ptr(), data.numel())


def weight_digests(model: nn.Module, prefix: str | None) -> dict[str, str]:
    """Per module, sha256 of its own parameters and buffers (name, dtype, shape, values; not its
    submodules'), so a changed weight is named where it is, not in every container above it."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        own = [
            (n, t)
            for n, t in itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
            if t is not None
        ]
        if not own:
            continue
        h = hashlib.sha256()
        for n, t in own:
            h.update(f"{n}:{t.dtype}:{list(t.shape)}".encode())
            if t.device.type != "meta":
                h.update(_raw(t))
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        found[full] = h.hexdigest()[:16]
    return found


def noise_digest(draws: list[torch.Tensor] | None) -> str | None:
    """Digest of the random draws a forward made itself (noise.py), None when it made none."""
    if not draws:
        return None
    h = hashlib.sha256()
    for d in draws:
        h.update(f"{d.dtype}:{list(d.shape)}".encode())
        h.update(_raw(d))
    return h.hexdigest()[:16]


def call_records(samples: Samples) -> tuple[tuple[CallRecord, ...], int]:
    """The record's module calls, and how many were left out (no finite fp64 output to judge by)."""
    calls, skipped = [], 0
    for row, truth, candidate in samples:
        if candidate is None or candidate.numel() != truth.numel():
            continue  # compare made no row of it either
        t, c = thin(truth), thin(candidate).to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            skipped += 1
            continue
        calls.append(
            CallRecord(
                module=row.module,
                call=row.call,
                leaf=row.leaf,
                numel=row.numel,
                norm=l2_norm(t),
                floor=row.floor,
                propagated=row.propagated,
                isolated=row.isolated,
                reference=row.reference,
                nonfinite=row.nonfinite,
                truth=t,
                candidate=c,
            )
        )
    return tuple(calls), skipped


@dataclass
class Link:
    """A compare run that writes a record (`save_to`) or is judged against one (`record`)."""

    save_to: Path | None = None
    record: CompareRecord | None = None

    @classmethod
    def open(cls, save_reference: str | os.PathLike[str] | None, against: Any) -> Link:
        """Before the run: the record loaded and checked, or the path to write checked."""
        if save_reference is not None and against is not None:
            raise ValueError(
                "save_reference and against exclude each other: make the record on one machine, judge on the other"
            )
        if against is not None:
            if not isinstance(against, (str, os.PathLike, CompareRecord)):
                raise TypeError(f"against must be a path or a CompareRecord, not {type(against).__name__}")
            record = against if isinstance(against, CompareRecord) else CompareRecord.load(against)
            return cls(record=record)
        target = Path(save_reference)  # type: ignore[arg-type]
        if target.is_dir():
            raise ValueError(f"{target} is a directory; give a file name for the record")
        if not target.parent.exists():
            raise ValueError(f"{target.parent} does not exist; create it or choose another path for the record")
        return cls(save_to=target)

    def settings(
        self,
        *,
        candidate: str | None,
        reference: str | None,
        fp8_kernel: str | None,
        device: str | None,
        module: str | None,
    ) -> Settings:
        """The run's settings. Against a record they are the record's: one given that differs is a
        ValueError saying so (the two runs would not judge the same thing). `device` may differ:
        it says where this machine runs the candidate, and defaults to where the record's ran."""
        if self.record is None:
            return Settings(
                check_name(candidate or RECORD_CANDIDATE, CANDIDATES, "candidate"),
                check_name(reference or "fp32", REFERENCES, "reference"),
                check_name(fp8_kernel or "auto", FP8_KERNELS, "fp8 kernel"),
                device,
                module,
            )
        made = self.record.settings
        for flag, given, recorded, allowed in (
            ("candidate", candidate, made.candidate, CANDIDATES),
            ("reference", reference, made.reference, REFERENCES),
            ("fp8-kernel", fp8_kernel, made.fp8_kernel, FP8_KERNELS),
        ):
            if given is not None and check_name(given, allowed, flag.replace("-", " ")) != recorded:
                raise ValueError(
                    f"the record was made with --{flag} {recorded}, not {given}: omit --{flag} (the record's is "
                    f"used) or make a new record with --{flag} {given}"
                )
        if module is not None and module != made.module:
            was = f"--module {made.module}" if made.module else "the whole model"
            raise ValueError(
                f"the record was made with {was}, not --module {module}: omit --module or make a new record"
            )
        return Settings(made.candidate, made.reference, made.fp8_kernel, device or made.device, made.module)

    def finish(
        self,
        result: CompareResult,
        *,
        model: nn.Module,
        settings: Settings,
        described: list[dict[str, Any]],
        results: list[CompareResult],
        samples: list[Samples],
    ) -> None:
        """After the run: write the record, or judge this run against it; both say so in the report."""
        mine = self.build(result, model=model, settings=settings, described=described, results=results,
                          samples=samples)  # fmt: skip
        report = result.report
        if self.save_to is not None:
            size = mine.save(self.save_to)
            report.data["record"] = {
                "path": str(self.save_to), "bytes": size, "calls": mine.calls, "format": VERSION,
                "skipped": mine.skipped,
            }  # fmt: skip
            sets = f" in {len(mine.sets)} input sets" if len(mine.sets) > 1 else ""
            report.data["summary"].append(
                (
                    "compare record",
                    f"{self.save_to}: {mine.calls} module calls{sets}, {_size(size)}; on another machine: "
                    f"fpdoctor compare MODEL --against {self.save_to.name}",
                )
            )
            return
        assert self.record is not None
        against_report.apply(report, judging.judge(self.record, mine), source=self.record.source)

    def build(
        self,
        result: CompareResult,
        *,
        model: nn.Module,
        settings: Settings,
        described: list[dict[str, Any]],
        results: list[CompareResult],
        samples: list[Samples],
    ) -> CompareRecord:
        target = find_module(model, settings.module) if settings.module else model
        on = torch.device(settings.device) if settings.device else model_device(target)
        sets, skipped = [], 0
        for d, r, s in zip(described, results, samples, strict=True):
            calls, left_out = call_records(s)
            skipped += left_out
            sets.append(SetRecord(d, noise_digest(r.noise), calls, s.decided))
        return CompareRecord(
            settings=settings,
            machine=machine.facts(on, result.report.data) | _variables(),
            weights=weight_digests(target, settings.module),
            sets=tuple(sets),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            skipped=skipped,
        )


def _variables() -> dict[str, machine.Fact]:
    """The environment variables that change math or kernels (`fpdoctor env --diff`'s table), so
    that `--against` can say which differ between the two machines."""
    from fpdoctor.env.differences import recorded_variables

    return {judging.ENV_PREFIX + k: v for k, v in recorded_variables(dict(os.environ)).items()}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
