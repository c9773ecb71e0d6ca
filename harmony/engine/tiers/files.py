"""Bytes between tensors and files: large positional reads and writes, cut
into chunks that a few threads move at once (``pread``/``pwrite`` release the
GIL, so several requests are in flight, as a fast SSD needs), each chunk
checksummed (CRC-32, ISA-L's where the ``isal`` package is installed: zlib's
checksum several times faster) and optionally paced to a bandwidth.

Files are opened with ``O_DIRECT`` where the filesystem takes it: requests go
to the disk without passing through the page cache, so the cache does not
fill with the stream (and evict what the host needs), and a write is not a
copy into dirty pages that ``fsync`` later flushes in small pieces. Direct
I/O needs page-aligned memory, offsets and lengths, so each thread moves its
chunk through an aligned buffer of its own (one memory copy, the one a
buffered read or write makes in the kernel anyway). Where ``O_DIRECT`` is
refused (tmpfs, some network filesystems), the same requests go through the
page cache and ``posix_fadvise(DONTNEED)`` drops each chunk once moved.

Why explicit reads and not memory maps: a mapped page counts toward the
process's resident memory for as long as the kernel keeps it, so streaming a
state larger than the host through a map is bounded by nobody; a read into a
buffer the :class:`~harmony.engine.tiers.HostBudget` charges is bounded by
the budget.

A tier file is a header (magic line, the JSON description of its contents,
padded to a multiple of :data:`PAGE`) followed by the payload: the tensors,
each starting at a multiple of :data:`ALIGN`, zeros in between, the whole
padded to a multiple of :data:`PAGE`.
"""

from __future__ import annotations

import bisect
import errno
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ...errors import HarmonyError
from .pacing import LinkPacer
from .system import fsync_dir

try:  # ISA-L's CRC-32: zlib's checksum (the same values), ~3x faster with vector instructions
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal's wheels: zlib's own
    from zlib import crc32

#: what a ChunkIO moves, each on threads of its own
DIRECTIONS = ("read", "write")
#: the paced link of a disk whose reads and writes share its time (ChunkIO ``shared``)
SHARED_DISK = "disk"
#: bytes one thread moves per request: large enough for sequential speed, small
#: enough that several threads keep a drive's queue busy
CHUNK = 32 << 20
#: the unit of direct I/O: the payload starts, and every request starts and ends,
#: at a multiple of it (a page, and a multiple of any disk's logical block)
PAGE = 4096
#: where each tensor starts in the payload: a cache line, every dtype's alignment
ALIGN = 64
MAGIC = b"harmony-disk-tier 1\n"
_FADVISE = hasattr(os, "posix_fadvise")


class DiskTierError(HarmonyError):
    """A disk tier that cannot be used as asked: a bad directory or tensors, damaged state."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, dtype, shape and offset in the payload."""

    name: str
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_json(cls, item: list) -> "Entry":
        return cls(str(item[0]), str(item[1]), tuple(int(d) for d in item[2]), int(item[3]))


def layout_of(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[Entry, ...], int]:
    """Where each tensor goes in a payload, and the payload's size."""
    entries, at = [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise DiskTierError(f"the disk tier stores host tensors; {name!r} is {where}")
        entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), at))
        at = round_up(at + entries[-1].nbytes, ALIGN)
    return tuple(entries), at


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if not t.is_contiguous():
        raise DiskTierError(
            f"the disk tier moves contiguous tensors; got one of shape "
            f"{tuple(t.shape)} and strides {t.stride()}: pass t.contiguous()"
        )
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def segments(
    layout: tuple[Entry, ...], size: int, tensors: Mapping[str, torch.Tensor], for_read: bool
) -> list[tuple[int, memoryview]]:
    """The payload as (offset, bytes) pieces in order: each tensor's bytes and
    the padding after it (zeros to write, or scratch to read padding into)."""
    out, at = [], 0
    for e in layout:
        if e.offset > at:
            pad = bytearray(e.offset - at) if for_read else bytes(e.offset - at)
            out.append((at, memoryview(pad)))
        if e.nbytes:
            t = tensors[e.name]
            if t.dtype != e.torch_dtype or tuple(t.shape) != e.shape:
                got = str(t.dtype).removeprefix("torch.")
                raise DiskTierError(
                    f"the disk tier holds {e.name!r} as {e.dtype} "
                    f"{list(e.shape)}; got a {got} {list(t.shape)} tensor"
                )
            out.append((e.offset, byte_view(t)))
        at = e.offset + e.nbytes
    if size > at:
        out.append((at, memoryview(bytearray(size - at) if for_read else bytes(size - at))))
    return out


