"""The server the explorer simulates on: its host memory (the preset's, a share
of the model's training state, or a size) and the disk tier under it, and one
sentence on where the chosen plan's training state lives."""

from __future__ import annotations

from ..costs.hardware import DISKS, Hardware, format_bytes, parse_bytes
from ..costs.placement import KINDS
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..plan import Plan
from ..policies import disk_placement
from ..policies.state import host_state
from ..trace import Trace

#: the host memory control's default: the preset's own host memory (no change)
AS_PRESET = "as the preset"
#: the host memory control's other choices: shares of the model's training state (master
#: weights, gradients and optimizer state of every layer, :func:`training_state`)
HOST_SHARES = ("90%", "75%", "60%", "45%", "30%")
#: the disk control's default: no disk tier under host memory
NO_DISK = "none"
_NVME = DISKS["nvme"]
#: the disk control: label -> what :meth:`~harmony.costs.hardware.Hardware.with_disk` reads
DISK_CHOICES = {
    "none": NO_DISK,
    f"NVMe, PCIe 4.0 ({_NVME[0] / 1e9:.3g} GB/s read, {_NVME[1] / 1e9:.3g} GB/s write)": "nvme",
    # SATA's link is half duplex: reads and writes take turns on it
    "SATA SSD (0.5 GB/s, reads and writes taking turns)": "0.5GB/s,0.5GB/s,shared",
}
#: what each kind of state on disk is called
_STATE_WORDS = {
    "optimizer": "optimizer state",
    "weights": "master weights",
    "gradients": "gradients",
}


def training_state(spec: ModelSpec) -> int:
    """Bytes of ``spec``'s training state in host memory: master weights, gradients
    and optimizer state of every layer (:func:`~harmony.policies.state.host_state`)."""
    return host_state(spec, range(len(spec))).total


def host_memory_bytes(choice: str | int, spec: ModelSpec) -> int | None:
    """The host memory a choice of the control means for ``spec``: None for
    :data:`AS_PRESET`, a share (``"75%"``) of its :func:`training_state`, or a
    size (``"24GiB"``, bytes). A HarmonyError saying so when it cannot be read."""
    if choice == AS_PRESET:
        return None
    text = str(choice).strip()
    if not text.endswith("%"):
        return parse_bytes(choice, "host memory")
    try:
        share = float(text[:-1]) / 100
    except ValueError:
        share = -1.0
    if not 0 < share < float("inf"):
        raise HarmonyError(
            f"cannot read host memory {choice!r}: give a share of the training state such "
            "as '75%', a size such as '24GiB', or 'as the preset'"
        )
    return int(share * training_state(spec))


def host_memory_words(choice: str | int) -> str:
    """What a host memory choice is, in words ("75% of the training state", "the
    preset's"), or "" for a size."""
    if choice == AS_PRESET:
        return "the preset's"
    return f"{choice} of the training state" if str(choice).strip().endswith("%") else ""


def where_state_lives(
    spec: ModelSpec, hw: Hardware, plan: Plan | None, trace: Trace | None, memory: str = ""
) -> str:
    """One sentence: the server's host memory (``memory``: what it is, in words)
    and disk, and, when ``plan`` ran (``trace``), what of its training state is on
    disk (the placement the graph's DISK_IN / DISK_OUT follow,
    :func:`~harmony.policies.disk_placement`) and the disk's bytes per iteration."""
    text = f"On {hw.name} with {format_bytes(hw.host_memory)} of host memory"
    text += f" ({memory})" if memory else ""
    if hw.has_disk:
        text += (
            f" over a disk reading {hw.disk_read / 1e9:.3g} GB/s and writing "
            f"{hw.disk_write / 1e9:.3g} GB/s" + (" (one at a time)" if hw.disk_shared else "")
        )
    else:
        text += " and no disk"
    if plan is None or trace is None:
        return text
    try:
        placement = disk_placement(spec, hw, plan)
    except HarmonyError:  # not expected once the plan ran: its graph was placed the same way
        return text
    slots = (
        f"; the gradients in {placement.gradient_slots} pack slots, not the whole model's"
        if placement.gradient_slots
        else ""
    )
    if not placement.uses_disk:
        where = (
            ": nothing on disk, the training state fits"
            if hw.has_disk
            else ": the training state stays"
        )
        return f"{text}{where} in host memory{slots}"
    counts = {k: sum(1 for _, kind in placement.on_disk if kind == k) for k in KINDS}
    parts = [f"the {_STATE_WORDS[k]} of {n}" for k, n in counts.items() if n]
    if parts:
        parts[0] += f" of the {len(plan.bwd_packs)} backward packs"
        parts[-1] += f" ({format_bytes(placement.disk_bytes)})"
    if placement.stashes_on_disk:
        parts.append(f"the stashes ({format_bytes(placement.stash_disk_bytes)})")
    return (
        f"{text}: on disk {' and '.join(parts)}, "
        f"{format_bytes(trace.summary.disk_bytes)} read and written per iteration{slots}"
    )
