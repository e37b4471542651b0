"""Hardware health finding codes (HWR0xx): NVML facts, kernel-log Xids, GEMM fingerprints."""

from __future__ import annotations

from fpdoctor.catalog import RuleInfo
from fpdoctor.report.model import Severity

E, W = Severity.ERROR, Severity.WARNING

_XID_CATALOG = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
_ROW_REMAP = "https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/index.html"


# RuleInfo.untried: a hardware finding's fix is an action on the machine (drain, reset, replace).
_MACHINE = "an action on the machine (drain, reset, replace): not a change fpdoctor can make and measure"

HWR_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="HWR001",
        name="xid-error",
        severity=E,
        untried=_MACHINE,
        title="The NVIDIA driver logged an Xid error for a GPU",
        what="Reads the kernel log (dmesg, journalctl -k, /var/log/kern.log, or a saved log) for `NVRM: Xid` "
        "lines in every known shape (dmesg, dmesg -T, --time-format iso, syslog/journal, MIG `GPU-I:`, no comma "
        "after the code, the NVLink5 extended form decoded with NVIDIA's table for the driver branch), groups "
        "them by GPU and Xid, and explains each with NVIDIA's Xid catalogue. Application-class Xids (13, 31, 43, "
        "45 and alike) are warnings unless they repeat on the GPU - two programs by name, three processes by "
        "pid, or three occurrences more than a minute apart or in different boots (one fault's burst of lines "
        "is one occurrence) - or Xid 48/63/64/79/94/95 came on it in the same boot; hardware Xids are errors.",
        why="An Xid is the driver's record that a GPU, its memory, its links or its firmware failed, or that a "
        "program faulted on it. A hardware Xid explains crashes, hangs and NaN that no code change fixes.",
        fix="Follow the Xid's action in the finding: restart the job for application-class Xids (and fix the "
        "faulting kernel); drain and reset the GPU (nvidia-smi -r -i BUS_ID, or reboot) for hardware ones, and "
        "replace it when they come back.",
        references=(_XID_CATALOG,),
    ),
    RuleInfo(
        code="HWR002",
        name="gpu-lost",
        severity=E,
        untried=_MACHINE,
        title="A GPU has fallen off the bus",
        what="Finds the driver's 'GPU has fallen off the bus' report in the kernel log (Xid 79, or the multi-line "
        "message without any Xid), or NVML answering 'GPU is lost' for a device.",
        why="The GPU no longer answers on PCIe: every process using it fails, and nothing on the node can use "
        "it again until it is reset or the node rebooted. Repeats point at power, cooling, the riser or the "
        "board.",
        fix="Drain the node and reboot it; check power cables, cooling and the PCIe riser; if the GPU falls off "
        "again, replace it.",
        references=(_XID_CATALOG,),
    ),
    RuleInfo(
        code="HWR003",
        name="ecc-uncorrectable",
        severity=E,
        untried=_MACHINE,
        title="GPU memory reported uncorrectable ECC errors",
        what="Reads NVML's volatile (since the driver loaded) and aggregate (lifetime) uncorrected ECC counters, "
        "or the SRAM/DRAM counts of a saved `nvidia-smi -q`. Volatile errors are errors; errors seen only in "
        "the lifetime counter are warnings.",
        why="An uncorrectable error means a value in GPU memory was wrong: the process that read it was killed "
        "(Xid 48/94/95) or, where it was not contained, computed with corrupted data (NaN, divergence).",
        fix="Drain the GPU and reset it (nvidia-smi -r -i BUS_ID) or reboot, so the driver remaps the bad "
        "memory; then check `nvidia-smi -q -d ECC,ROW_REMAPPER`. Repeated errors, a remap failure or "
        "'SRAM Threshold Exceeded: Yes' are grounds for replacement.",
        references=(_ROW_REMAP,),
    ),
    RuleInfo(
        code="HWR004",
        name="row-remap-pending",
        severity=W,
        untried=_MACHINE,
        title="A memory repair (row remapping or page retirement) waits for a GPU reset",
        what="NVML's remapped-rows `pending` flag (Ampere and later data-centre GPUs), or the retired-pages "
        "pending status (older GPUs), or the same fields of a saved `nvidia-smi -q`. An error when the pending "
        "repair follows uncorrectable errors, a warning when it follows correctable ones.",
        why="The driver has marked faulty memory but the repair only takes effect after a GPU reset; until "
        "then the GPU runs with the faulty row set aside at best, and further errors can hit jobs.",
        fix="Drain the GPU and reset it at the next opportunity: nvidia-smi -r -i BUS_ID (no process may use "
        "it), or reboot the node; afterwards `nvidia-smi -q -d ROW_REMAPPER` must show Pending: No.",
        references=(_ROW_REMAP,),
    ),
    RuleInfo(
        code="HWR005",
        name="row-remap-failure",
        severity=E,
        untried=_MACHINE,
        title="GPU memory row remapping failed",
        what="NVML's remapped-rows `failureOccurred` flag, or 'Remapping Failure Occurred: Yes' in a saved "
        "`nvidia-smi -q`.",
        why="The GPU ran out of spare rows (or could not remap a row): faulty memory stays in use and "
        "uncorrectable errors will recur. NVIDIA and DCGM treat this flag as the replacement criterion.",
        fix="Take the GPU out of service and request a replacement (RMA) with `nvidia-bug-report.sh` output.",
        references=(_ROW_REMAP,),
    ),
    RuleInfo(
        code="HWR006",
        name="gpu-throttled",
        severity=W,
        untried=_MACHINE,
        title="The GPU's clocks are held down by hardware or thermal slowdown",
        what="Reads NVML's current clocks-event (throttle) reasons and reports hardware slowdown, hardware "
        "thermal slowdown, hardware power brake and software thermal slowdown. A software power cap and an idle "
        "GPU are normal and not reported.",
        why="A throttled GPU is slower than its peers: under data parallelism every rank waits for it. "
        "Hardware slowdown and power brake also signal failing cooling, power supply or board sensors.",
        fix="Check temperatures and fans (nvidia-smi -q -d TEMPERATURE,PERFORMANCE), the airflow and the power "
        "supply of the node; a GPU that keeps throttling alone among identical peers needs service.",
    ),
    RuleInfo(
        code="HWR007",
        name="gemm-mismatch",
        severity=E,
        untried=_MACHINE,
        title="A GPU computed a known-answer GEMM wrongly, or repeats of one GEMM disagreed",
        what="Runs deterministic GEMM fingerprints per GPU (bf16, fp16, tf32, fp32, fp8 where supported), in a "
        "child process per GPU, and checks two things on each GPU by itself: known answers - integer matrices "
        "whose product every kernel computes exactly, checked against an exact int64 product on the CPU - and "
        "repeat-to-repeat digests - one seeded GEMM repeated for the duration must give the same bits every "
        "time. Results that differ between GPUs are rank-outlier.",
        why="A GPU that computes a known answer wrongly corrupts training silently: NaN, loss spikes or a "
        "model that quietly diverges, with no Xid or ECC error to show for it.",
        fix="Take the GPU out of service, rerun `fpdoctor health` to confirm, then run `dcgmi diag -r 3` and "
        "request a replacement if the mismatch persists.",
    ),
    RuleInfo(
        code="HWR008",
        name="rank-outlier",
        severity=E,
        untried=_MACHINE,
        title="One rank's GPU disagrees with its peers",
        what="Under torchrun, gathers every rank's GEMM fingerprint and names the GPU (rank, host, UUID) whose "
        "results differ from the GPUs that agree with each other.",
        why="Identical GPUs running identical software must produce identical bits; the one that does not is "
        "the likely source of intermittent NaN or divergence across the job.",
        fix="Exclude the named host/GPU from the job (e.g. CUDA_VISIBLE_DEVICES or the scheduler's drain), "
        "rerun to confirm, and have the GPU diagnosed (dcgmi diag -r 3).",
    ),
    RuleInfo(
        code="HWR009",
        name="gpu-recovery-required",
        severity=E,
        untried=_MACHINE,
        title="The driver asks for a GPU reset or a reboot",
        what="Reads NVML's GPU recovery action (driver r570 and later; field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) "
        "or 'GPU Recovery Action' in a saved `nvidia-smi -q`, and reports any action other than None.",
        why="The driver has decided that the GPU cannot be trusted until the named action (GPU reset, node "
        "reboot, drain and reset, bus reset) is done; jobs keep failing on it until then.",
        fix="Drain the GPU and carry out the action the finding names (nvidia-smi -r -i BUS_ID for a GPU reset, "
        "a node reboot otherwise); then rerun `fpdoctor health`.",
    ),
    RuleInfo(
        code="HWR010",
        name="gpu-unreachable",
        severity=E,
        untried=_MACHINE,
        title="nvidia-smi or NVML cannot open a GPU",
        what="Finds the line nvidia-smi prints instead of a GPU's section when it cannot open the GPU, "
        "'Unable to determine the device handle for GPU 00000000:47:00.0: Unknown Error' (any case; live: "
        "NVML's nvmlDeviceGetHandleByIndex failing with Unknown Error, Insufficient Power, IRQ issue and "
        "alike), and the driver's 'NVRM: GPU 0000:47:00.0: RmInitAdapter failed!' in this boot's kernel log "
        "(the driver could not initialise the GPU), unless NVML or nvidia-smi opened that GPU since. "
        "'GPU is lost' is gpu-lost; 'Insufficient Permissions' says nothing of the GPU and leaves it not "
        "checked.",
        why="The driver counts the GPU but cannot talk to it: every job scheduled on it fails, and none of its "
        "health facts can be read. It has most often fallen off the bus (Xid 79) or hung after an earlier "
        "fault; it is never a GPU that is merely not checked.",
        fix="Drain the node. Look for Xid 79 or other NVRM lines for BUS_ID in the kernel log (dmesg | grep -i "
        "-e xid -e NVRM); reset the GPU (nvidia-smi -r -i BUS_ID) or reboot the node. If it stays unreachable "
        "or comes back so, reseat the GPU and check its power cables and PCIe riser, then request a "
        "replacement (RMA) with nvidia-bug-report.sh output.",
        references=(_XID_CATALOG,),
    ),
    RuleInfo(
        code="HWR011",
        name="no-gpu-visible",
        severity=E,
        untried=_MACHINE,
        title="The NVIDIA driver sees no GPU on a node that has some",
        what="nvidia-smi output that says 'No devices were found' (or counts 'Attached GPUs : 0'), 'NVIDIA-SMI "
        "has failed because it couldn't communicate with the NVIDIA driver' or 'Failed to initialize NVML: "
        "Driver/library version mismatch' (any NVML start-up failure but Insufficient Permissions); live, NVML "
        "that counts no GPU while the driver's /proc/driver/nvidia/gpus or this boot's kernel log names GPUs, "
        "NVML that cannot start for a driver/library version mismatch, or a driver that is not loaded while "
        "the PCI bus holds NVIDIA GPUs.",
        why="No GPU of the node can be used: every GPU failed to initialise (RmInitAdapter failed, a GPU off "
        "the bus, a firmware or power fault), the driver is not loaded or hung, or the driver library in use "
        "is not the loaded kernel module's (a driver upgraded without a reboot), so no GPU job can run there.",
        fix="Drain the node. A driver/library version mismatch follows a driver upgrade: reboot the node (or "
        "reload the nvidia kernel modules). Otherwise check lspci | grep -i nvidia, lsmod | grep nvidia and the "
        "kernel log (dmesg | grep -i -e NVRM -e xid) for why the GPUs did not initialise; reboot the node; if "
        "they stay invisible, reseat them and check their power, then request a replacement (RMA) with "
        "nvidia-bug-report.sh output.",
        references=(_XID_CATALOG,),
    ),
)
