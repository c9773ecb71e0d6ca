"""Storage tiers below the GPU: host memory with a budget, and a disk for the
per-pack state that does not fit there (optimizer state first, then master
weights; gradients stay in host memory, in pack-sized slots where it is short).

* :class:`HostBudget` (``budget.py``): host memory as a ledger with a capacity.
* :class:`DiskTier` (``disk.py``): per-(pack, kind) files, double buffered,
  committed per step through an atomic manifest; a kill at any moment leaves
  the state of a committed step. ``directory.py`` checks its directory up
  front; ``staging.py`` holds the host buffers it reads into.
* ``files.py``: the bytes themselves: chunked parallel reads and writes with
  checksums, pacing to a bandwidth and page-cache hygiene.
* :func:`measure_disk_bandwidth`, :data:`NVME_PCIE4` (``bandwidth.py``; the
  preset's numbers are :mod:`harmony.costs.hardware`'s).
* :func:`place_state` (``placement.py``): what lives where, and the disk
  bytes of a step; the arithmetic is :mod:`harmony.costs.placement`'s, which
  the task-graph builder uses too.
* :class:`~.stashes.StashFile` (``stashes.py``): a step's stashes, where they
  go to disk too: one scratch file, written piece by piece and read back by
  sample range, never committed (a step's stashes die with it).
* :func:`export_state` / :func:`adopt_state` / :func:`drop_state`
  (``optimizer_state.py``): a torch optimizer's state in and out of a tier.

**In the task graph** (built by :mod:`harmony.policies.disk_tier`; simulated,
counted in closed form and searched): ``Hardware.disk_read`` / ``disk_write``
(bytes/s; None: no disk tier) and ``Hardware.host_memory`` (the budget). Where
the plan's state does not fit, :func:`harmony.policies.disk_placement` gives the
placement (also in ``graph.info["disk"]``): optimizer state, then master
weights, of the last packs first; gradients and, with ``gpu_optimizer``, all of
a swapped plan's state stay in host memory (the gradients in
``Placement.gradient_slots`` pack-sized slots where the whole model's do not
fit and the policy allows: each pack's G_OUTs then wait for the update of the
pack that many before it). The graph then has, on device ``host``:

* ``DISK_IN`` on lane and link ``host.disk_read``, payload
  :class:`~harmony.graph.DiskState` ``(packs, kinds, shard)``: read ``kinds``
  (``"optimizer"``, ``"weights"``) of those backward packs from the tier into
  host staging, ``task.nbytes`` bytes (the stepped parameters' master weights,
  float32 optimizer slots). Two uses: (a) before a CPU ``UPD`` of pack ``p``,
  shard ``(r, k)``: ``DiskState((p,), kinds on disk, (r, k))``; the UPD depends
  on it and steps the staged buffers in place; it waits for the ``DISK_OUT`` three
  such updates back (three packs staged: one updated, one read ahead, one
  written back); (b) before
  a ``W_IN`` whose layers need weights on disk: ``DiskState(packs, ("weights",),
  load=True)``, whole packs (shard ``(0, 1)``: every file of the pack); the W_IN
  depends on it and copies to the GPU from the staged weights, which it then
  gives back. Where the placement says ``weights_with_update`` (one GPU, and the
  policy's one update per pack follows the pack's backward), a backward ``W_IN`` takes
  its own pack's weights from (a) instead, read before the load and staged
  until the update has written them back: master weights on disk are read
  twice per step, not three times.
* ``DISK_OUT`` on lane and link ``host.disk_write``, the same payload and bytes
  as the update's ``DISK_IN``: depends on the ``UPD``; writes the updated state
  back (the next step's slot) and gives the staging back.
* where reads and writes share the disk's time (``Hardware.disk_shared``,
  ``disk="<read>,<write>,shared"``, or found so by
  :func:`measure_disk_bandwidth`), both also cross link ``host.disk`` of
  capacity 1, a byte read taking ``1/disk_read`` of it and a byte written
  ``1/disk_write`` (``Task.costs``): a read and a write at once split the
  disk's time, as they do on such a disk (the tier then paces its reads and
  writes as one queue of disk time).

* where the stashes are on disk too (``Placement.stashes_on_disk``): a
  ``DISK_OUT`` after each ``STASH_OUT`` / ``ACT_OUT`` and a ``DISK_IN`` before
  each ``STASH_IN`` / ``ACT_IN`` of a value written, payload
  :class:`~harmony.graph.Activation` (the transfer's own), ``task.nbytes`` its
  bytes; windows of :data:`~harmony.costs.placement.STASH_SLOTS` per GPU each
  way bound the pieces in host memory (see :mod:`harmony.policies.disk_tier`).

Neither allocates or frees graph buffers (host memory is not a ledger of the
graph; the placement's ``host_bytes`` is what the host holds).

**In the engine** (``Engine(host_memory=..., disk_dir=..., disk=...)``):
:mod:`harmony.engine.disk_setup` builds the graph for the host budget and
opens the tier from the graph's placement (checked before anything changes),
:mod:`harmony.engine.disk_staging` keeps the state on it (placeholders for the
master weights there, staging slots charged to the :class:`HostBudget`), and
:mod:`harmony.engine.step.disk` plays DISK_IN / DISK_OUT: each update steps
its staged state in place (``FlatAdamW`` and torch's optimizers step adopted
state where it is), the committed slot is the undo copy (the update journal
skips that state), ``Engine.step`` commits the tier after a good step and a
failed one discards its writes, and ``Engine.load`` opens the tier as of the
checkpoint's step (two generations: an engine checkpoint may lag the tier by
one step).
"""

from .bandwidth import NVME_PCIE4, DiskBandwidth, measure_disk_bandwidth
from .budget import HostBudget, HostBudgetError, machine_host_bytes
from .disk import DiskTier, DiskTierError, pack_name
from .optimizer_state import adopt_state, drop_state, export_state
from .placement import KINDS, PackBytes, Placement, place_state
from .staging import StagedState

__all__ = [
    "DiskBandwidth",
    "DiskTier",
    "DiskTierError",
    "HostBudget",
    "HostBudgetError",
    "KINDS",
    "NVME_PCIE4",
    "PackBytes",
    "Placement",
    "StagedState",
    "adopt_state",
    "drop_state",
    "export_state",
    "machine_host_bytes",
    "measure_disk_bandwidth",
    "pack_name",
    "place_state",
]
