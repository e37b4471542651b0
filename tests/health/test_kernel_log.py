"""Kernel-log parsing: every real line of research notes A.6 and every shape of A.2."""

from __future__ import annotations

import pytest

from fpdoctor.health import kernel_log, nvlink5
from tests.conftest import FIXTURES

HEALTH = FIXTURES / "health"


def one(line: str) -> kernel_log.XidEvent:
    log = kernel_log.parse([line])
    assert log.unreadable == [] and len(log.xids) == 1, line
    return log.xids[0]


# (line, pci, xid, pid, process, wall time, uptime) - the A.6 lines verbatim, sources in the fixture README
A6 = [
    (
        "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 NVRM: Xid (PCI:0000:38:00): 13, pid='<unknown>', "
        "name=<unknown>, Graphics SM Global Exception on (GPC 8, TPC 5, SM 1): Multiple Warp Errors",
        "0000:38:00.0",
        13,
        None,
        None,
        "2025-01-21T04:41:44.283302+00:00",
        None,
    ),
    (
        "kern  :warn  : 2025-01-21T04:41:44,287197+00:00 NVRM: Xid (PCI:0000:38:00): 43, pid=2924364, "
        "name=pt_main_thread, Ch 00000008",
        "0000:38:00.0",
        43,
        2924364,
        "pt_main_thread",
        "2025-01-21T04:41:44.287197+00:00",
        None,
    ),
    (
        "[Wed Jan 27 23:04:35 2021] NVRM: Xid (PCI:0000:3d:00): 43, pid=35521, Ch 00000008",
        "0000:3d:00.0",
        43,
        35521,
        None,
        "2021-01-27T23:04:35",
        None,
    ),
    (
        "[Fri Jan 29 23:42:34 2021] NVRM: Xid (PCI:0000:db:00): 31, pid=13641, Ch 00000008, intr 00000000. MMU "
        "Fault: ENGINE GRAPHICS GPCCLIENT_T1_10 faulted @ 0x7fd7_90743000. Fault is of type FAULT_PDE "
        "ACCESS_TYPE_VIRT_READ",
        "0000:db:00.0",
        31,
        13641,
        None,
        "2021-01-29T23:42:34",
        None,
    ),
    (
        "[22859.081860] NVRM: Xid (PCI:0000:01:00): 31, pid=14292, name=python, Ch 00000030, intr 00000000. MMU "
        "Fault: ENGINE HOST0 HUBCLIENT_ESC faulted @ 0x10_00200000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        "0000:01:00.0",
        31,
        14292,
        "python",
        None,
        22859.08186,
    ),
    (
        "[14370.687545] NVRM: Xid (PCI:0000:0a:00): 62, pid='<unknown>', name=<unknown>, 2023b230 20238a3a "
        "2023e8b6 2023eac4 2023ec3c 2023ea86 00000000 00000000",
        "0000:0a:00.0",
        62,
        None,
        None,
        None,
        14370.687545,
    ),
    (
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
        "0000:10:1c.0",
        63,
        1896,
        None,
        None,
        None,
    ),
    (
        "NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link "
        "14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        "0003:00:00.0",
        74,
        None,
        None,
        None,
        None,
    ),
    (
        "NVRM: Xid (PCI:0000:66:00): 32, pid=2280636, name=train.3, Channel ID 0000000d intr0 00040000",
        "0000:66:00.0",
        32,
        2280636,
        "train.3",
        None,
        None,
    ),
    (
        "[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after "
        "6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).",
        "0000:9b:00.0",
        119,
        2024380,
        "nvidia-smi",
        "2025-02-23T16:24:18",
        None,
    ),
    (
        "NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2,0x1). RST: Yes, D-RST: No",
        "0000:01:00.0",
        95,
        7062,
        None,
        None,
        None,
    ),
]


@pytest.mark.parametrize("case", A6, ids=lambda c: f"xid{c[2]}-{c[1]}")
def test_real_lines_parse(case):
    line, *want = case
    e = one(line)
    assert [e.pci, e.xid, e.pid, e.process, e.stamp.wall, e.stamp.uptime] == want
    assert e.message.startswith("NVRM: Xid")
    assert e.detail and "pid=" not in e.detail and "name=" not in e.detail


def test_the_a6_fixture_parses_completely():
    log = kernel_log.parse((HEALTH / "a6_kernel_lines.log").read_text().splitlines())
    assert (log.lines, log.nvidia_lines, len(log.xids), log.unreadable, log.truncated) == (16, 16, 16, [], None)


