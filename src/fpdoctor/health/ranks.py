"""Fingerprints compared across GPUs and ranks: groups, majorities, the outlier.

Bitwise equality of a floating-point GEMM is promised only for the same GPU model and SM count
(cuBLAS picks kernels by SM count; a MIG slice has fewer SMs), the same cuBLAS build and driver,
and here also the same torch (it chooses between cuBLAS and cuBLASLt and sizes their workspace).
Rows are grouped by those facts; within a group, the member whose digest differs from the
group's strict majority, or whose throughput is far below the group's median, is the outlier.
Members of different groups are "not comparable", never an alarm. The known answer needs no
group: it is exact everywhere, and each member is checked against it on its own; a member that
fails it (or disagrees with itself) is named for that and has no vote, and two members that
disagree are no majority.

Under torchrun the rows travel in one `all_gather_object` over gloo to every rank, which judges
them alike, then in the same group what each rank shares (`fingerprint.run_fingerprints`), from
the torchrun environment when no process group exists yet.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fpdoctor import catalog
from fpdoctor.report.model import Finding, Severity

OK, NOT_COMPARABLE, OUTLIER, MISMATCH, FAILED = "ok", "not comparable", "outlier", "mismatch", "failed"
_ORDER = {OK: 0, NOT_COMPARABLE: 1, OUTLIER: 2, MISMATCH: 3, FAILED: 4}

# Healthy GPUs of one model in one node sit within ~10% of each other in a sustained GEMM
# (gpu-fryer's default --tflops-tolerance); a few seconds of measurement adds clock ramp-up
# noise. A member below 75% of its group's median is far below, not noise.
SLOW_FRACTION = 0.75

GROUP_FIELDS = ("kind", "name", "sm_count", "mig", "cublas", "driver", "threads", "isa", "torch")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def dist_env() -> DistEnv | None:
    """This process's place under torchrun (RANK and WORLD_SIZE > 1 in the environment), else None."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world < 2:
        return None
    return DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


@contextlib.contextmanager
def process_group(dist: DistEnv | None, *, timeout_s: float) -> Iterator[Any]:
    """A gloo group over every rank (None: the default group); destroys only what it created.

    gloo even on GPU nodes: the payload is a small Python object, and an NCCL all_gather_object
    would make this process create a CUDA context next to the child that fingerprints its GPU."""
    if dist is None:
        yield None
        return
    import torch.distributed as tdist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://", timeout=timeout)
        try:
            yield None
        finally:
            tdist.destroy_process_group()
    elif tdist.get_backend() == "gloo":
        yield None
    else:
        group = tdist.new_group(backend="gloo", timeout=timeout)
        try:
            yield group
        finally:
            tdist.destroy_process_group(group)


def gather(group: Any, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's payload, in rank order, on every rank."""
    import torch.distributed as tdist

    out: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, payload, group=group)
    return [p if isinstance(p, dict) else {} for p in out]


def merge_notes(parts: list[tuple[int, list[str]]]) -> list[str]:
    """'rank 1: X', 'rank 2: X' -> 'ranks 1, 2: X'; the order of first appearance is kept."""
    by_text: dict[str, list[int]] = {}
    for rank, notes in parts:
        for note in notes:
            by_text.setdefault(note, []).append(rank)
    merged = []
    for text, who in by_text.items():
        label = f"rank {who[0]}" if len(who) == 1 else "ranks " + ", ".join(map(str, who))
        merged.append(f"{label}: {text}")
    return merged


def group_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(f) for f in GROUP_FIELDS)


def group_label(row: dict[str, Any]) -> str:
    """What must match for bitwise equality, in words."""
    if row.get("kind") == "cpu":
        parts = [row.get("name") or "cpu", row.get("isa"), f"{row.get('threads')} threads"]
    else:
        parts = [
            row.get("name") or "GPU",
            f"{row['sm_count']} SMs" if row.get("sm_count") else None,
            f"MIG {row['mig']}" if row.get("mig") else None,
            f"cuBLAS {row['cublas']}" if row.get("cublas") else None,
            f"driver {row['driver']}" if row.get("driver") else None,
        ]
    parts.append(f"torch {row['torch']}" if row.get("torch") else None)
    return " · ".join(str(p) for p in parts if p)


def place(row: dict[str, Any]) -> str:
    """'rank 2 on host n12, GPU 3 (bus 0000:1B:00.0, GPU-…)' — as much as is known."""
    text = f"host {row.get('host', '?')}"
    if row.get("rank") is not None:
        text = f"rank {row['rank']} on {text}"
    if row.get("kind") == "cuda":
        ids = ", ".join(x for x in (f"bus {row['pci']}" if row.get("pci") else None, row.get("uuid")) if x)
        text += f", GPU {row.get('index', '?')}" + (f" ({ids})" if ids else "")
    elif row.get("device"):
        text += f", {row['device']}"
    return text


