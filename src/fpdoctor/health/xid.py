"""NVIDIA's Xid catalogue (shipped in fpdoctor/data/xid_catalog.csv): meaning, action, category, severity.

The catalogue's actions and cause flags are NVIDIA's (as transcribed by leptonai/gpud, see the
csv's source columns); `doctor_category_derived` and the one-line meanings are fpdoctor's own.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources

from fpdoctor.report.model import Severity

# Xids that are usually a program's own fault (illegal address, MMU fault, a channel torn down
# after one). They are warnings unless they repeat across processes or come with a hardware
# memory/bus Xid on the same GPU (research notes G: "treat 13/31/43/45 as application-first
# unless repeated across apps or accompanied by 48/94/95/79"; 63/64 from gpud's escalation).
APPLICATION_CATEGORIES = frozenset({"application_likely"})
APPLICATION_EXTRA = frozenset({45})
HARDWARE_COMPANIONS = frozenset({48, 63, 64, 79, 94, 95})

_ERROR_CATEGORIES = frozenset(
    {
        "hardware_memory_fault",
        "hardware_memory_contained",  # Xid 94: contained, but a job's memory was wrong
        "hardware_or_firmware_reset_needed",
        "hardware_or_driver_reset_needed",
        "driver_firmware_reset_needed",
    }
)
_INFO_CATEGORIES = frozenset({"informational", "informational_or_watch"})

# NVIDIA's immediate-action names in our words (catalogue column `immediate_action`).
_ACTIONS = {
    "RESTART_APP": "Restart the job. If it recurs, rerun it with CUDA_LAUNCH_BLOCKING=1 or under "
    "compute-sanitizer to find the faulting kernel; if other programs hit the same Xid on this GPU, drain it.",
    "RESET_GPU": "Drain the GPU and reset it: nvidia-smi -r -i {bus} (no process may use it), or reboot the "
    "node. If the Xid returns after the reset, replace the GPU.",
    "RESTART_BM": "Drain and reboot the node (the GPU is unreachable until then); check power, cooling and "
    "the PCIe riser; replace the GPU if it happens again.",
    "RESTART_VM": "Restart the virtual machine that owns the GPU.",
    "IGNORE": "No action is needed for this Xid by itself; act on the Xids logged around it.",
    "CONTACT_SUPPORT": "Collect nvidia-bug-report.sh output and contact NVIDIA or the system vendor.",
    "UPDATE_SWFW": "Update the NVIDIA driver and GPU firmware to the current release for this GPU.",
    "CHECK_MECHANICALS": "Check that the GPU's auxiliary power cables are seated and the board is powered.",
    "CHECK_UVM": "Check the Unified Memory (nvidia-uvm) module and its messages in the kernel log.",
    "WORKFLOW_XID_45": "Informational: the channel was torn down after an earlier error; act on the Xid "
    "that preceded it (on its own, restart the job).",
    "WORKFLOW_XID_48": "Uncorrectable ECC error: drain the GPU and reset it (nvidia-smi -r -i {bus}) so the "
    "bad row is remapped; check nvidia-smi -q -d ECC,ROW_REMAPPER; a remap failure means replacement.",
    "WORKFLOW_NVLINK_ERR": "Check the links: nvidia-smi nvlink -s -i {index} and the fabric manager log; "
    "reset the GPU if links are down, and have cables/boards inspected if it recurs.",
    "WORKFLOW_NVLINK5_ERR": "Check the links: nvidia-smi nvlink -s -i {index} and the fabric manager log; "
    "follow the decoded action below.",
    "XID_154": "The driver changed the GPU's recovery action; carry out the new action it names "
    "(GPU reset or reboot) once the GPU is drained.",
}


# Where NVIDIA's bucket reads wrong for a PyTorch user, the Xid's own advice.
_XID_ACTIONS = {
    63: "A memory row was marked for remapping: drain the GPU and reset it (nvidia-smi -r -i {bus}) at the "
    "next opportunity so the remap takes effect; nvidia-smi -q -d ROW_REMAPPER must then show Pending: No.",
    64: "Row remapping failed: drain the GPU, reset it (nvidia-smi -r -i {bus}) and check nvidia-smi -q -d "
    "ROW_REMAPPER; 'Remapping Failure Occurred: Yes' means replacement.",
    94: "Restart the job: the driver contained the memory error to it and the GPU keeps running. Reset the "
    "GPU (nvidia-smi -r -i {bus}) once drained so the bad row is remapped; repeated Xid 94 means replacement.",
}


@dataclass(frozen=True)
class XidInfo:
    xid: int
    mnemonic: str
    name: str  # NVIDIA's short name
    meaning: str  # our one-line meaning ("" for rarely seen codes)
    immediate_action: str
    investigatory_action: str
    category: str  # fpdoctor's derived category
    source: str

    @property
    def application_class(self) -> bool:
        return self.category in APPLICATION_CATEGORIES or self.xid in APPLICATION_EXTRA

    @property
    def known(self) -> bool:
        return bool(self.mnemonic)

    @property
    def short_name(self) -> str:
        """NVIDIA's short name without its commentary ('Preemptive cleanup, due to previous errors')."""
        return self.name.split(" -- ")[0].strip()

    def explain(self) -> str:
        return self.meaning or self.name or "not in NVIDIA's Xid catalogue as shipped with fpdoctor"

    def action_text(self, *, bus: str = "BUS_ID", index: str = "INDEX") -> str:
        """What to do, in words, from NVIDIA's immediate action (CONTACT_SUPPORT when unknown)."""
        key = self.immediate_action.split()[0] if self.immediate_action else "CONTACT_SUPPORT"
        text = _XID_ACTIONS.get(self.xid) or _ACTIONS.get(key, _ACTIONS["CONTACT_SUPPORT"])
        return text.replace("{bus}", bus).replace("{index}", index)


@functools.cache
def _catalogue() -> dict[int, XidInfo]:
    with resources.files("fpdoctor.data").joinpath("xid_catalog.csv").open(encoding="utf-8") as fh:
        return {
            int(r["xid"]): XidInfo(
                xid=int(r["xid"]),
                mnemonic=r["mnemonic"],
                name=r["nvidia_short_name"],
                meaning=r["meaning_own_words"],
                immediate_action=r["immediate_action"],
                investigatory_action=r["investigatory_action"],
                category=r["doctor_category_derived"],
                source=r["source_actions"],
            )
            for r in csv.DictReader(fh)
        }


def lookup(xid: int) -> XidInfo:
    """The catalogue's row for `xid`; an Xid the catalogue lacks gets an empty row (category 'unknown')."""
    info = _catalogue().get(xid)
    if info is not None:
        return info
    return XidInfo(
        xid=xid,
        mnemonic="",
        name="",
        meaning="",
        immediate_action="CONTACT_SUPPORT",
        investigatory_action="",
        category="unknown",
        source="",
    )


def base_severity(info: XidInfo) -> Severity:
    """The Xid's severity on its own, before repetition and companions are weighed."""
    if info.category in _ERROR_CATEGORIES:
        return Severity.ERROR
    if info.category in _INFO_CATEGORIES:
        return Severity.INFO
    # application-class, watch-only memory events (63, 92), unused or unknown codes: worth a look,
    # not proof of a bad GPU
    return Severity.WARNING