def test_mig_form_names_the_gpu_instance():
    e = one("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No")
    assert (e.pci, e.xid, e.gpu_instance, e.pid) == ("0000:01:00.0", 94, 5, 7194)
    e = one("NVRM: Xid (PCI:0000:01:00 GPU-I:02 GPU-CI:01): 13, pid=1, name=python, Graphics Exception")
    assert (e.gpu_instance, e.compute_instance, e.process) == (2, 1, "python")


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:0000:3f:00): 46",  # NVSentinel csv_test.go: no comma, nothing after the code
        "NVRM: Xid (PCI:0000:3f:00): 46\n",
        "[  219.470994] NVRM: Xid (PCI:0000:3f:00): 46",
        "NVRM: Xid (0000:3f:00): 46, Channel 00000001",  # older drivers: no "PCI:"
        "NVRM: Xid (PCI:0000:3f:00.0): 46, pid=12345, GPU stopped processing",  # with the function (NVSentinel)
    ],
)
def test_no_comma_and_no_pci_prefix(line):
    e = one(line)
    assert (e.pci, e.xid) == ("0000:3f:00.0", 46)


@pytest.mark.parametrize(
    ("prefix", "uptime", "wall", "host"),
    [
        ("[ 12345.678901] ", 12345.678901, None, None),
        ("[Sun Feb 23 16:24:18 2025] ", None, "2025-02-23T16:24:18", None),
        ("kern  :warn  : 2025-01-21T04:41:44,283302+00:00 ", None, "2025-01-21T04:41:44.283302+00:00", None),
        (
            "2025-01-21T04:41:44,283302+00:00 ",
            None,
            "2025-01-21T04:41:44.283302+00:00",
            None,
        ),  # dmesg --time-format iso
        (
            "Dec  2 11:38:47 worker4 kernel: [  219.470994] ",
            219.470994,
            "Dec 2 11:38:47",
            "worker4",
        ),  # gpu-operator#1146
        ("Dec  2 11:38:47 worker4 kernel: ", None, "Dec 2 11:38:47", "worker4"),  # journalctl short
        ("2025-01-21T04:41:44+0000 gpu-node-3 kernel: ", None, "2025-01-21T04:41:44+00:00", "gpu-node-3"),  # short-iso
        (
            "2025-01-21T04:41:44.283302+00:00 gpu-node-3 kernel: ",
            None,
            "2025-01-21T04:41:44.283302+00:00",
            "gpu-node-3",
        ),
        ("[  219.470994] gpu-node-3 kernel: ", 219.470994, None, "gpu-node-3"),  # journalctl -o short-monotonic
        ("4,3964,206764307,-;", 206.764307, None, None),  # /dev/kmsg record
        ("", None, None, None),  # pasted without any prefix
    ],
)
def test_every_timestamp_shape(prefix, uptime, wall, host):
    e = one(prefix + "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    assert (e.stamp.uptime, e.stamp.wall, e.host, e.pci, e.xid) == (uptime, wall, host, "0000:3b:00.0", 79)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("PCI:0000:3b:00", "0000:3b:00.0"),
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:00:08.0", "0000:00:08.0"),
        ("3b:00.0", "0000:3b:00.0"),
        ("0018:01:00", "0018:01:00.0"),
    ],
)
def test_bus_ids_normalise(text, want):
    assert kernel_log.normalize_pci(text) == want


@pytest.mark.parametrize("text", ["", "  ", "unknown", "0000:3b", "0000:zz:00.0", "1:2:3:4:5", "N/A"])
def test_text_that_is_no_bus_id_is_kept_as_given(text):
    assert kernel_log.normalize_pci(text) == text.strip()


# leptonai/gpud components/accelerator/nvidia/xid/kmsg_extended_test.go (GB200 NVLink5 lines) and
# NVIDIA/NVSentinel csv_test.go (the same line decoded per driver branch)
NVL5 = [
    (
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 0x00000000 "
        "0x00000000 0x00000000 0x00000000)",
        "NETIR_BER_EVENT",
        "Nonfatal",
        3,
        0x00086226,
        0x1,
        0,
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 145, pid=876767, name=ray::WorkerDict, RLW_RXPIPE Nonfatal XC0 i0 Link 13 "
        "(0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)",
        "RLW_RXPIPE",
        "Nonfatal",
        13,
        0x0409A0C2,
        0x8,
        0,
    ),
    (
        "NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 "
        "0x00000000 0x00000000)",
        "NETIR",
        "Fatal",
        -1,
        0x000FE406,
        0x0,
        0,
    ),
    (
        "NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x00000000 "
        "0x00000000 0x00000000 0x00000000)",
        "NETIR_LINK_EVT",
        "Fatal",
        8,
        0x004505C6,
        0x0,
        4,
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 "
        "0x00000000 0x00000000 0x00000000)",
        "NETIR_LINK_EVT",
        "Fatal",
        9,
        0x025525C6,
        0x0,
        37,
    ),
]


