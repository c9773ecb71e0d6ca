"""Storage tiers below the GPU: host memory with a budget, and a disk for the
per-pack state that does not fit there (optimizer state first, then master
weights, then gradients).

* :class:`HostBudget` (``budget.py``): host memory as a ledger with a capacity.
* :class:`DiskTier` (``disk.py``): per-(pack, kind) files, double buffered,
  committed per step through an atomic manifest; a kill at any moment leaves
  the state of a committed step. ``directory.py`` checks its directory up
  front; ``staging.py`` holds the host buffers it reads into.
* ``files.py``: the bytes themselves: chunked parallel reads and writes with
  checksums, pacing to a bandwidth and page-cache hygiene.
* :func:`measure_disk_bandwidth`, :data:`NVME_PCIE4` (``bandwidth.py``).
* :func:`place_state` (``placement.py``): what lives where, and the disk
  bytes of a step.
* :func:`export_state` / :func:`adopt_state` / :func:`drop_state`
  (``optimizer_state.py``): a torch optimizer's state in and out of a tier.

Not yet part of the task graph. To wire it in: ``Hardware`` gets ``disk_read`` /
``disk_write`` (bytes/s, None: no disk); the builder adds links ``host.disk_read``
and ``host.disk_write`` and, for a pack whose state :func:`place_state` put on
disk, a ``DISK_IN`` transfer (own lane, prefetched) before its UPD and a
``DISK_OUT`` after it, so the simulator, the closed form and the search see the
bytes; the engine's ``Engine.set_plan`` builds the placement and the tier, the
step's DISK_IN / DISK_OUT handlers call :meth:`DiskTier.read` / :meth:`DiskTier.write`
around the update (the committed slot is the undo copy, so the update journal
skips that state), ``Engine.step`` calls :meth:`DiskTier.commit` after a step and
:meth:`DiskTier.discard` on roll-back, and ``Engine.load`` opens the tier with
``expect_step``. Two generations are kept, so an engine checkpoint may lag the
tier by one step at most. ``FlatAdamW`` copies adopted state into buffers of its
own, which would keep it resident: it must step the staged buffers in place.
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
