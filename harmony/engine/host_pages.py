"""Host memory pages: freed tensors given back to the operating system, and
huge pages for large buffers that are made afresh.

Both keep the process's resident memory close to what it uses: a
:class:`~harmony.engine.tiers.HostBudget` charges what is in use, and an
emulated GPU, whose copies are host memory, holds no more than its ledger
(see :mod:`harmony.engine.devices`).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

#: glibc's mallopt parameter for its mmap threshold
_M_MMAP_THRESHOLD = -3
#: allocations of this size or more get their own mapping (see below)
MMAP_THRESHOLD = 1 << 20


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def return_freed_memory() -> bool:
    """Make freed host tensors of a MB or more go back to the operating system,
    so the process's resident memory follows what is in use.

    glibc's malloc serves an allocation below its mmap threshold from its heaps,
    and raises the threshold (up to 32 MB) each time a larger mapped block is
    freed: from then on, tensors of a few MB freed in the middle of a heap stay
    resident, and a run of staging reads and weight copies drifts past its
    budget (by 8% on an 8-layer model of width 2048). Setting the threshold
    fixes it; and what is free in the heaps now goes back (``malloc_trim``), so
    the resident memory measured next is what is in use. Returns False where
    there is no glibc (nothing changes)."""
    try:
        _LIBC.malloc_trim(0)
        return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except AttributeError:
        return False


def fresh_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements in memory of its own (contents
    undefined), given back to the operating system when its last view goes.

    From :data:`MMAP_THRESHOLD` up it is a mapping of its own (``mmap``), so it
    goes back whatever malloc's threshold is (setting that threshold for the whole
    process, as :func:`return_freed_memory` does, would make every large tensor
    of the process's computations a mapping of its own, paid in page faults), and
    the kernel is advised to back it with huge pages (``MADV_HUGEPAGE``), which
    makes its first writes several times faster than page by page."""
    nbytes = numel * dtype.itemsize
    if nbytes < MMAP_THRESHOLD:
        return torch.empty(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes)  # anonymous and private; the tensor keeps it alive
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)  # advice: ignored where unsupported
    return torch.frombuffer(region, dtype=dtype, count=numel)
