"""The sentinel's join with GPU health: what changed on its GPU between the job's start and a fault."""

from __future__ import annotations

from fpdoctor.health import watch
from fpdoctor.health.kernel_log import XidGroup
from fpdoctor.health.model import GpuFacts, HealthFacts
from fpdoctor.numerics.training.findings import verdict_findings
from fpdoctor.numerics.training.replay import ReplayResult

UUID, PCI = "GPU-5c0f0e3a-0000-4000-8000-000000000001", "0000:52:00.0"


def _facts(*, xids: int = 0, uncorrected: int = 0, pending: bool = False) -> HealthFacts:
    gpu = GpuFacts(
        index=3,
        pci=PCI,
        uuid=UUID,
        name="NVIDIA H100 80GB HBM3",
        facts={
            "ecc": {"volatile": {"uncorrected": uncorrected, "corrected": 0}},
            "remapped_rows": {"pending": pending, "failure": False},
        },
    )
    groups = [XidGroup(pci=PCI, xid=48, count=xids, first_seen=None, last_seen="2026-11-23T09:10:00", boots=[0])]
    return HealthFacts(gpus=[gpu], xids=groups if xids else [])


def test_new_xids_and_ecc_errors_since_the_start_are_named():
    w = watch.start(UUID, read=lambda: _facts(xids=1))
    changes = watch.since(w, read=lambda: _facts(xids=3, uncorrected=2, pending=True))
    assert changes.any and changes.gpu == f"GPU 3 (0000:52:00.0, NVIDIA H100 80GB HBM3, {UUID})"
    assert [(x["xid"], x["count"]) for x in changes.xids] == [(48, 2)]  # only the new ones
    assert changes.ecc == {"volatile.uncorrected": 2} and changes.remap_pending
    assert "Xid 48 x2" in changes.text() and "ECC volatile.uncorrected +2" in changes.text()


def test_nothing_new_is_said_as_such_and_unreadable_is_not_healthy():
    w = watch.start(UUID, read=lambda: _facts(xids=1))
    same = watch.since(w, read=lambda: _facts(xids=1))
    assert not same.any and "no new Xid error" in same.text()

    def broken() -> HealthFacts:
        raise RuntimeError("NVML did not answer")

    blind = watch.since(watch.start(UUID, read=broken), read=_facts)
    assert not blind.any and blind.not_checked and "not checked" in blind.text()
    gone = watch.since(w, read=lambda: HealthFacts(not_checked={"NVML": "NVML not available: driver not loaded"}))
    assert gone.not_checked == ["NVML not available: driver not loaded"]


def test_a_transient_fault_carries_the_gpus_health_and_a_drain_fix():
    changes = watch.since(watch.start(UUID, read=_facts), read=lambda: _facts(xids=2))
    me = {"host": "node7", "device": "cuda:3", "gpu": "NVIDIA H100 80GB HBM3", "uuid": UUID}
    (finding,) = verdict_findings(
        80, ReplayResult("transient-fault-suspected", loss=2.5), me, micro_batches=False, kind="nan", health=changes
    )
    assert finding.name == "transient-fault-suspected"
    assert "GPU health: since the job started, GPU 3" in finding.message and "Xid 48 x2" in finding.message
    assert finding.evidence["gpu_health"]["xids"][0]["xid"] == 48
    assert finding.fix.startswith("Drain GPU 3 (0000:52:00.0")
    quiet = watch.since(watch.start(UUID, read=_facts), read=_facts)
    (plain,) = verdict_findings(
        80, ReplayResult("transient-fault-suspected", loss=2.5), me, micro_batches=False, kind="nan", health=quiet
    )
    assert "no new Xid error" in plain.message and not plain.fix.startswith("Drain")


def test_only_what_was_read_at_both_moments_is_compared():
    blind_start = HealthFacts(
        gpus=[GpuFacts(index=0, pci=PCI, uuid=UUID, unavailable={"ecc": "not read: Unknown Error"})]
    )
    lifetime = _facts(uncorrected=3, pending=True)
    changes = watch.since(watch.start(UUID, read=lambda: blind_start), read=lambda: lifetime)
    assert changes.ecc == {} and not changes.remap_pending  # lifetime counts are not "new"
    already = watch.since(watch.start(UUID, read=lambda: _facts(pending=True)), read=lambda: _facts(pending=True))
    assert not already.remap_pending  # pending before the job started


def test_new_xids_are_seen_when_the_ring_buffer_rotated_old_ones_out():
    def at(first: str, last: str, until: str) -> HealthFacts:
        facts = _facts()
        facts.xids = [XidGroup(pci=PCI, xid=79, count=2, first_seen=first, last_seen=last, boots=[0])]
        facts.kernel_logs = [{"source": "dmesg", "until": until}]
        return facts

    start = at("2026-11-23T08:00:00", "2026-11-23T08:01:00", "2026-11-23T09:00:00")
    rotated = at("2026-11-23T10:00:00", "2026-11-23T10:05:00", "2026-11-23T10:06:00")  # same count, later lines
    changes = watch.since(watch.start(UUID, read=lambda: start), read=lambda: rotated)
    assert [x["xid"] for x in changes.xids] == [79] and "count" not in changes.xids[0]
    assert "Xid 79 x?" in changes.text()
    same = watch.since(watch.start(UUID, read=lambda: start), read=lambda: start)
    assert not same.xids
