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
