"""Which training state lives in host memory and which on disk, for a
:class:`HostBudget`: the arithmetic is :mod:`harmony.costs.placement`'s (the
task-graph builder uses it too); this takes a budget's free bytes and speaks
the tier's error."""

from __future__ import annotations

from typing import Sequence

from ...costs import placement as costs
from ...costs.placement import KINDS, STAGED_PACKS, PackBytes, Placement
from .budget import HostBudget, HostBudgetError

__all__ = ["KINDS", "STAGED_PACKS", "PackBytes", "Placement", "place_state"]


def place_state(
    packs: Sequence[PackBytes],
    budget: HostBudget | str | int,
    *,
    reserve: str | int,
    weight_reads: int = 1,
) -> Placement:
    """:func:`harmony.costs.placement.place_state` within ``budget``: bytes, a size
    such as ``"24GiB"``, or a :class:`HostBudget` (its free bytes); ``reserve``:
    the engine's stashes, buffer pools and the like (see
    :func:`harmony.engine.host_memory.host_bytes_needed`). A placement that
    cannot fit raises :class:`HostBudgetError`."""
    limit = budget.free if isinstance(budget, HostBudget) else budget
    try:
        return costs.place_state(packs, limit, reserve=reserve, weight_reads=weight_reads)
    except costs.HostMemoryError as e:
        raise HostBudgetError(str(e)) from None
