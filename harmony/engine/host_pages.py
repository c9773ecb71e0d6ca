"""Host memory pages: freed tensors given back to the operating system, and
huge pages for large buffers that are made afresh.

Both keep the process's resident memory close to what it uses: a
:class:`~harmony.engine.tiers.HostBudget` charges what is in use, and an
emulated GPU, whose copies are host memory, holds no more than its ledger
(see :mod:`harmony.engine.devices`).
"""

from __future__ import annotations

import ctypes

import torch

#: glibc's mallopt parameter for its mmap threshold
_M_MMAP_THRESHOLD = -3
#: allocations of this size or more get their own mapping (see below)
MMAP_THRESHOLD = 1 << 20
#: Linux's madvise advice for transparent huge pages, and their size on x86-64 and arm64
_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
if _LIBC is not None and hasattr(_LIBC, "madvise"):
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


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
    undefined), freed when its last view goes. Where it spans huge pages the
    kernel is advised to back it with them (``MADV_HUGEPAGE``), which makes its
    first writes several times faster than page by page: a buffer made anew
    for every copy costs about what reusing one does."""
    t = torch.empty(numel, dtype=dtype)
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the huge pages wholly inside it
    end = (t.data_ptr() + numel * dtype.itemsize) // HUGE_PAGE * HUGE_PAGE
    if end > start and _LIBC is not None and hasattr(_LIBC, "madvise"):
        _LIBC.madvise(start, end - start, _MADV_HUGEPAGE)  # advice: ignored where unsupported
    return t
