"""Memory the engine reuses from step to step, and copies made few and large.

* :class:`HostLayout`: the host copy of the weights in flat storage, one
  buffer per dtype for the parameters and one for the buffers, layer after
  layer, each tensor a view of it. A pack is a range of layers, so its
  weights are one contiguous slice and cross the link in one copy whatever
  the plan. Gradients land in flat buffers of the same layout, kept across
  steps (``.grad`` is a view, set when the first gradient of a step arrives).
  On CUDA the flat buffers are page-locked, so copies from and to them are
  asynchronous.
* :class:`BufferPool`: tensors kept for reuse by dtype and size. A step takes
  one buffer per copy it makes to the host (stashes, offloaded activations)
  and gives them all back when it ends, so what a step takes is fixed by the
  plan: from the second step of a plan on, nothing new is allocated
  (``allocations`` counts what a pool had to make). Giving buffers back when
  the graph frees them would hold less, but how many of each size are live at
  once would then depend on how the lanes interleave, and a view of a buffer
  may still be held by another graph buffer (a stash, an output that is its
  input). A GPU needs no pool of ours: on a real one PyTorch's caching
  allocator already reuses device memory, and splits blocks where exact sizes
  cannot; an emulated one's memory is host memory, which a pool would hold at
  one buffer per copy of a step (several times the device), so each of its
  copies has memory of its own, freed when its last view goes (see
  :mod:`harmony.engine.devices`).
* :func:`copy_runs`: a list of copies merged where both sides are adjacent in
  memory, so a pack's weights go in one copy instead of one per tensor.
"""

from __future__ import annotations

import threading
import warnings
from collections import defaultdict

import torch
from torch import nn

from ..costs.hardware import format_bytes
from ..errors import HarmonyError


class BufferPool:
    """Flat tensors on one device, kept for reuse by (dtype, number of elements)."""

    def __init__(self, device: torch.device | str = "cpu", pin: bool = False):
        self.device, self.pin = torch.device(device), pin
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocations = 0  # tensors made because none of the size was free
        self.allocated_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined)."""
        if numel == 0:  # nothing to reuse (and every empty tensor has the same address)
            return torch.empty(0, dtype=dtype, device=self.device)
        with self._lock:
            free = self._free.get((dtype, numel))
            if free:
                return free.pop()
            self.allocations += 1
            self.allocated_bytes += numel * dtype.itemsize
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor from :meth:`take`; it may be handed out again at once."""
        with self._lock:
            self._free[(t.dtype, t.numel())].append(t)

    def clear(self) -> None:
        """Drop the free tensors (a new plan moves other sizes)."""
        with self._lock:
            self._free.clear()

    def held_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` starts in memory where the 1-D tensor ``a`` ends."""
    return (
        a.dim() == 1
        and a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


def _extend(a: torch.Tensor, n: int) -> torch.Tensor:
    return a.as_strided((a.numel() + n,), (1,), a.storage_offset())


def copy_runs(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` copies of equal sizes, merged into fewer, larger
    ones where consecutive destinations and consecutive sources are adjacent
    in memory. Destinations are contiguous; a source that is not is copied on
    its own, in its shape."""
    runs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if runs and _adjacent(runs[-1][0], dst) and _adjacent(runs[-1][1], src):
            d, s = runs[-1]
            runs[-1] = (_extend(d, dst.numel()), _extend(s, src.numel()))
        elif src.is_contiguous():
            runs.append((dst.view(-1), src.view(-1)))
        else:
            runs.append((dst.view(src.shape), src))
    return runs


class HostLayout:
    """The host weights of a chain of layers in flat storage (see the module
    docstring), and the gradient buffers that mirror them."""

    def __init__(
        self,
        layers: list[nn.Module],
        pin: bool = False,
        available: int | None = None,
        flatten: bool = True,
    ):
        """``available``: host bytes free now (None: ask the kernel). Flattening
        makes each flat buffer before the tensors it replaces are freed; if that
        does not fit, the weights stay as they are (copies then go per tensor)
        on the CPU, and on CUDA, which must page-lock them, it is an error.
        ``flatten`` False: not yet (see :meth:`flatten`)."""
        self.layers, self.pin = layers, pin
        self._flats: dict[int, torch.Tensor] = {}  # storage pointer -> a flat buffer of parameters
        self._grads: dict[int, torch.Tensor] = {}  # storage pointer of a flat -> its gradient flat
        self._loose_grads: dict[
            int, torch.Tensor
        ] = {}  # id(parameter) -> gradient (not in a flat)
        self._lock = threading.Lock()
        self.allocations = 0  # gradient buffers made
        self.allocated_bytes = 0
        self.flattened = False
        if flatten:
            self.flatten(available=available)

    def flatten(self, leave_out: frozenset[int] = frozenset(), available: int | None = None):
        """Lay the tensors out in flat buffers anew, all but the parameters whose
        ids are in ``leave_out`` (master weights a disk tier holds: the flats
        must not keep their memory)."""
        from .tiers.system import available_host_bytes

        groups: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        seen: set[int] = set(leave_out)
        for layer in self.layers:
            for is_param, tensors in ((True, layer.parameters()), (False, layer.buffers())):
                for t in tensors:
                    if id(t) not in seen and t.device.type == "cpu":
                        seen.add(id(t))
                        groups[(is_param, t.dtype)].append(t)
        need = max(
            (sum(t.numel() * t.element_size() for t in ts) for ts in groups.values()), default=0
        )
        available = available_host_bytes() if available is None else available
        if available is not None and need > available:
            why = (
                f"host memory: laying out the weights in flat buffers needs {format_bytes(need)} "
                f"free at once but {format_bytes(available)} are available"
            )
            if self.pin:
                raise HarmonyError(
                    f"{why}; page-locked weights need it on CUDA: free host memory first"
                )
            warnings.warn(f"{why}: weights are copied tensor by tensor", stacklevel=3)
            return
        with self._lock:
            self._flats, self._grads = {}, {}  # the old ones go once nothing views them
        with torch.no_grad():
            for (is_param, _), tensors in groups.items():
                flat = torch.empty(
                    sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=self.pin
                )
                if is_param:
                    self._flats[flat.untyped_storage().data_ptr()] = flat
                offset = 0
                for t in tensors:
                    n = t.numel()
                    view = flat[offset : offset + n].view(t.shape)
                    view.copy_(t)
                    t.data = view
                    offset += n
        self.flattened = True

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """Where the gradient of host parameter ``p`` lands: a view of the flat
        gradient buffer of ``p``'s flat (at the same offset), made once."""
        key = p.untyped_storage().data_ptr()
        with self._lock:
            flat = self._grads.get(key)
            if flat is None and key in self._flats:
                like = self._flats[key]
                flat = self._grads[key] = torch.empty(
                    like.numel(), dtype=like.dtype, pin_memory=self.pin
                )
                self.allocations += 1
                self.allocated_bytes += flat.numel() * flat.element_size()
            if flat is not None:
                return flat[p.storage_offset() : p.storage_offset() + p.numel()].view(p.shape)
            loose = self._loose_grads.get(id(p))
            if loose is None:
                loose = self._loose_grads[id(p)] = torch.empty(
                    p.shape, dtype=p.dtype, pin_memory=self.pin
                )
                self.allocations += 1
                self.allocated_bytes += loose.numel() * loose.element_size()
            return loose

    def has_grad_buffer(self, p: torch.Tensor) -> bool:
        with self._lock:
            return p.untyped_storage().data_ptr() in self._grads or id(p) in self._loose_grads