def where(row: dict[str, Any]) -> dict[str, Any]:
    """Where (ARCHITECTURE.md): rank, host, device, GPU index, UUID and bus id; unknown keys are dropped later."""
    return {k: row.get(k) for k in ("rank", "host", "device", "index", "uuid", "pci")}


def _set(row: dict[str, Any], verdict: str) -> None:
    if _ORDER[verdict] > _ORDER[row.get("verdict") or OK]:
        row["verdict"] = verdict


def judge(rows: list[dict[str, Any]]) -> tuple[list[Finding], list[str]]:
    """Set each row's group and verdict; the findings and the notes that explain them."""
    findings: list[Finding] = []
    notes: list[str] = []
    for row in rows:
        row["group"] = None if "failure" in row else group_label(row)  # a failed child told nothing
        row["verdict"] = OK
    measured = []
    for row in rows:
        if "failure" in row:
            _set(row, FAILED)
            finding, note = _failure(row)
            findings.extend([finding] if finding else [])
            notes.extend([note] if note else [])
            continue
        measured.append(row)
        notes.extend(_row_notes(row))
        finding = _local_mismatch(row)
        if finding is not None:
            _set(row, MISMATCH)
            findings.append(finding)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in measured:
        groups[group_key(row)].append(row)
    for members in groups.values():
        if len(members) == 1:
            if len(measured) > 1:
                _set(members[0], NOT_COMPARABLE)
            continue
        # A member that failed its own exact checks is already named (gemm-mismatch): it has no
        # vote, so its wrong digests neither make the others outliers nor tie a vote of two.
        voters = [m for m in members if m.get("verdict") != MISMATCH]
        if len(voters) > 1:
            findings.extend(_digest_outliers(voters))
        if members[0].get("kind") == "cuda":
            findings.extend(_slow_outliers(members))
        else:
            notes.append(
                f"throughput of the {len(members)} CPU members of '{members[0]['group']}' is not compared: "
                "processes on one host share its cores"
            )
    if len(groups) > 1:
        sizes = "; ".join(f"'{m[0]['group']}': {len(m)}" for m in groups.values())
        notes.append(
            f"{len(groups)} fingerprint groups ({sizes}): digests are compared only within a group, since "
            "bitwise equality needs the same GPU model, SM count, MIG profile, cuBLAS, driver and torch"
        )
    return findings, list(dict.fromkeys(notes))


def _failure(row: dict[str, Any]) -> tuple[Finding | None, str | None]:
    failure = row["failure"]
    step = failure.get("step", "?")
    evidence = {k: failure.get(k) for k in ("signal", "returncode", "step", "seconds", "stderr_tail")}
    if failure.get("kind") == "crashed":
        message = f"The fingerprint child of {place(row)} died by {failure.get('signal')} during {step}."
        return catalog.make("probe-crashed", message=message, where=where(row), evidence=evidence), None
    if failure.get("kind") == "timeout":
        message = f"The fingerprint child of {place(row)} was still in {step} after {failure.get('seconds')} s."
        # a GPU that cannot finish a GEMM fails every job that runs on it; start-up (importing torch,
        # creating the context) can be slow for reasons of this machine rather than of the device
        kind = row.get("kind") or ("cpu" if row.get("device") == "cpu" else "cuda")
        gemm_step = kind != "cpu" and not str(step).startswith("start-up")
        if gemm_step:
            message += " A GPU that cannot finish a matrix multiply is not healthy."
        return catalog.make(
            "probe-timed-out",
            message=message,
            where=where(row),
            evidence=evidence,
            severity=Severity.ERROR if gemm_step else None,
        ), None
    return None, f"{place(row)}: fingerprint not run: {failure.get('error', 'unknown error')}"


def _row_notes(row: dict[str, Any]) -> list[str]:
    detail = row.get("detail", {})
    notes = [f"{dtype} fingerprint not run: {why}" for dtype, why in detail.get("not_run", {}).items()]
    notes += [f"{place(row)}: {step} failed: {error}" for step, error in detail.get("errors", {}).items()]
    return notes


