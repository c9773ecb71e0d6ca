"""What the operating system says about this process and its files: the host
memory it may still take, what it holds, its peak, and durable renames. A leaf:
the storage tiers and the engine above them both use it."""

from __future__ import annotations

import os
from pathlib import Path


def available_host_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (None: unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now (None: unknown)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory (None: unknown). Read from the
    kernel's ``VmHWM``, not ``getrusage``'s ``ru_maxrss``, which a process
    started by fork + exec inherits from its parent: a small child of a big
    test runner would report the runner's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def reset_peak_resident() -> bool:
    """Start :func:`peak_resident_bytes` anew from the resident memory now (the
    kernel's ``clear_refs``); whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` survive a power cut."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
