"""How the engine fits a plan into host memory: the budget, the task graph built
for it, and the disk tier that takes what does not fit.

:class:`HostSettings` is what the engine was told (``host_memory``,
``disk_dir``, ``disk``). The budget is the whole process's: what it holds
besides the model (the interpreter, torch, the caller's data: measured when
the graph is built) and the device memory that is host memory (the cpu
backend's and an emulated GPU's) come out of it first; the rest is for what
the engine keeps there (training state, stashes and offloaded activations,
the update journal, the tier's I/O buffers), all charged to the budget's
ledger, and freed tensors go back to the system. A disk whose bandwidth is
not given is measured in ``disk_dir`` when the state needs it (whether reads
and writes share its time included).
:func:`build_for_host` builds the plan's graph on a server whose host memory
is what is left, less what the engine itself takes for the tier beyond the
placement's arithmetic (the tier's I/O buffers, and staging for weight loads
when master weights are on disk), so the placement
the graph's DISK tasks follow (:func:`harmony.policies.disk_placement`) is
what the engine can hold. :func:`attach` then makes the run's
:class:`~harmony.engine.disk_staging.StateOnDisk` from that placement: a new
tier (its directory checked, room for two slots of the state, the state on
disk written and committed as of the engine's step before anything leaves
host memory), or the tier of the checkpoint being resumed, opened as of its
step (an engine checkpoint may lag the tier by one step: the tier keeps two).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..costs.hardware import Hardware, disk_rates, format_bytes
from ..costs.placement import STAGED_PACKS, HostMemoryError, Placement, most_in_window
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import DISK_OUT, W_IN, Activation, TaskGraph, is_load_read
from ..plan import Plan
from ..policies import build_graph, disk_placement
from .disk_staging import StateOnDisk, Unit
from .host_memory import device_memory_in_host, placement_of, resident_bytes
from .host_pages import return_freed_memory
from .journal import optimizer_params
from .tiers import DiskTier, HostBudget, machine_host_bytes, measure_disk_bandwidth
from .tiers.directory import check_directory
from .tiers.files import ALIGN, CHUNK, DIRECTIONS, PAGE
from .tiers.stashes import scratch_bytes

#: requests the tier keeps in flight per direction, read and write (each through an I/O
#: buffer of one chunk)
IO_THREADS = 4
#: the tier's I/O buffers take at most this share of the host budget
IO_SHARE = 1 / 64
#: placeholder bandwidths to ask where the state goes before the disk is measured
#: (the placement depends only on there being a disk)
_ANY_DISK = (1.0, 1.0)
#: the ledger's name for what the process holds besides the model
BESIDES = "the process besides the model (interpreter, torch, data)"
#: host memory to build a graph with when only its device side matters
ROOMY = 10**18


@dataclass
class HostSettings:
    """``budget``: the host memory ledger; ``directory``: the disk tier's (None:
    none); ``rates``: its (read bytes/s, write bytes/s, whether reads and writes
    share the disk's time), given (``paced``: an emulated disk link) or
    measured; ``resume``: the checkpoint's disk entry when resuming."""

    budget: HostBudget
    directory: Path | None
    rates: tuple[float, float, bool] | None
    paced: bool
    resume: dict | None = None
    #: host memory the budget covers beyond the engine's own, by what (set by
    #: :func:`build_for_host`; charged to the ledger by :func:`attach`)
    outside: dict[str, int] = field(default_factory=dict)

    @property
    def chunk(self) -> int:
        """Bytes per I/O request: a small share of the budget, whole pages."""
        buffers = len(DIRECTIONS) * IO_THREADS
        share = int(self.budget.capacity * IO_SHARE) // buffers // PAGE * PAGE
        return max(PAGE, min(CHUNK, share))

    @property
    def io_bytes(self) -> int:
        return len(DIRECTIONS) * IO_THREADS * self.chunk

    def measure_disk(self) -> None:
        """Measure the tier's directory's disk if its bandwidth is not known yet."""
        if self.rates is None and self.directory is not None:
            where = self.directory if self.directory.is_dir() else self.directory.parent
            measured = measure_disk_bandwidth(where)
            self.rates = (measured.read, measured.write, measured.shared)


def host_settings(host_memory, disk_dir, disk, hardware: Hardware | None) -> HostSettings:
    """The engine's ``host_memory`` (default: the given hardware's, at most what
    the machine has), ``disk_dir`` and ``disk`` (``"200MB/s,200MB/s"``, a name such
    as ``"nvme"``: an emulated link the tier is paced to; None: the hardware's
    disk, else measured in ``disk_dir`` when the state needs it), checked now."""
    if host_memory is None:  # what this process can reach: what it holds and what is free
        reach = machine_host_bytes()
        reach = None if reach is None else reach + (resident_bytes() or 0)
        if reach is not None and hardware is not None:
            reach = min(reach, hardware.host_memory)
        budget = HostBudget(reach)
    else:
        budget = HostBudget(host_memory)
        return_freed_memory()  # the process is to stay under it
    directory = None if disk_dir is None else check_directory(disk_dir)
    if disk is not None and directory is None:
        raise HarmonyError(f"disk={disk!r} is the disk tier's link: give its directory, disk_dir=")
    if disk is not None:
        return HostSettings(budget, directory, disk_rates(disk), paced=True)
    given = hardware is not None and hardware.has_disk
    rates = (hardware.disk_read, hardware.disk_write, hardware.disk_shared) if given else None
    return HostSettings(budget, directory, rates, paced=False)


def build_for_host(
    spec: ModelSpec,
    hw: Hardware,
    plan: Plan,
    settings: HostSettings,
    tensors_per_unit: int,
    journal: bool,
    besides_model: int = 0,
    backends: Sequence = (),
) -> tuple[TaskGraph, Hardware]:
    """The graph of ``plan`` on ``hw`` with the host memory and disk of
    ``settings`` (see the module docstring), and the hardware it was built for;
    measures the disk first if the state needs it and its bandwidth is not
    known. ``tensors_per_unit``: the most parameters one update steps (each
    file pads its tensors); ``journal``: updates are journaled (safe_updates),
    which copies the state they change that stays in host memory;
    ``besides_model``: what the process holds besides the model;
    ``backends``: the engine's devices (their memory may be host memory)."""
    budget = settings.budget.capacity
    # the device side does not depend on where the host keeps the state: play the
    # graph with room for it all
    roomy = build_graph(spec, hw.with_host_memory(ROOMY).with_disk(None), plan)
    settings.outside = {
        BESIDES: besides_model,
        "device memory that is host memory (cpu or emulated GPU)": device_memory_in_host(
            backends, roomy
        ),
    }
    aside = dict(settings.outside)  # host memory the graph leaves to others
    if settings.directory is not None:
        aside["the disk tier's I/O buffers"] = settings.io_bytes

    def explained(err: HostMemoryError, disk) -> HostMemoryError:
        return _explained(err, disk, budget, aside, journal)

    def build(disk: tuple[float, float] | None, host: int = 0) -> tuple[TaskGraph, Hardware]:
        server = hw.with_host_memory(host or budget - sum(aside.values())).with_disk(disk)
        try:
            return build_graph(spec, server, plan), server
        except HostMemoryError as err:
            raise explained(err, disk) from None

    if budget <= sum(aside.values()):
        nothing = HostMemoryError("host memory: nothing is left for training state")
        raise explained(nothing, settings.directory and _ANY_DISK)
    # all of the state in host memory, with the journal's copy of it?
    whole = disk_placement(spec, hw.with_host_memory(ROOMY).with_disk(None), plan)
    if settings.directory is None:
        aside[JOURNAL] = whole.host_state_bytes * journal
        return build(None)
    some_disk = settings.rates or _ANY_DISK
    try:
        server = hw.with_host_memory(budget - sum(aside.values())).with_disk(some_disk)
        placed = disk_placement(spec, server, plan)
    except HostMemoryError as err:
        raise explained(err, some_disk) from None
    copies = whole.host_state_bytes * journal
    if not placed.uses_disk and placed.host_bytes + copies <= server.host_memory:
        aside[JOURNAL] = copies
        return build(some_disk)
    settings.measure_disk()
    lo = _most_for_placement(
        spec, hw, plan, settings, tensors_per_unit, journal, backends, aside, whole
    )
    return build(settings.rates, lo)


#: the ledger's name for the update journal's copies of the state in host memory
JOURNAL = "the update journal (safe_updates)"


def _explained(err: HostMemoryError, disk, budget: int, aside: dict, journal: bool):
    """``err`` with what the engine's budget was and what it set aside, and what to give it."""
    held = ", ".join(f"{k} {format_bytes(v)}" for k, v in aside.items() if v)
    fix = "a larger host_memory=" + (", safe_updates=False" if journal else "")
    where = "" if disk else "a directory for a disk tier (disk_dir=) or "
    return HostMemoryError(
        f"{err}. For the engine: its budget is {format_bytes(budget)}, less {held}; "
        f"give it {where}{fix}",
        available=err.available,
    )


def _most_for_placement(
    spec: ModelSpec,
    hw: Hardware,
    plan: Plan,
    settings: HostSettings,
    tensors_per_unit: int,
    journal: bool,
    backends: Sequence,
    aside: dict,
    whole: Placement,
) -> int:
    """The most host memory a placement with state on disk can be given, with what
    the engine needs beside it (added to ``aside``); ``whole``: the placement of all
    the state in host memory; the rest as for :func:`build_for_host`."""
    budget = settings.budget.capacity
    # staging beyond the placement's: padding in the files (ALIGN per tensor and per step
    # counter), and the weight loads' reads when master weights are on disk: a GPU's
    # next load may read while its current one is still copying, so two neighbouring
    # loads' per GPU; and with safe_updates, the journal's copies of the state that
    # stays in host memory.
    # The more memory the placement is given, the more stays and the less is read:
    # bisect for the most it can be given with all that beside it.
    padding = 3 * ALIGN * tensors_per_unit
    aside["padding in the tier's files"] = STAGED_PACKS * padding
    free = budget - sum(aside.values())

    # weight loads held at once per GPU: a copying device holds one while it copies, the
    # next one's read beside it; a device that computes on host memory uses what was read
    # in place until its weight group ends: as many as the groups it prefetches
    in_place = bool(backends) and not any(b.copies for b in backends)
    held = max(2, plan.option("prefetch_packs")) if in_place else 2

    def beside(m: int) -> dict[str, int]:
        graph = build_graph(spec, hw.with_host_memory(m).with_disk(settings.rates), plan)
        return {
            "staging for weight loads": load_staging(graph, held, padding),
            JOURNAL: (placement_of(graph) or whole).host_state_bytes * journal,
        }

    lo, hi = 0, free
    while hi - lo > max(PAGE, free >> 12):  # to 1/4096 of the budget
        m = (lo + hi) // 2
        try:
            fits = m + sum(beside(m).values()) <= free
        except HostMemoryError:  # too little for a placement at all: more
            fits = True
        lo, hi = (m, hi) if fits else (lo, m)
    try:
        aside.update(beside(lo))
    except HostMemoryError:
        pass  # said by build, with what was set aside
    return lo


def load_staging(graph: TaskGraph, held: int, padding: int) -> int:
    """Host bytes the reads of master weights for weight loads (W_IN) stage at once
    in ``graph``, where a GPU holds at most ``held`` of its loads' reads at once (its
    reads and loads run in priority order): per GPU, the most any ``held``
    neighbouring reads take, each with ``padding`` bytes more."""
    tasks = graph.tasks
    gpu_of = {
        d: t.device for t in tasks if t.kind == W_IN for d in t.deps if is_load_read(tasks[d])
    }
    reads: dict[str, list[int]] = defaultdict(list)
    for t in sorted((tasks[d] for d in gpu_of), key=lambda t: t.seq):
        reads[gpu_of[t.id]].append(int(t.nbytes) + padding)
    return sum(most_in_window(r, held) for r in reads.values())


def attach(
    graph: TaskGraph,
    settings: HostSettings,
    journal: bool,
    host_module,
    optimizers: dict,
    unmade,
    step: int,
) -> StateOnDisk | None:
    """The run's state on disk for ``graph`` (see the module docstring); None when
    it all fits host memory. Nothing in memory changes unless it succeeds.
    ``journal``: as for :func:`build_for_host`; ``host_module`` and ``optimizers``
    ((pack, shard) -> optimizer): the state; ``unmade``: the weights not yet made
    (None: all made); ``step``: the run's step, which a new tier is committed as of."""
    placement = placement_of(graph)
    resume = settings.resume
    _check_same_placement(resume, placement)
    if placement is None or not placement.uses_disk:  # at most gradient slots: no tier
        return None
    units = make_units(host_module, optimizers, placement)
    budget = settings.budget
    held: list[str] = []
    tier = state = None
    made: list = []  # unmade master weights made for the tier here (given back as written)
    try:
        for name, nbytes in _charges(settings, placement, journal).items():
            budget.charge(name, nbytes)
            held.append(name)
        tier = _open_tier(settings, placement, graph)
        state = StateOnDisk(tier, placement, units, budget)
        if resume is None:
            _write_all(state, units, unmade, made)
            tier.commit(step)
        else:
            _check_resumed(state)
            if unmade is not None:  # the tier holds their values
                unmade.kept_elsewhere(
                    p for u in units.values() if "weights" in u.kinds for _, p in u.params
                )
    except BaseException:
        if made:
            unmade.unmake(made)
        if state is not None:
            state.close()
        elif tier is not None:
            tier.close()
        for name in held:
            budget.release(name)
        raise
    for unit in units.values():
        state.forget(unit, unit.kinds)
    return state


def _check_same_placement(resume: dict | None, placement: Placement | None) -> None:
    """A resumed run's tier holds what ``placement`` puts on disk."""
    on_disk = [] if placement is None else [list(x) for x in placement.on_disk]
    if resume is not None and resume["on_disk"] != on_disk:
        raise HarmonyError(
            f"the checkpoint's run kept {resume['on_disk']} (pack, kind) on its disk tier, and "
            f"this engine's placement keeps {on_disk}: resume with the same plan, host_memory "
            "and hardware as the run"
        )


def _charges(settings: HostSettings, placement: Placement, journal: bool) -> dict[str, int]:
    """What the budget's ledger is charged for a run with state on disk, by name."""
    return {
        **settings.outside,
        "training state kept in host memory": placement.host_state_bytes,
        "gradients, stashes and offloaded activations"
        + (" (those written to disk and read back)" if placement.stashes_on_disk else ""): (
            placement.reserve
        ),
        "the update journal's copies (safe_updates)": placement.host_state_bytes * journal,
    }


def _open_tier(settings: HostSettings, placement: Placement, graph: TaskGraph) -> DiskTier:
    """A new tier in the settings' directory with room for ``placement``'s state (and
    ``graph``'s stashes on disk), or the resumed run's tier as of its step."""
    options = dict(budget=settings.budget, threads=IO_THREADS, chunk=settings.chunk)
    if settings.paced:
        read, write, shared = settings.rates
        options.update(read_rate=read, write_rate=write, shared=shared)
    if settings.resume is not None:
        return DiskTier.open(settings.directory, expect_step=settings.resume["step"], **options)
    room = dict(state_bytes=placement.disk_bytes)
    if placement.stashes_on_disk:
        writes = [t for t in graph.tasks if t.kind == DISK_OUT and isinstance(t.data, Activation)]
        room["scratch_bytes"] = scratch_bytes(placement.stash_disk_bytes, len(writes))
    return DiskTier.create(settings.directory, **room, **options)


def _write_all(state: StateOnDisk, units: dict, unmade, made: list) -> None:
    """Write every unit's state on disk to a new tier; unmade master weights are made
    one update at a time (added to ``made``), each written and given back at once."""
    for unit in units.values():
        fresh = []
        if unmade is not None and "weights" in unit.kinds:
            fresh = unmade.make(p for _, p in unit.params)
            made += fresh
        state.write(unit, unit.kinds, release=False)
        if fresh:
            state.forget(unit, ("weights",))


def make_units(host_module, optimizers: dict, placement: Placement) -> dict[tuple[int, int], Unit]:
    """Per update with a kind on disk, its :class:`Unit`: tier key ``q``, or
    ``(q, r)`` when pack ``q`` is updated in shards."""
    names = {id(p): n for n, p in host_module.named_parameters()}
    shards: dict[int, int] = {}
    for q, _ in optimizers:
        shards[q] = shards.get(q, 0) + 1
    units = {}
    for (q, r), opt in optimizers.items():
        kinds = placement.kinds_on_disk(q)
        if opt is None or not kinds:
            continue
        params = [(names[id(p)], p) for p in optimizer_params(opt)]
        units[(q, r)] = Unit(q if shards[q] == 1 else (q, r), opt, params, kinds)
    return units


def _check_resumed(state: StateOnDisk) -> None:
    """The tier being resumed holds the master weights the placement puts there."""
    for unit in state.units.values():
        if "weights" in unit.kinds and not state.tier.has(unit.key, "weights"):
            raise HarmonyError(
                f"disk tier {state.tier.directory} holds no master weights of update "
                f"{unit.key}, which the checkpoint left there: it is another run's tier"
            )
