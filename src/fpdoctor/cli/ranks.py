"""Rank files under torchrun: each rank writes its own report, and whichever rank completes the set
writes the merged one. No collective is used, so a rank that hangs or dies cannot hang the others.

`-o FILE` becomes FILE.rankN.ext for rank N (`report.write.rank_path`); beside it each rank leaves a
JSON sidecar (whatever format the user asked for) that the merge reads and then removes. Every
command that runs a user's script under a launcher (`trace`, `watch`) writes through here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fpdoctor.cli.output import UsageError, write_atomic, write_or_stderr
from fpdoctor.health.ranks import dist_env
from fpdoctor.report.write import rank_path


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    host: str
    run: str  # what makes rank files of one launch belong together
    started: float


def rank_info() -> RankInfo | None:
    """This process's place under torchrun (or any launcher setting RANK and WORLD_SIZE)."""
    dist = dist_env()
    if dist is None:
        return None
    run = ":".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    )
    return RankInfo(dist.rank, dist.world_size, dist.local_rank, socket.gethostname(), run, time.time())


def sidecar(path: str, rank: int) -> Path:
    """The JSON a rank leaves for the merge, whatever format the user asked for; removed after it."""
    p = Path(path)
    return p.with_name(f".{p.name}.rank{rank}.fpdoctor.json")


def forget_earlier(path: str | None, dist: RankInfo | None) -> None:
    """Remove this rank's sidecar left by an earlier launch that never merged (an unwritable `-o` is
    said at the end, where the report is written)."""
    if path and dist is not None:
        with contextlib.suppress(OSError):
            sidecar(path, dist.rank).unlink()


def mark(report: Any, dist: RankInfo) -> None:
    """This rank's place in its report: `data.distributed` and the summary's first line."""
    report.data["distributed"] = {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "local_rank": dist.local_rank,
        "host": dist.host,
    }
    report.data["summary"].insert(0, ("rank", f"{dist.rank} of {dist.world_size} on {dist.host}"))


def write_rank(doc: dict[str, Any], args: argparse.Namespace, dist: RankInfo) -> None:
    """This rank's FILE.rankN, its merge sidecar, and FILE itself when this rank completes the set.
    A file that cannot be written is one line on stderr and the report there instead: the exit
    status stays the script's."""
    from fpdoctor.report.render import render

    if not write_or_stderr(rank_path(args.output, dist.rank), render(doc, args.format, color=False)):
        return  # the directory will not take the sidecar and FILE either
    side = {"run": dist.run, "started": dist.started, "rank": dist.rank, "report": doc}
    try:
        write_atomic(str(sidecar(args.output, dist.rank)), render(side, "json"))
    except UsageError as exc:  # this rank's own file is written: only the merged FILE will miss it
        sys.stderr.write(f"fpdoctor: {exc}; {args.output} will not merge rank {dist.rank}\n")
        return
    merged = merge_ranks(args.output, dist)
    if merged is not None:
        write_or_stderr(args.output, render(merged, args.format, color=False))
        for r in range(dist.world_size):
            sidecar(args.output, r).unlink(missing_ok=True)


# A rank file of the same launch started within this window of ours; older ones are stale.
_SAME_LAUNCH_S = 6 * 3600


def merge_ranks(path: str, dist: RankInfo) -> dict[str, Any] | None:
    """Every rank's report as one, once each rank of this launch has left its sidecar; else None."""
    from fpdoctor.report.model import UNFINISHED, Finding, Report, Severity, Trial

    docs = []
    for r in range(dist.world_size):
        try:
            side = json.loads(sidecar(path, r).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # not written yet (or merged and removed by another rank just now)
        if side.get("run") != dist.run or abs(float(side.get("started", 0)) - dist.started) > _SAME_LAUNCH_S:
            return None
        docs.append(side["report"])
    findings = [
        Finding(
            code=f["code"],
            name=f["name"],
            severity=Severity(f["severity"]),
            title=f"rank {f.get('where', {}).get('rank', r)}: {f['title']}",
            message=f["message"],
            fix=f.get("fix", ""),
            where=f.get("where", {}),
            evidence=f.get("evidence", {}),
            references=tuple(f.get("references", ())),
            trial=Trial.from_dict(f["fix_trial"]) if isinstance(f.get("fix_trial"), dict) else None,
        )
        for r, doc in enumerate(docs)
        for f in doc.get("findings", [])
    ]
    # the same finding from several ranks (`watch`: every rank reports the faulty rank alike) once
    unique: dict[str, Finding] = {}
    for f in findings:
        key = json.dumps([f.code, f.message, f.where, f.evidence], sort_keys=True, default=str)
        unique.setdefault(key, f)
    findings = list(unique.values())
    # the failure that caused the others first: a rank that made the values before ranks that received
    # them, a rank's own error before the "connection closed by peer" of the ranks it left behind
    findings.sort(key=lambda f: f.evidence.get("origin") == "collective" or f.evidence.get("error_kind") == "peer-gone")
    ranks = [
        {
            "rank": doc["data"].get("distributed", {}).get("rank", r),
            "host": doc["data"].get("distributed", {}).get("host"),
            "verdict": doc.get("verdict"),
            "findings": len(doc.get("findings", [])),
            "file": rank_path(path, r),
            "not_checked": doc["data"].get("not_checked", {}),
        }
        for r, doc in enumerate(docs)
    ]
    bad = [str(x["rank"]) for x in ranks if x["verdict"] != "ok"]
    summary = [
        ("ranks", f"{dist.world_size} ({', '.join(sorted({str(x['host']) for x in ranks}))})"),
        ("ranks with findings", ", ".join(bad) or "none"),
    ]
    # a rank cut short (terminated, stopped) was not judged to its end: nor is the job, never "ok"
    cut = [str(x["rank"]) for x, doc in zip(ranks, docs, strict=True) if doc["data"].get("status") in UNFINISHED]
    if cut:
        summary.insert(0, ("ended", f"rank(s) {', '.join(cut)} did not run to the end: see their reports"))
    merged = Report(
        command=str(docs[0].get("command", "trace")),
        findings=findings,
        data={
            "summary": summary,
            "distributed": {"world_size": dist.world_size, "merged": True},
            **({"status": "incomplete"} if cut else {}),
            "ranks": ranks,
            "table": {
                "title": "ranks",
                "columns": ["rank", "host", "verdict", "findings", "file"],
                "rows": [
                    [str(x["rank"]), str(x["host"]), str(x["verdict"]), str(x["findings"]), x["file"]] for x in ranks
                ],
            },
        },
    )
    return merged.to_dict()
