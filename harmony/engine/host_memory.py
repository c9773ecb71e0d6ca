"""Will the host hold what the engine keeps there? Checked before the first
step of a plan, so a run that cannot fit says so instead of being killed by
the operating system halfway through a step.

Beyond the model's own weights (already in memory), the engine keeps on the
host the gradients, the optimizer state (allocated by the first update) and,
during a step, the stashed pack inputs and offloaded activations of the
whole minibatch. On CUDA the weights are also page-locked. An emulated GPU's
memory is host memory too: its buffer pools keep one buffer per copy a step
makes to it (see :mod:`harmony.engine.buffers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..costs.hardware import format_bytes
from ..costs.placement import Placement
from ..errors import HarmonyError
from ..graph import (
    ACT_IN,
    ACT_OUT,
    DATA_IN,
    G_IN,
    OPT_IN,
    P2P,
    STASH_IN,
    STASH_OUT,
    W_IN,
    TaskGraph,
)
from .updates import optimizer_params

if TYPE_CHECKING:
    from .engine import Engine


def available_host_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (None: unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _state_slots(opt: torch.optim.Optimizer) -> int:
    """Tensors of the parameter's size the optimizer keeps per parameter."""
    if opt is None or any(opt.state.get(p) for p in optimizer_params(opt)):
        return 0  # already allocated, part of what is in use now
    if isinstance(opt, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0
    if isinstance(opt, (torch.optim.Adagrad, torch.optim.RMSprop)):
        return 1
    return 2  # Adam and most others keep two moments


def placement_of(graph: TaskGraph) -> Placement | None:
    """The placement the graph's DISK tasks follow (None: all in host memory)."""
    info = graph.info.get("disk")
    if info is None:
        return None
    return Placement(**{**info, "on_disk": tuple((q, k) for q, k in info["on_disk"])})


def host_bytes_needed(engine: "Engine", graph: TaskGraph) -> dict[str, float]:
    """Bytes the engine will add to host memory for its plan (``graph``: its
    task graph, needed to count an emulated GPU's buffers and what its disk
    tier takes and gives back), by what."""
    grads = optimizer = freed = 0.0
    placement = placement_of(graph)
    for (q, _), opt in engine.optimizers.items():
        if opt is None:
            continue
        on_disk = placement.kinds_on_disk(q) if placement is not None else ()
        params = [p for p in optimizer_params(opt) if p.requires_grad]
        size = sum(p.numel() * p.element_size() for p in params)
        grads += sum(
            p.numel() * p.element_size()
            for p in params
            if not engine.host.layout.has_grad_buffer(p)
        )
        optimizer += 0 if "optimizer" in on_disk else _state_slots(opt) * size
        freed += size if "weights" in on_disk else 0
    moved = graph.bytes_by_kind()
    # the whole minibatch's, at once
    stash, offloaded = moved.get(STASH_OUT, 0.0), moved.get(ACT_OUT, 0.0)
    emulated = 0.0
    if any(b.kind == "emulated" for b in engine.backends):
        into = (W_IN, DATA_IN, STASH_IN, ACT_IN, P2P, G_IN, OPT_IN)
        emulated = sum(moved.get(kind, 0.0) for kind in into)
    return {
        "gradients": grads,
        "optimizer state": optimizer,
        "stashed inputs": stash,
        "offloaded activations": offloaded,
        "emulated GPU buffers": emulated,
        "disk tier staging": placement.staging_bytes if placement is not None else 0,
        "master weights moved to the disk tier": -freed,
    }


def check_host_memory(engine: "Engine", graph: TaskGraph, available: int | None = None) -> None:
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    need = host_bytes_needed(engine, graph)
    total = sum(need.values())
    if total > available:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items() if v > 0)
        raise HarmonyError(
            f"host memory: this plan needs {format_bytes(total)} more host memory ({parts}) but "
            f"only {format_bytes(available)} are available. Free host memory, use an optimizer "
            "with less state (e.g. SGD), or a plan that stashes less (fewer backward packs) or, "
            "on an emulated GPU, moves less."
        )
