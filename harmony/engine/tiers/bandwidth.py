"""How fast a disk streams: a measurement of the directory at hand, and a
preset for a current NVMe drive."""

from __future__ import annotations

import os
import time
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
from .files import CHUNK, ChunkIO, byte_view

#: random bytes written over and over by the measurement (a file of random data,
#: so a compressing filesystem cannot shrink it; repeated, so making it is cheap)
_PATTERN = 64 << 20


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential bandwidth of a disk, bytes/s per direction. ``write`` rewrites
    a file in place, as the tier rewrites its slots once each has been
    written; ``first_write`` (where measured) writes a new file, allocating
    its blocks, as the first write into each slot does: much slower on some
    disks (thin-provisioned virtual disks, copy-on-write filesystems)."""

    read: float
    write: float
    source: str = ""
    first_write: float | None = None

    def __str__(self) -> str:
        first = (
            "" if self.first_write is None else f" (new file {format_bytes(self.first_write)}/s)"
        )
        return (
            f"read {format_bytes(self.read)}/s, write {format_bytes(self.write)}/s{first} "
            f"({self.source})"
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
    where the filesystem allows, as the tier does by default).

    A file of ``size`` bytes is written, then rewritten, each fsync'd (the
    write times include the fsync: bytes on the disk, not in the page
    cache); its pages are then dropped from the page cache
    (``posix_fadvise(DONTNEED)``; direct I/O never put them there) so that
    the read comes from the disk and not from memory, and it is deleted. A
    virtual machine's disk may still be cached by its host: then this
    measures that."""
    directory = usable_directory(directory, create=False)
    nbytes = parse_bytes(size, "bandwidth probe size")
    check_room(directory, nbytes, "the bandwidth probe file")
    pattern = torch.randint(0, 256, (min(nbytes, _PATTERN),), dtype=torch.uint8)
    view = byte_view(pattern)
    pieces = [(at, view[: min(len(view), nbytes - at)]) for at in range(0, nbytes, len(view))]
    path = directory / f".bandwidth-probe-{os.getpid()}"
    io = ChunkIO(threads, chunk, direct=direct)
    try:
        fd = io.open(path, write=True)
        try:
            write_s = []
            for _ in range(2):  # a new file, then the same blocks again
                started = time.perf_counter()
                io.write(fd, 0, pieces, nbytes, checksum=False)
                os.fsync(fd)
                write_s.append(time.perf_counter() - started)
            if hasattr(os, "posix_fadvise"):  # the pages are clean after fsync: this drops them
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            started = time.perf_counter()
            io.read(fd, 0, pieces, nbytes, checksum=False)  # into the pattern: contents are moot
            read_s = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        io.close()
        path.unlink(missing_ok=True)
    where = f"measured in {directory}, {format_bytes(nbytes)} file"
    return DiskBandwidth(
        read=nbytes / read_s,
        write=nbytes / write_s[1],
        first_write=nbytes / write_s[0],
        source=where + ("" if direct else ", through the page cache"),
    )
