"""Will the host hold what the engine keeps there? Checked before the first
step of a plan, so a run that cannot fit says so instead of being killed by
the operating system halfway through a step.

Beyond the model's own weights (already in memory), the engine keeps on the
host the gradients (the whole model's, or where the placement says so a few
packs' in slots: :mod:`.gradient_slots`), the optimizer state (allocated by
the first update) and,
during a step, the stashed pack inputs and offloaded activations of the
whole minibatch. On CUDA the weights are also page-locked. An emulated GPU's
memory is host memory too, as much as its ledger holds at its peak (its copies
and computations are freed as the graph frees them: see
:mod:`harmony.engine.devices`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..costs.hardware import format_bytes
from ..costs.placement import Placement
from ..costs.spec import ModelSpec, state_slots
from ..errors import HarmonyError
from ..graph import (
    ACT_OUT,
    STASH_OUT,
    TaskGraph,
)
from ..plan import Plan
from ..policies import spec_for, stashes_in_flight
from ..simulate import simulate_graph
from .gradient_slots import gradient_slots_for
from .host_model import HostModel
from .journal import optimizer_params
from .tiers.system import (  # noqa: F401 - the process's memory, as the engine reads it
    available_host_bytes,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)


@dataclass
class KeptOnHost:
    """What a run keeps in host memory for its ``plan``: the ``host`` model (its
    gradient buffers), the ``optimizers`` ((pack, shard) -> optimizer), the weights
    not yet made (``unmade``: an :class:`~.lazy_weights.UnmadeWeights` or None), the
    chain's sizes (``spec``) and the devices (``backends``: an emulated GPU's memory
    is host memory)."""

    host: HostModel
    optimizers: dict
    unmade: object
    spec: ModelSpec
    plan: Plan
    backends: list


def besides_the_model(module: nn.Module) -> int:
    """Resident memory of this process that is not ``module``'s tensors: the
    interpreter, torch, the caller's data (0 where it cannot be told)."""
    resident = resident_bytes()
    if resident is None:
        return 0
    # per storage: flattened weights are views of a few shared buffers
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*module.parameters(), *module.buffers())
    }
    model = sum(storages.values())
    return max(0, resident - model)


#: what an emulated GPU's tensors may hold beyond its peak, as a share of it: a
#: copy that a view keeps after the graph freed its buffer, the allocator's pages
EMULATED_SLACK = 0.05


def device_memory_in_host(backends, graph: TaskGraph) -> int:
    """Host memory the devices of ``backends`` take when they run ``graph``: the
    cpu backend computes in host memory, as much as the graph's device peak (which
    counts weights the cpu backend uses in place: an upper bound); an emulated
    GPU's copies and computations, as much as its peak, at most its capacity, and
    :data:`EMULATED_SLACK` more; a CUDA device's memory is its own."""
    peaks = None
    total = 0.0
    for backend in backends:
        if backend.kind == "cuda":
            continue
        if peaks is None:
            peaks = simulate_graph(graph).summary.peak_memory
        peak = peaks.get(backend.name, 0.0)
        if backend.kind == "emulated":
            peak = min(peak, backend.ledger.capacity) * (1 + EMULATED_SLACK)
        total += peak
    return int(total)


def _state_slots(opt: torch.optim.Optimizer, spec) -> int:
    """Tensors of the parameter's size the optimizer will add per parameter."""
    if opt is None or any(opt.state.get(p) for p in optimizer_params(opt)):
        return 0  # already allocated, part of what is in use now
    return state_slots(spec.optimizer)


def placement_of(graph: TaskGraph) -> Placement | None:
    """The placement the graph's DISK tasks follow (None: all in host memory)."""
    info = graph.info.get("disk")
    if info is None:
        return None
    return Placement(**{**info, "on_disk": tuple((q, k) for q, k in info["on_disk"])})


def host_bytes_needed(kept: KeptOnHost, graph: TaskGraph) -> dict[str, float]:
    """Bytes the run of ``kept`` will add to host memory for its plan (``graph``: its
    task graph, needed to count an emulated GPU's memory and what its disk
    tier takes and gives back), by what."""
    grads = optimizer = freed = made = 0.0
    placement = placement_of(graph)
    slots = gradient_slots_for(placement, kept.host, kept.plan, kept.optimizers, graph)
    unmade = kept.unmade
    for (q, _), opt in kept.optimizers.items():
        if opt is None:
            continue
        on_disk = placement.kinds_on_disk(q) if placement is not None else ()
        params = [p for p in optimizer_params(opt) if p.requires_grad]
        size = sum(p.numel() * p.element_size() for p in params)
        # unmade weights: made in host memory, or for the tier (then never held in it)
        new = unmade.nbytes(params) if unmade is not None else 0
        made += 0 if "weights" in on_disk else new
        grads += sum(
            p.numel() * p.element_size() for p in params if not kept.host.layout.has_grad_buffer(p)
        )
        optimizer += 0 if "optimizer" in on_disk else _state_slots(opt, kept.spec) * size
        freed += size - new if "weights" in on_disk else 0
    moved = graph.bytes_by_kind()
    # the whole minibatch's, at once; or, written to disk, a few pieces
    stash, offloaded = moved.get(STASH_OUT, 0.0), moved.get(ACT_OUT, 0.0)
    if placement is not None and placement.stashes_on_disk:
        stash, offloaded = stashes_in_flight(spec_for(kept.spec, kept.plan), kept.plan), 0.0
    emulated = device_memory_in_host([b for b in kept.backends if b.kind == "emulated"], graph)
    if slots is not None:
        grads = slots.nbytes
    return {
        "gradients": grads,
        "optimizer state": optimizer,
        "stashed inputs": stash,
        "offloaded activations": offloaded,
        "emulated GPU memory": emulated,
        "disk tier staging": placement.staging_bytes if placement is not None else 0,
        "master weights made (the model's were on the meta device)": made,
        "master weights moved to the disk tier": -freed,
    }


def check_host_memory(kept: KeptOnHost, graph: TaskGraph, available: int | None = None) -> None:
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    need = host_bytes_needed(kept, graph)
    total = sum(need.values())
    if total > available:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items() if v > 0)
        raise HarmonyError(
            f"host memory: this plan needs {format_bytes(total)} more host memory ({parts}) but "
            f"only {format_bytes(available)} are available. Free host memory, use an optimizer "
            "with less state (e.g. SGD), a plan that stashes less (fewer backward packs) or "
            "a smaller emulated GPU."
        )