def _local_mismatch(row: dict[str, Any]) -> Finding | None:
    """gemm-mismatch: a wrong known answer, or repeats of one seeded GEMM that disagree."""
    detail = row.get("detail", {})
    wrong = {d: r for d, r in detail.get("known_answer", {}).items() if r.get("ok") is False}
    unstable = {
        d: {k: r.get(k) for k in ("distinct", "repeats", "agreeing")}
        for d, r in detail.get("seeded", {}).items()
        if r.get("distinct", 1) > 1
    }
    if not wrong and not unstable:
        return None
    said = []
    if wrong:
        said.append(f"got the exact-integer known answer wrong in {', '.join(wrong)}")
    if unstable:
        parts = [f"{d}: {u['distinct']} different results in {u['repeats']} repeats" for d, u in unstable.items()]
        said.append(f"disagreed with itself on identical seeded GEMMs ({'; '.join(parts)})")
    message = f"{place(row)} " + " and ".join(said) + "."
    evidence = {"dtypes": sorted({*wrong, *unstable}), "known_answer": wrong or None, "repeats": unstable or None}
    return catalog.make("gemm-mismatch", message=message, where=where(row), evidence=evidence)


def _digest_outliers(members: list[dict[str, Any]]) -> list[Finding]:
    """rank-outlier for each member whose digest differs from its group's strict majority."""
    off: dict[int, dict[str, Any]] = defaultdict(dict)  # member position -> dtype -> what differs
    ties: dict[str, Counter[str]] = {}
    dtypes = sorted({d for m in members for d in m.get("digests", {})})
    for dtype in dtypes:
        votes = {i: m["digests"][dtype] for i, m in enumerate(members) if dtype in m.get("digests", {})}
        counts = Counter(votes.values())
        if len(counts) < 2:
            continue
        top, top_count = counts.most_common(1)[0]
        if 2 * top_count > len(votes):
            for i, value in votes.items():
                if value != top:
                    off[i][dtype] = {"digest": value, "majority": top, "agreeing": top_count, "compared": len(votes)}
        else:
            ties[dtype] = counts
            for i, value in votes.items():
                off[i][dtype] = {"digest": value, "majority": None, "compared": len(votes)}
    findings = []
    label = members[0]["group"]
    for i, differs in sorted(off.items()):
        row = members[i]
        _set(row, OUTLIER)
        with_majority = {d: v for d, v in differs.items() if v["majority"] is not None}
        if with_majority:
            agreeing = min(v["agreeing"] for v in with_majority.values())
            message = (
                f"{place(row)} computed the seeded {', '.join(with_majority)} GEMMs differently from "
                f"{agreeing} members of its group ({label}) that agree bit for bit."
            )
        else:
            message = (
                f"The {len(members)} members of group {label} disagree on the seeded {', '.join(differs)} GEMMs "
                f"and no majority says which is right; {place(row)} is one of them. A third GPU of the same "
                "group decides."
            )
        findings.append(
            catalog.make(
                "rank-outlier",
                message=message,
                where=where(row),
                evidence={"group": label, "group_size": len(members), "digests": differs},
                severity=None if with_majority else Severity.WARNING,
            )
        )
    return findings


def _slow_outliers(members: list[dict[str, Any]]) -> list[Finding]:
    """rank-outlier (warning) for a GPU far below its group's median throughput."""
    slow: dict[int, dict[str, Any]] = defaultdict(dict)
    dtypes = sorted({d for m in members for d in m.get("tflops", {})})
    for dtype in dtypes:
        values = {i: m["tflops"][dtype] for i, m in enumerate(members) if m.get("tflops", {}).get(dtype)}
        if len(values) < 2:
            continue
        median = statistics.median(values.values())
        for i, value in values.items():
            if value < SLOW_FRACTION * median:
                slow[i][dtype] = {"tflops": value, "group_median": round(median, 3), "ratio": round(value / median, 3)}
    findings = []
    for i, which in sorted(slow.items()):
        row = members[i]
        _set(row, OUTLIER)
        parts = [f"{d} {v['tflops']:.1f} TFLOPS, {v['ratio']:.0%} of the median" for d, v in which.items()]
        message = (
            f"{place(row)} is far slower than the other {len(members) - 1} members of its group "
            f"({members[0]['group']}): {'; '.join(parts)}."
        )
        findings.append(
            catalog.make(
                "rank-outlier",
                message=message,
                title="One GPU is far slower than its peers",
                fix="Check its clocks, power and thermal throttling (nvidia-smi -q -d PERFORMANCE) and its PCIe/"
                "NVLink state; a GPU that stays slow under the same load wants a diagnosis (dcgmi diag -r 3).",
                severity=Severity.WARNING,
                where=where(row),
                evidence={"group": members[0]["group"], "group_size": len(members), "throughput": which},
            )
        )
    return findings