@pytest.mark.parametrize("case", NVL5, ids=lambda c: f"{c[1]}-link{c[3]}")
def test_nvlink5_extended_form(case):
    line, unit, severity, link, intrinfo, status, sub = case
    nv = one(line).nvlink
    assert nv == {"unit": unit, "line_severity": severity, "link": link, "intrinfo": intrinfo, "error_status": status}
    assert nvlink5.sub_code(intrinfo) == sub


def test_nvlink5_decode_follows_the_driver_branch():
    # NVSentinel TestCSVParser_NVL5PerMessageDriverVersionSelection: 0x82 matches only V1, 0x04 only V2
    v1 = nvlink5.decode(145, "RLW_REMAP", 0x82, 0x40, "570.148.08")
    assert (v1["action"], v1["severity"], v1["table"]) == ("RESET_GPU", "Fatal", "v1")
    assert "no row" in str(nvlink5.decode(145, "RLW_REMAP", 0x82, 0x40, "580.105.08")["note"])
    v2 = nvlink5.decode(145, "RLW_REMAP", 0x04, 0x40, "580.105.08")
    assert (v2["action"], v2["table"]) == ("RESET_GPU", "v2")
    assert "no row" in str(nvlink5.decode(145, "RLW_REMAP", 0x04, 0x40, "570.148.08")["note"])
    # CSV test: NETIR_LINK_EVT sub-code 37 on a pre-R575 driver -> reset (COMPONENT_RESET)
    d = nvlink5.decode(149, "NETIR_LINK_EVT", 0x025525C6, 0, "570.148.08")
    assert (d["unit"], d["action"], d["investigate"]) == (
        "NETIR_LINK_EVT/NETIR_LINK_DOWN",
        "RESET_GPU",
        "INVESTIGATE_PEER_DEVICE",
    )


def test_nvlink5_decode_says_when_the_driver_is_unknown():
    d = nvlink5.decode(145, "RLW_REMAP", 0x82, 0x40, None)
    assert d["table"] == "v1" and "driver version unknown" in str(d["note"]) and "only the v1" in str(d["note"])
    assert nvlink5.decode(145, "RLW_REMAP", 0xFFFFFFFF, 0x40, None) == {
        "note": "driver version unknown, and no row of either decode table matches this line"
    }


def test_nvlink5_group_uses_the_logged_driver():
    lines = [
        "[    5.301122] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.148.08  Release Build  "
        "(dvs-builder@U16-I3-B17-1-1)  Thu Jan 23 22:51:45 UTC 2025",
        "[  100.000000] NVRM: Xid (PCI:0000:00:08.0): 145, RLW_REMAP Nonfatal XC1 i0 Link 10 (0x00000082 0x00000040 "
        "0x00000000 0x00000000 0x00000000 0x00000000)",
    ]
    log = kernel_log.parse(lines)
    assert log.drivers == ["570.148.08"] and log.xids[0].driver == "570.148.08"
    (g,) = kernel_log.group(log.xids, driver="580.105.08")  # the log's own driver wins over the fallback
    assert g.nvlink[0]["decode"]["table"] == "v1" and g.nvlink[0]["decode"]["action"] == "RESET_GPU"


def test_fallen_off_the_bus_without_xid_multiline():
    # NVSentinel gpufallen_handler_test.go (issue #155): three lines, no Xid
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
    ]
    log = kernel_log.parse(lines)
    assert log.xids == [] and log.truncated is None
    (lost,) = log.lost
    assert (lost.pci, lost.xid, lost.stamp.uptime, lost.line_no) == ("0000:b3:00.0", None, 1843.308145, 1)


@pytest.mark.parametrize(
    "lines",
    [
        [
            "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1e07) installed in this",
            "NVRM: system has fallen off the bus and is not responding to commands.",
        ],
        [
            "NVRM: The NVIDIA GPU 0000:05:00.0 installed in this system has fallen off the bus and is not responding "
            "to commands."
        ],
        ["[ 1232.1] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."],
        ["NVRM: Xid (PCI:0000:04:00): 79, GPU has fallen off the bus"],
    ],
)
def test_fallen_off_the_bus_other_shapes(lines):
    (lost,) = kernel_log.parse(lines).lost
    assert lost.pci.endswith(":00.0")


def test_a_different_the_nvidia_gpu_message_is_not_a_lost_gpu():
    lines = [
        "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1e07)",
        "NVRM: installed in this system is not supported by the",
        "NVRM: NVIDIA 550.54.14 driver release.",
        "NVRM: Please see 'Appendix A - Supported NVIDIA GPU Products'",
    ]
    log = kernel_log.parse(lines)
    assert log.lost == [] and log.truncated is None


