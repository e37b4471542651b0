"""`--from` a health facts JSON whose values have the wrong kind: one line naming the field, exit 2.

Every value of a facts JSON that exercises every rule is replaced in turn by values of other
kinds; each must either be refused on load (InputError naming the field) or judged without an
exception.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from fpdoctor.health import inputs
from fpdoctor.health.collect import collect_live
from fpdoctor.health.findings import findings
from fpdoctor.health.report import build
from tests.health.fake_nvml import FakeNVML, device

DMESG = [
    "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
    "[    5.301122] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.148.08  Release Build",
    "[   10.000000] NVRM: GPU at PCI:0000:53:00: GPU-509665ad-0000-4000-8000-000000000002",
    "[   10.000001] NVRM: GPU Board Serial Number: 1654922005678",
    "[  100.000000] NVRM: Xid (PCI:0000:53:00): 13, pid=11, name=pt_main_thread, Graphics SM Warp Exception",
    "[  101.000000] NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 "
    "0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
    "[  102.000000] NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
    "(GPU Reset Required)",
    "[  103.000000] NVRM: The NVIDIA GPU 0000:b3:00.0 installed in this system has fallen off the bus and is "
    "not responding to commands.",
]


def rich_facts() -> dict[str, Any]:
    """Facts that make every HWR rule fire: two NVML GPUs (one bad), a kernel log, smi-only keys."""
    bad = device(
        bus_id="00000000:53:00.0",
        uuid="GPU-509665ad-0000-4000-8000-000000000002",
        ecc={
            ("uncorrected", "volatile"): 1,
            ("uncorrected", "aggregate"): 2,
            ("corrected", "volatile"): 0,
            ("corrected", "aggregate"): 3,
        },
        retired_pages={0: [0x1000], 1: [0x2000, 0x3000]},
        retired_pending=1,
        remapped_rows=(0, 1, 1, 1),
        clock_reasons=0x8 | 0x4,
        recovery_action=(0, 1),
    )
    facts = collect_live(nvml_module=FakeNVML([device(), bad]), readers=(("dmesg", lambda: DMESG),), host="n1")
    d = facts.to_dict()
    gpu = d["gpus"][1]
    gpu["facts"]["memory_repair"] = {"channel_repair_pending": True, "tpc_repair_pending": False}
    gpu["facts"]["ecc"]["aggregate"].update(sram_uncorrected=2, dram_uncorrected=0, sram_threshold_exceeded=True)
    gpu["unavailable"] = {"pcie_replays": "not read: Unknown Error"}
    d["gpus"].append({"index": 2, "pci": "0000:47:00.0", "source": "nvml", "facts": {},
                      "unreachable": "nvmlDeviceGetHandleByIndex(2): Unknown Error"})  # fmt: skip
    d["no_gpu"] = "nvidia-smi.txt is nvidia-smi output that says 'No devices were found'"
    return d


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _replaced(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def _removed(doc: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return doc


def _judge(doc: dict[str, Any]) -> str:
    """'refused: <message>' or the status of the report made from `doc`."""
    try:
        facts = inputs.load_json(json.dumps(doc), "facts.json")
    except inputs.InputError as exc:
        return f"refused: {exc}"
    return str(build(facts, findings(facts)).data["status"])


def test_the_rich_facts_fire_every_rule_that_facts_make():
    facts = inputs.load_json(json.dumps(rich_facts()), "facts.json")
    names = {f.name for f in findings(facts)}
    assert names == {
        "xid-error",
        "gpu-lost",
        "ecc-uncorrectable",
        "row-remap-pending",
        "row-remap-failure",
        "gpu-throttled",
        "gpu-recovery-required",
        "gpu-unreachable",
        "no-gpu-visible",
    }


WRONG = ["text", 7, 2.5, True, None, [], [1], {}, {"a": 1}]


def test_any_value_of_the_wrong_kind_is_refused_or_judged_never_a_traceback():
    doc = rich_facts()
    refused = 0
    for path in list(_paths(doc))[1:]:
        for value in WRONG:
            outcome = _judge(_replaced(doc, path, value))  # an exception here fails the test
            if outcome.startswith("refused"):
                refused += 1
                assert "\n" not in outcome and outcome.startswith("refused: facts.json ")
    assert refused > 100


def test_any_key_left_out_is_refused_or_judged_never_a_traceback():
    doc = rich_facts()
    for path in list(_paths(doc))[1:]:
        outcome = _judge(_removed(doc, path))  # an exception here fails the test
        assert "\n" not in outcome


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("gpus", 1, "facts", "ecc"), "1 uncorrected", "gpus[1].facts.ecc must be an object, got the string"),
        (("gpus", 1, "facts", "clock_event_reasons"), 8, "gpus[1].facts.clock_event_reasons must be a list"),
        (("gpus", 1, "facts", "remapped_rows"), [0, 1, 1, 0], "gpus[1].facts.remapped_rows must be an object"),
        (("gpus", 1, "unavailable", "pcie_replays"), 5, "gpus[1].unavailable.pcie_replays must be a string"),
        (("gpus", 1, "facts", "ecc", "volatile", "uncorrected"), "1", "ecc.volatile.uncorrected must be an integer"),
        (("xids", 0, "boots"), [0, "1"], "xids[0].boots[1] must be an integer"),
        (("kernel_logs", 0, "nvidia_lines"), "5", "kernel_logs[0].nvidia_lines must be an integer"),
    ],
)
def test_the_message_names_the_field(path, value, field):
    outcome = _judge(_replaced(rich_facts(), path, value))
    assert outcome.startswith("refused: facts.json has malformed health facts") and field in outcome


@pytest.mark.parametrize(
    ("facts", "field"),
    [
        ({"gpus": [{"facts": {"ecc": "x"}}]}, "gpus[0].facts.ecc"),
        ({"gpus": [{"facts": {"clock_event_reasons": 8}}]}, "gpus[0].facts.clock_event_reasons"),
        ({"gpus": [{"facts": {"remapped_rows": [0, 0, 1, 0]}}]}, "gpus[0].facts.remapped_rows"),
        ({"gpus": [{"unavailable": {"ecc": 5}}]}, "gpus[0].unavailable.ecc"),
    ],
)
def test_the_command_line_exits_2_with_one_line(cli, tmp_path, facts, field):
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(facts))
    r = cli("health", "--from", str(path))
    assert r.code == 2 and r.out == "" and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1 and field in r.err


def test_a_written_report_still_reads_back(cli, tmp_path):
    """The check accepts what `fpdoctor health -o` writes, for every rule."""
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(rich_facts()))
    out = tmp_path / "report.json"
    assert cli("health", "--from", str(path), "-o", str(out)).code == 1
    again = cli("health", "--from", str(out), "--format", "json")
    assert again.code == 1 and json.loads(again.out)["findings"] == json.loads(out.read_text())["findings"]
