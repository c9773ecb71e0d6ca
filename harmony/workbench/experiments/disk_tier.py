"""Three tiers (GPU, host memory, disk), simulated: what a disk under a short
host memory costs one plan as the disk gets slower, whether the disk bytes
the simulator moves are the closed form's, and the iteration's timeline with
the disk's own lanes beside the PCIe links and the GPUs."""

from __future__ import annotations

from typing import Sequence

import pandas as pd

import harmony

from ...costs.catalog import model_spec
from ...costs.hardware import Hardware, preset
from ...costs.placement import HostMemoryError
from ...graph import DISK_IN, DISK_OUT
from ...plan import Plan
from ...policies import disk_placement, swap_volume
from ...trace import Trace


def roomy_plan(model: str, minibatch: int, hardware: str, policies: Sequence[str]) -> Plan:
    """The fastest plan the search finds with the preset's host memory (enough
    for everything): the plan each row of :func:`disk_sweep` then runs."""
    spec = model_spec(model, "zoo")
    return harmony.search(spec, preset(hardware), minibatch, policies=policies).iloc[0]["plan"]


def short_server(hardware: str, host_memory: str, disk: str | tuple[float, float]) -> Hardware:
    return preset(hardware).with_host_memory(host_memory).with_disk(disk)


def disk_sweep(
    model: str, plan: Plan, hardware: str, host_memory: str, disks: Sequence[str]
) -> pd.DataFrame:
    """``plan`` on ``hardware`` with ``host_memory`` over each disk in ``disks``
    (a name such as ``"nvme"`` or ``"<read>,<write>"``), and with the preset's
    own host memory (disk ``none``, the first row): s/iter, the slowdown, what
    is on disk, disk bytes simulated and in closed form, and the lower bound."""
    spec = model_spec(model, "zoo")
    roomy = harmony.simulate(spec, preset(hardware), plan).summary
    rows = [_row("none (host memory to spare)", roomy, roomy, preset(hardware), spec, plan)]
    for disk in disks:
        hw = short_server(hardware, host_memory, disk)
        try:
            summary = harmony.simulate(spec, hw, plan).summary
        except HostMemoryError as e:  # even with all it may put on disk, the host is short
            rows.append({"disk": disk, "fits": False, "note": str(e)})
            continue
        rows.append(_row(disk, summary, roomy, hw, spec, plan))
    return pd.DataFrame(rows)


def _row(disk: str, summary, roomy, hw: Hardware, spec, plan: Plan) -> dict:
    closed = swap_volume(spec, plan, hw) if hw.has_disk else {}
    placement = disk_placement(spec, hw, plan) if hw.has_disk else None
    disk_bytes = summary.disk_read_bytes + summary.disk_write_bytes
    closed_bytes = closed.get(DISK_IN, 0.0) + closed.get(DISK_OUT, 0.0)
    return {
        "disk": disk,
        "fits": True,
        "read_GBps": (hw.disk_read or 0) / 1e9,
        "write_GBps": (hw.disk_write or 0) / 1e9,
        "reads_and_writes": _DUPLEX[hw.disk_shared] if hw.has_disk else "",
        "iteration_s": summary.iteration_s,
        "slowdown": summary.iteration_s / roomy.iteration_s,
        "on_disk_gb": placement.disk_bytes / 1e9 if placement else 0.0,
        # stashes written and read back per iteration, where even the state on disk left
        # too little host memory for them
        "stashes_on_disk_gb": placement.stash_disk_bytes / 1e9 if placement else 0.0,
        "disk_read_gb": summary.disk_read_bytes / 1e9,
        "disk_write_gb": summary.disk_write_bytes / 1e9,
        "closed_form_gb": closed_bytes / 1e9,
        "simulated_over_closed_form": disk_bytes / closed_bytes if closed_bytes else 1.0,
        "lower_bound_s": summary.lower_bound_s,
        "lower_bound_by": summary.lower_bound_by,
        "note": "",
    }


#: how a disk's reads and writes go together, by ``Hardware.disk_shared``
_DUPLEX = {False: "at once (full duplex)", True: "taking turns (shared)"}


def tiers_trace(model: str, plan: Plan, hw: Hardware) -> Trace:
    """The iteration of ``plan`` on ``hw``: its timeline has the GPUs' compute
    lanes, the PCIe links and the disk's ``host.disk_read`` / ``host.disk_write``."""
    return harmony.simulate(model_spec(model, "zoo"), hw, plan)


def slowdown_chart(sweep: pd.DataFrame, title: str = ""):
    """Seconds per iteration against the disk's read bandwidth, one line for
    full-duplex disks and one for disks whose reads and writes share its time,
    with the same plan's time on a host with memory to spare as a rule."""
    from .. import labels
    from ..charts import load_altair

    alt = load_altair()
    fits = sweep[sweep["fits"] & (sweep["read_GBps"] > 0)]
    roomy = sweep.iloc[0]["iteration_s"]
    line = (
        alt.Chart(fits)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "read_GBps:Q", scale=alt.Scale(type="log"), title="disk read bandwidth (GB/s)"
            ),
            y=alt.Y("iteration_s:Q", title="iteration time (s, simulated)"),
            color=alt.Color("reads_and_writes:N", title="reads and writes"),
            tooltip=labels.tooltips(
                fits, ["disk", "iteration_s", "slowdown", "disk_read_gb", "lower_bound_by"]
            ),
        )
    )
    rule = (
        alt.Chart(pd.DataFrame({"iteration_s": [roomy], "what": ["host memory to spare"]}))
        .mark_rule(strokeDash=[4, 4], color="gray")
        .encode(
            y="iteration_s:Q",
            tooltip=[
                alt.Tooltip("what:N", title="what"),
                alt.Tooltip("iteration_s:Q", format=".3~g", title="iteration time (s)"),
            ],
        )
    )
    return (line + rule).properties(title=title, width=520, height=280)
