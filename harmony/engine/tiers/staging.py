"""Host buffers the disk tier reads into: :class:`Staging` keeps them for reuse
by size, charged to the host budget; :class:`StagedState` is what a read
returns, the tensors of one (pack, kind) as views of one such buffer."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Iterator, Mapping

import torch

from .budget import HostBudget


class StagedState(Mapping[str, torch.Tensor]):
    """Tensors read from the tier, by name. Read into the tier's staging buffers,
    they stay valid until :meth:`release` (or the end of a ``with`` block)
    gives the buffer back for the next read."""

    def __init__(self, tensors: dict[str, torch.Tensor], give_back=None):
        self._tensors, self._give_back = tensors, give_back

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def release(self) -> None:
        if self._give_back is not None:
            self._give_back()
            self._give_back = None

    def __enter__(self) -> "StagedState":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Staging:
    """Flat byte buffers the tier reads into, reused by size, each charged to
    the host budget (as ``"<prefix> staging buffer <n>"``) while the tier exists."""

    def __init__(self, budget: HostBudget | None, prefix: str):
        self.budget, self.prefix = budget, prefix
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._names: list[str] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._free[nbytes]:
                return self._free[nbytes].pop()
            name = f"{self.prefix} staging buffer {len(self._names)}"
            self._names.append(name)
        if self.budget is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        return self.budget.empty(name, nbytes, torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free[buffer.numel()].append(buffer)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            if self.budget is not None:
                for name in self._names:
                    if name in self.budget.allocations:
                        self.budget.release(name)
            self._names = []