@pytest.mark.parametrize(
    "lines",
    [
        ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0"],
        [
            "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
            "    NVRM: (PCI ID: 10de:26b5) installed in this system has",
        ],
        ["[ 10.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics", "[ 11.0] NVRM: Xid (PCI:0000:3b"],
    ],
)
def test_a_log_cut_inside_an_nvidia_message_is_truncated(lines):
    assert kernel_log.parse(lines).truncated


def test_unreadable_xid_line_is_kept_not_dropped():
    log = kernel_log.parse(["NVRM: Xid (PCI:0000:3b:00): , pid=1", "NVRM: Xid (PCI:0000:3b:00): 13, pid=2"])
    assert log.unreadable == [(1, "NVRM: Xid (PCI:0000:3b:00): , pid=1")] and len(log.xids) == 1


def test_gpu_map_and_serial_lines():
    lines = [
        "[ 9.1] NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-1234-5678-9abc-def012345678",
        "[ 9.1] NVRM: GPU Board Serial Number: 1652221012345",
        "[ 9.2] NVRM: Xid (PCI:0000:9b:00): 48, pid=77, name=python, An uncorrectable double bit error",
    ]
    log = kernel_log.parse(lines)
    assert log.gpu_map == {
        "0000:9b:00.0": {"uuid": "GPU-509665ad-1234-5678-9abc-def012345678", "serial": "1652221012345"}
    }


def test_boots_from_markers_and_from_uptime_going_back():
    lines = [
        "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
        "[  500.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, x",
        "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
        "[  600.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=2, name=a, x",
        "[   20.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=3, name=a, x",  # a grep across boots: uptime went back
    ]
    log = kernel_log.parse(lines)
    assert log.starts_at_boot and log.boots == 3
    assert [e.stamp.boot for e in log.xids] == [0, 1, 2]
    (g,) = kernel_log.group(log.xids)
    assert (g.count, g.boots, g.pids, g.processes) == (3, [0, 1, 2], [1, 2, 3], ["a"])
    assert (g.first_seen, g.last_seen) == ("500.000000 s after boot", "20.000000 s after boot")


@pytest.mark.parametrize(
    ("stamps", "want"),
    [
        (["[  100.0] ", "[  100.4] ", "[  100.9] "], 1),  # one fault's burst
        (["[  100.0] ", "[  130.0] ", "[  170.0] ", "[  400.0] "], 3),  # measured from each occurrence's start
        (["[Sun Feb 23 16:24:18 2025] ", "[Sun Feb 23 16:29:18 2025] ", "[Sun Feb 23 16:29:19 2025] "], 2),
        (["2025-01-21T04:41:44,283302+00:00 ", "2025-01-21T05:41:44,000001+00:00 "], 2),  # dmesg --time-format iso
        (["Feb 29 11:38:47 n1 kernel: ", "Feb 29 11:40:47 n1 kernel: ", "Mar  1 00:00:00 n1 kernel: "], 3),  # syslog
        (["", "", ""], 1),  # no timestamps: never more than the boots show
        (["[  100.0] ", "", "[  100.5] ", "[  500.0] "], 2),  # a line without a time joins the one before
    ],
)
def test_episodes_count_separate_occurrences(stamps, want):
    lines = [f"{stamp}NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a, x" for stamp in stamps]
    (g,) = kernel_log.group(kernel_log.parse(lines).xids)
    assert g.episodes == want and g.count == len(stamps)


def test_every_boot_is_another_occurrence():
    lines = [
        "[  500.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, x",
        "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
        "[  500.1] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, x",
    ]
    (g,) = kernel_log.group(kernel_log.parse(lines).xids)
    assert (g.boots, g.episodes) == ([0, 1], 2)


def test_group_per_gpu_and_xid_keeps_first_and_last():
    log = kernel_log.parse((HEALTH / "a6_kernel_lines.log").read_text().splitlines())
    groups = kernel_log.group(log.xids)
    g13 = next(g for g in groups if g.xid == 13)
    assert (g13.pci, g13.count, g13.pids, g13.processes, g13.episodes) == ("0000:38:00.0", 3, [], [], 1)
    assert (g13.first_seen, g13.last_seen) == ("2025-01-21T04:41:44.283302+00:00", "2025-01-21T04:41:44.283575+00:00")
    assert len(g13.details) == 3
    assert kernel_log.XidGroup.from_dict(g13.to_dict()) == g13


def test_a_log_without_nvidia_lines():
    lines = ["[    0.000000] Linux version 6.8.0", "[    1.000000] random: crng init done"]
    log = kernel_log.parse(lines)
    assert (log.lines, log.nvidia_lines, log.xids, log.lost, log.truncated) == (2, 0, [], [], None)
