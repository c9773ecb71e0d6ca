"""How fast a disk streams: a measurement of the directory at hand, and a
preset for a current NVMe drive."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ...costs.hardware import (
    NVME_PCIE4_READ,
    NVME_PCIE4_SOURCE,
    NVME_PCIE4_WRITE,
    format_bytes,
    parse_bytes,
)
from .directory import check_room, usable_directory
from .files import CHUNK, PAGE, ChunkIO, byte_view

#: random bytes written over and over by the measurement (a file of random data,
#: so a compressing filesystem cannot shrink it; repeated, so making it is cheap)
_PATTERN = 64 << 20


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential bandwidth of a disk, bytes/s per direction. ``write`` rewrites
    a file in place, as the tier rewrites its slots once each has been
    written; ``first_write`` (where measured) writes a new file, allocating
    its blocks, as the first write into each slot does: much slower on some
    disks (thin-provisioned virtual disks, copy-on-write filesystems).
    ``shared``: a read and a write at once took nearer the sum of their times
    alone than the longer of them (the disk's time is shared between
    directions; ``Hardware.disk_shared``); ``mixed_s`` / ``alone_s``: those
    times, where measured (both at once; read alone, write alone)."""

    read: float
    write: float
    source: str = ""
    first_write: float | None = None
    shared: bool = False
    mixed_s: float | None = None
    alone_s: tuple[float, float] | None = None

    def __str__(self) -> str:
        first = (
            "" if self.first_write is None else f" (new file {format_bytes(self.first_write)}/s)"
        )
        mixed = ""
        if self.mixed_s is not None and self.alone_s is not None:
            read_s, write_s = self.alone_s
            mixed = (
                f"; a read and a write at once {self.mixed_s:.3f} s against {read_s:.3f} + "
                f"{write_s:.3f} s alone: " + ("shared" if self.shared else "full duplex")
            )
        return (
            f"read {format_bytes(self.read)}/s, write {format_bytes(self.write)}/s{first}"
            f"{mixed} ({self.source})"
        )


#: A PCIe 4.0 x4 NVMe SSD: the numbers (and where they come from) are
#: :mod:`harmony.costs.hardware`'s, which the simulator's ``Hardware.with_disk("nvme")``
#: uses too.
NVME_PCIE4 = DiskBandwidth(read=NVME_PCIE4_READ, write=NVME_PCIE4_WRITE, source=NVME_PCIE4_SOURCE)


def measure_disk_bandwidth(
    directory: str | Path = ".",
    size: str | int = "256MB",
    *,
    threads: int = 4,
    chunk: int = CHUNK,
    direct: bool = True,
) -> DiskBandwidth:
    """Sequential write then read bandwidth of ``directory``'s filesystem,
    bytes/s, through the disk tier's own I/O path (``threads`` requests of
    ``chunk`` bytes in flight, no checksums; ``direct``: with ``O_DIRECT``
    where the filesystem allows, as the tier does by default), and whether a
    read and a write at once share the disk's time.

    A file of ``size`` bytes is written, then rewritten, each fsync'd (the
    write times include the fsync: bytes on the disk, not in the page
    cache); its pages are then dropped from the page cache
    (``posix_fadvise(DONTNEED)``; direct I/O never put them there) so that
    the read comes from the disk and not from memory, and it is deleted. A
    virtual machine's disk may still be cached by its host: then this
    measures that.

    Then the first half of the file is read while its second half is
    rewritten, at once, each on its own I/O threads as the tier's DISK_IN and
    DISK_OUT are: ``shared`` where that takes nearer the sum of the two
    halves' times alone (at the bandwidths just measured) than the longer of
    them."""
    directory = usable_directory(directory, create=False)
    nbytes = parse_bytes(size, "bandwidth probe size")
    check_room(directory, nbytes, "the bandwidth probe file")
    pattern = torch.randint(0, 256, (min(nbytes, _PATTERN),), dtype=torch.uint8)
    view = byte_view(pattern)

    def pieces(size: int) -> list:  # the pattern, repeated over ``size`` bytes
        return [(at, view[: min(len(view), size - at)]) for at in range(0, size, len(view))]

    half = nbytes // 2 // PAGE * PAGE
    path = directory / f".bandwidth-probe-{os.getpid()}"
    io = ChunkIO(threads, chunk, direct=direct)
    try:
        fd = io.open(path, write=True)
        try:
            write_s = []
            for _ in range(2):  # a new file, then the same blocks again
                started = time.perf_counter()
                io.write(fd, 0, pieces(nbytes), nbytes, checksum=False)
                os.fsync(fd)
                write_s.append(time.perf_counter() - started)
            _drop_cache(fd)
            started = time.perf_counter()
            # into the pattern: contents are moot
            io.read(fd, 0, pieces(nbytes), nbytes, checksum=False)
            read_s = time.perf_counter() - started
            _drop_cache(fd)
            mixed_s = time_at_once(
                lambda: io.read(fd, 0, pieces(half), half, checksum=False),
                lambda: (io.write(fd, half, pieces(half), half, checksum=False), os.fsync(fd)),
            )
        finally:
            os.close(fd)
    finally:
        io.close()
        path.unlink(missing_ok=True)
    where = f"measured in {directory}, {format_bytes(nbytes)} file"
    alone = (half * read_s / nbytes, half * write_s[1] / nbytes)
    return DiskBandwidth(
        read=nbytes / read_s,
        write=nbytes / write_s[1],
        first_write=nbytes / write_s[0],
        source=where + ("" if direct else ", through the page cache"),
        shared=mixed_s > (max(alone) + sum(alone)) / 2,
        mixed_s=mixed_s,
        alone_s=alone,
    )


def _drop_cache(fd: int) -> None:
    """Drop the file's pages from the page cache (they are clean after fsync), so
    the next read comes from the disk; direct I/O never put them there."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def time_at_once(*jobs) -> float:
    """Seconds until every job, each started at once on a thread of its own, ends."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        for job in [pool.submit(j) for j in jobs]:
            job.result()
    return time.perf_counter() - started
