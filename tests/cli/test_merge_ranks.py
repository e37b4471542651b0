"""The merged report of a torchrun job (`cli/ranks.merge_ranks`): never OK when a rank was cut
short, and the failure that caused the others first (a rank's own error before the ranks that lost
their peer)."""

from __future__ import annotations

import json
import time

from fpdoctor.cli.ranks import RankInfo, merge_ranks, sidecar


def _leave(path: str, dist: RankInfo, rank: int, report: dict) -> None:
    side = {"run": dist.run, "started": dist.started, "rank": rank, "report": report}
    sidecar(path, rank).write_text(json.dumps(side))


def _report(findings: list[dict] | None = None, **data) -> dict:
    return {"command": "watch", "verdict": "ok", "findings": findings or [], "data": {"summary": [], **data}}


def _error(rank: int, text: str, kind: str | None = None) -> dict:
    evidence = {"exception": "RuntimeError", "error": text} | ({"error_kind": kind} if kind else {})
    return {"code": "CRS010", "name": "uncaught-exception", "severity": "error", "title": f"raised {text}",
            "message": text, "where": {"rank": rank}, "evidence": evidence, "fix": "look",
            "fix_trial": {"status": "not-tried", "reason": "a change to the script"}}  # fmt: skip


def test_a_job_whose_ranks_were_terminated_is_incomplete_never_ok(tmp_path):
    path = str(tmp_path / "w.json")
    dist = RankInfo(rank=0, world_size=3, local_rank=0, host="h", run="r", started=time.time())
    for r in range(3):
        _leave(path, dist, r, _report(status="incomplete"))
    merged = merge_ranks(path, dist)
    assert merged is not None and merged["data"]["status"] == "incomplete"
    assert merged["verdict"] != "ok"
    assert dict(map(tuple, merged["data"]["summary"]))["ended"].startswith("rank(s) 0, 1, 2 did not run")


def test_the_rank_that_raised_leads_the_ranks_that_lost_their_peer(tmp_path):
    path = str(tmp_path / "w.json")
    dist = RankInfo(rank=0, world_size=3, local_rank=0, host="h", run="r", started=time.time())
    peer = "Connection closed by peer [127.0.0.1]:1234"
    _leave(path, dist, 0, _report([_error(0, peer, "peer-gone")]))
    _leave(path, dist, 1, _report([_error(1, "rank1 exploded")]))
    _leave(path, dist, 2, _report([_error(2, peer, "peer-gone")]))
    merged = merge_ranks(path, dist)
    assert merged is not None and merged["findings"][0]["where"]["rank"] == 1
    assert "status" not in merged["data"]
