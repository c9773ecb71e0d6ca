"""Where a plan's training state lives, settled before its first step:
:func:`place_state` checks the host memory, opens the disk tier, makes the
gradient slots, lays the host weights out and fixes the order in which the
devices take memory."""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import TaskGraph
from ..plan import Plan
from ..simulate import play
from .disk_setup import HostSettings, attach
from .disk_staging import StateOnDisk
from .gradient_slots import GradientSlots, gradient_slots_for
from .host_memory import KeptOnHost, check_host_memory, placement_of
from .refusals import check_updates_run_where_state_is


@dataclass
class Placed:
    """A plan's state, placed: on the disk tier (None: all in host memory), host
    gradients in slots (None: one buffer for the model), and the order in which
    each device admits the graph's buffers (None: as they come)."""

    disk: StateOnDisk | None
    gradient_slots: GradientSlots | None
    memory_order: dict | None


def lay_out_weights(kept: KeptOnHost, on_disk: frozenset[int] = frozenset()) -> None:
    """Lay the host weights out in flat buffers, all but ``on_disk`` (ids of
    master weights a disk tier holds), if they are not yet or some left for the
    tier; then make the unmade ones (a model built on the meta device) in place."""
    if on_disk or not kept.host.layout.flattened:
        kept.host.layout.flatten(on_disk)
    if kept.unmade is not None:
        kept.unmade.make_all()


def place_state(
    graph: TaskGraph,
    plan: Plan,
    kept: KeptOnHost,
    settings: HostSettings,
    journal: bool,
    host_module,
    step: int,
) -> Placed:
    """Place the state ``kept`` for ``plan``'s ``graph`` (built for the host memory of
    ``settings``); ``journal``: updates are journaled (safe_updates); ``host_module``:
    the module holding every host weight; ``step``: the run's step."""
    check_updates_run_where_state_is(graph, plan)
    check_host_memory(kept, graph)
    disk = attach(
        graph,
        settings,
        journal,
        host_module,
        kept.optimizers,
        kept.unmade,
        step,
    )
    slots = gradient_slots_for(placement_of(graph), kept.host, plan, kept.optimizers, graph)
    settings.resume = None
    # master weights on the tier are placeholders now: lay out the rest anew
    on_disk = frozenset(disk.on_disk if disk is not None else ())
    lay_out_weights(kept, on_disk)
    # buffers are admitted on the devices in the simulator's order: the engine's
    # peak is then the simulated one, whatever the timing (on the cpu backend,
    # only where weight loads copy master weights read from disk)
    managed = any(b.copies for b in kept.backends) or bool(on_disk)
    return Placed(disk, slots, play(graph).order if managed else None)