def header_bytes(info: dict) -> bytes:
    """A file's header for ``info``, padded to a multiple of :data:`PAGE`."""
    head = MAGIC + json.dumps(info, sort_keys=True).encode() + b"\n"
    return head + b" " * (round_up(len(head), PAGE) - len(head))


def aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of memory starting at a page boundary, as direct I/O needs."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + nbytes]


class ChunkIO:
    """Moves payloads between memory and files, chunk by chunk, on ``threads``
    threads per direction (reads and writes have threads of their own, so a
    write-back never queues an urgent read behind its chunks, and a disk that
    can read and write at once does); paced to ``read_rate`` / ``write_rate``
    bytes/s where given (the caller's thread sleeps for the rest of the
    payload's bytes / rate once its chunks are moved, as the emulated GPU
    links do, so a laptop can study a slow disk; the I/O threads never sleep,
    so a paced read and a paced write each get their own bandwidth).
    ``shared``: the paced reads and writes share the disk's time instead (a
    payload of n bytes takes n / rate of it, after what is queued there: a
    read and a write at once take the sum of their times, as on a disk that
    is not full duplex). ``direct``: try
    ``O_DIRECT`` (see the module docstring)."""

    def __init__(
        self,
        threads: int = 4,
        chunk: int = CHUNK,
        read_rate: float | None = None,
        write_rate: float | None = None,
        *,
        shared: bool = False,
        direct: bool = True,
    ):
        if shared and not (read_rate and write_rate):
            raise DiskTierError(
                "a disk whose reads and writes share its time (shared=True) is paced to both "
                f"bandwidths: give read_rate and write_rate, got {read_rate!r} and {write_rate!r}"
            )
        if chunk <= 0 or chunk % PAGE:
            raise DiskTierError(
                f"the disk tier's chunk must be a positive multiple of {PAGE} bytes, got {chunk}"
            )
        self.chunk, self.threads = chunk, max(1, threads)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.rates = {"read": read_rate, "write": write_rate}
        self.shared = shared
        # shared: one queue of disk-seconds (a link of 1 s/s that a payload takes
        # n / rate of); else one queue of bytes per direction
        links = {SHARED_DISK: 1.0} if shared else {k: v for k, v in self.rates.items() if v}
        self.pacer = LinkPacer(links)
        self.pools = {
            how: ThreadPoolExecutor(self.threads, thread_name_prefix=f"disk-tier-{how}")
            for how in DIRECTIONS
        }
        self.bytes = {"read": 0, "write": 0}
        self._local = threading.local()  # each thread's aligned buffer

    @property
    def buffer_bytes(self) -> int:
        """Host memory of the threads' aligned buffers (once each has run; more
        while reading a payload written with larger chunks)."""
        return len(DIRECTIONS) * self.threads * self.chunk

    def open(self, path: Path, write: bool) -> int:
        """A file descriptor for ``path`` (made if ``write``): direct where the
        filesystem allows."""
        flags = os.O_RDWR | os.O_CREAT if write else os.O_RDONLY
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as err:
                if err.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                    raise
        return os.open(path, flags, 0o644)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)

    def write(
        self,
        fd: int,
        offset: int,
        pieces: list[tuple[int, memoryview]],
        size: int,
        checksum: bool = True,
    ) -> list[int] | None:
        """Write the payload ``pieces`` (``size`` bytes, zeros after it up to a
        multiple of :data:`PAGE`) at ``offset``; with ``checksum``, returns the
        CRC-32 of each chunk."""
        return self._run(fd, offset, pieces, size, "write", checksum, self.chunk)

    def read(
        self,
        fd: int,
        offset: int,
        pieces: list[tuple[int, memoryview]],
        size: int,
        checksum: bool,
        chunk: int | None = None,
    ) -> list[int] | None:
        """Read a payload of ``size`` bytes at ``offset`` into ``pieces`` (none: only
        to check it); with ``checksum``, returns the CRC-32 of each ``chunk``
        bytes (default: this object's chunk; give the one the payload was
        written with)."""
        return self._run(fd, offset, pieces, size, "read", checksum, chunk or self.chunk)

    def write_block(self, fd: int, offset: int, data: bytes) -> None:
        """Write ``data`` (a multiple of :data:`PAGE` bytes) at ``offset``, on this thread."""
        buffer = aligned(len(data))
        buffer[:] = np.frombuffer(data, dtype=np.uint8)
        _transfer(fd, memoryview(buffer), offset, write=True)

    def _run(self, fd, offset, pieces, size, how, checksum, chunk):
        started = time.perf_counter()
        starts = [s for s, _ in pieces]
        jobs = [
            self.pools[how].submit(
                self._chunk,
                fd,
                offset + a,
                min(size, a + chunk) - a,
                _pieces(pieces, starts, a, min(size, a + chunk)),
                how,
                checksum,
            )
            for a in range(0, size, chunk)
        ]
        wait(jobs)  # all of them, so none still touches the buffers when a failure is raised
        crcs = [job.result() for job in jobs]
        if self.shared:
            self.pacer.wait((SHARED_DISK,), size / self.rates[how], math.inf, started)
        elif self.rates[how]:
            self.pacer.wait((how,), size, self.rates[how], started)
        self.bytes[how] += size
        return crcs if checksum else None

    def _chunk(
        self, fd: int, offset: int, nbytes: int, pieces: list[memoryview], how: str, checksum: bool
    ) -> int | None:
        """Move ``nbytes`` at ``offset`` through this thread's aligned buffer,
        from or to ``pieces``."""
        span = round_up(nbytes, PAGE)
        buffer = self._buffer(span)
        if how == "write":
            at = 0
            for p in pieces:  # numpy copies without the GIL
                np.copyto(buffer[at : at + len(p)], np.frombuffer(p, dtype=np.uint8))
                at += len(p)
            buffer[nbytes:span] = 0
            _transfer(fd, memoryview(buffer[:span]), offset, write=True)
        else:
            _transfer(fd, memoryview(buffer[:span]), offset, write=False)
            at = 0
            for p in pieces:
                np.copyto(np.frombuffer(p, dtype=np.uint8), buffer[at : at + len(p)])
                at += len(p)
        crc = crc32(buffer[:nbytes]) if checksum else None  # releases the GIL
        if _FADVISE:  # without O_DIRECT: drop the pages (after a write: start their write-back)
            os.posix_fadvise(fd, offset, span, os.POSIX_FADV_DONTNEED)
        return crc

    def _buffer(self, nbytes: int) -> np.ndarray:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < nbytes:  # larger: a payload written with larger chunks
            buffer = self._local.buffer = aligned(max(nbytes, self.chunk))
        return buffer


def _pieces(
    pieces: list[tuple[int, memoryview]], starts: list[int], a: int, b: int
) -> list[memoryview]:
    """The parts of ``pieces`` that cover payload bytes ``[a, b)``."""
    out = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(pieces) and starts[i] < b:
        s, mv = pieces[i]
        lo, hi = max(a, s) - s, min(b, s + len(mv)) - s
        if hi > lo:
            out.append(mv[lo:hi])
        i += 1
    return out


def _transfer(fd: int, buffer: memoryview, offset: int, write: bool) -> None:
    """A positional read or write of ``buffer``, resumed where the kernel
    stopped short (it may move fewer bytes than asked)."""
    while len(buffer):
        n = os.pwrite(fd, buffer, offset) if write else os.preadv(fd, [buffer], offset)
        if n == 0:
            raise DiskTierError("a disk tier file ended before its payload did: it is truncated")
        offset += n
        buffer = buffer[n:]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a reader, even after a crash, sees the
    old contents or the new, never a mixture: temp file, fsync, rename, fsync
    of the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def no_space(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)
