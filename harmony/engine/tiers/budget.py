"""Host memory as a tier with a capacity: :class:`HostBudget`.

Harmony keeps master weights, gradients and optimizer state in host memory;
when they do not all fit, some go to a :class:`~harmony.engine.tiers.DiskTier`
and what stays is charged here, by name, so a run that would overflow the
host says so (what was asked, what is free, how to fix it) instead of being
killed by the operating system halfway through a step.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from ...costs.hardware import format_bytes, parse_bytes
from ...errors import HarmonyError
from .system import available_host_bytes


class HostBudgetError(HarmonyError):
    """An allocation that would take host memory past its budget."""


def machine_host_bytes() -> int | None:
    """Host memory that can be allocated now without swapping: the kernel's
    MemAvailable, else free pages times the page size (None: unknown)."""
    available = available_host_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class HostBudget:
    """A ledger of named host allocations with a hard ``capacity``.

    ``capacity``: bytes, or a size such as ``"8GB"``; None: what the machine
    can allocate now (:func:`machine_host_bytes`). :meth:`charge` refuses,
    with :class:`HostBudgetError`, an allocation that does not fit; ``peak``
    is the most ever in use at once. Thread-safe."""

    def __init__(self, capacity: str | int | None = None):
        if capacity is None:
            capacity = machine_host_bytes()
            if capacity is None:
                raise HostBudgetError(
                    "cannot tell how much host memory this machine has: "
                    "give the budget, e.g. HostBudget('16GB')"
                )
        self.capacity = parse_bytes(capacity, "host memory budget")
        self.allocations: dict[str, int] = {}
        self.in_use = 0
        self.peak = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return self.capacity - self.in_use

    def charge(self, name: str, nbytes: int) -> None:
        """Take ``nbytes`` under ``name`` (a name not charged now)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise HostBudgetError(
                f"host memory budget: {name} asks for {nbytes} bytes; sizes are >= 0"
            )
        with self._lock:
            if name in self.allocations:
                raise HostBudgetError(
                    f"host memory budget: {name!r} is already charged "
                    f"({format_bytes(self.allocations[name])}); release it first"
                )
            if self.in_use + nbytes > self.capacity:
                largest = sorted(self.allocations.items(), key=lambda kv: -kv[1])[:3]
                held = ", ".join(f"{k} {format_bytes(v)}" for k, v in largest) or "nothing"
                raise HostBudgetError(
                    f"host memory budget: {name} needs {format_bytes(nbytes)} but only "
                    f"{format_bytes(self.capacity - self.in_use)} of "
                    f"{format_bytes(self.capacity)} are free (largest held: {held}). Give a "
                    "larger budget if the machine has the memory, or move more state to the "
                    "disk tier (place_state with this budget)."
                )
            self.allocations[name] = nbytes
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def release(self, name: str) -> int:
        """Give back what ``name`` holds; returns its bytes."""
        with self._lock:
            if name not in self.allocations:
                raise HostBudgetError(f"host memory budget: {name!r} is not charged")
            nbytes = self.allocations.pop(name)
            self.in_use -= nbytes
            return nbytes

    @contextlib.contextmanager
    def hold(self, name: str, nbytes: int):
        """``nbytes`` charged under ``name`` for the duration of a ``with`` block."""
        self.charge(name, nbytes)
        try:
            yield
        finally:
            self.release(name)

    def empty(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A 1-D host tensor of ``numel`` elements, charged under ``name``
        (released with :meth:`release`; contents undefined)."""
        self.charge(name, numel * dtype.itemsize)
        try:
            return torch.empty(numel, dtype=dtype)
        except RuntimeError:  # the kernel refused although the budget did not
            self.release(name)
            raise

    def __repr__(self) -> str:
        return (
            f"HostBudget({format_bytes(self.in_use)} of {format_bytes(self.capacity)} in use, "
            f"peak {format_bytes(self.peak)}, {len(self.allocations)} allocations)"
        )
