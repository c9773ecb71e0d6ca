"""The disk tier against the disk it runs on, measured side by side in one run.

1. Sequential write and read bandwidth of ``--dir``'s filesystem (a
   ``--probe`` file, fsync'd, read back from the disk, not the page cache),
   with the tier's direct I/O and through the page cache.
2. Streaming the AdamW state (``exp_avg`` and ``exp_avg_sq``, float32) of a
   model of ``--params`` bytes of float32 parameters, cut into ``--packs``
   packs, as the update tasks would: per step, every pack's state is read
   (the next pack's read overlapping this pack's write-back), written back to
   the other slot, fsync'd, and the step committed. Step 1 writes each
   pack's second slot for the first time (new blocks); later steps rewrite
   slots in place, the steady state. Printed per step: seconds, bytes/s
   (read + written), and the ratio of the time the measured bandwidths allow
   (read bytes / read bandwidth + written bytes / write bandwidth, new-file
   bandwidth for step 1) to the time taken (1.0: as fast as the probe; above
   1.0 when reads and writes overlap); also the peak resident memory of the
   process and how much the page cache grew, against the state's size.
3. The tier's CRC-32 (ISA-L's, where the ``isal`` package is installed)
   against zlib's: throughput on one core, and section 2's stream again with
   zlib's, steady-state step time side by side.
4. Reads and writes at once: one pack's state read while another's is
   written, against each alone: is the disk full duplex, or do reads and
   writes share its time (``Hardware.disk_shared``, which the engine's
   ``measure_disk_bandwidth`` finds out with its probe file too)?
5. One pack's state read through a memory map (``numpy.memmap`` copied into
   a buffer) against the tier's read into its staging buffer: time and the
   resident memory the map adds while it is open.

Defaults stream the state of a ~1.5 GB model (3 GB of state, 6 GB on disk
while the run lasts) in under two minutes on a disk of ~0.5 GB/s or more.

    python bench/disk_tier.py [--dir .] [--params 1.5GB] [--packs 12] [--steps 3] [--probe 512MB]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from harmony.costs.hardware import format_bytes, parse_bytes
from harmony.engine.host_memory import peak_resident_bytes
from harmony.engine.tiers import NVME_PCIE4, DiskTier, HostBudget, files, measure_disk_bandwidth
from harmony.engine.tiers.bandwidth import time_at_once


def meminfo(field: str) -> int:
    """A /proc/meminfo or /proc/self/status field, bytes (0 where there is none)."""
    for path in ("/proc/meminfo", "/proc/self/status"):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    return 0


def stream(directory: Path, pack_numel: int, packs: int, steps: int) -> dict:
    """Write every pack's state once, then ``steps`` steps of read-back-write."""
    state = {
        "exp_avg": torch.randn(pack_numel),
        "exp_avg_sq": torch.rand(pack_numel),
        "step": torch.tensor(1.0),
    }
    budget = HostBudget()
    with DiskTier.create(directory, state_bytes=packs * 8 * pack_numel, budget=budget) as tier:
        for p in range(packs):
            tier.write(p, "optimizer", state)
        tier.commit(0)
        cached, times = meminfo("Cached"), []
        with ThreadPoolExecutor(1) as ahead:
            for step in range(1, steps + 1):
                started = time.perf_counter()
                read = ahead.submit(tier.read, 0, "optimizer")
                for p in range(packs):
                    staged = read.result()
                    if p + 1 < packs:  # the next pack's read overlaps this pack's write-back
                        read = ahead.submit(tier.read, p + 1, "optimizer")
                    tier.write(p, "optimizer", staged)
                    staged.release()
                tier.commit(step)
                times.append(time.perf_counter() - started)
        nbytes = tier.bytes_written // (steps + 1)  # one step's writes: every pack's state once
        return {
            "step_s": times,
            "bytes": nbytes,
            "cache_growth": meminfo("Cached") - cached,
            "budget_peak": budget.peak,
        }


def checksums(work: Path, pack_numel: int, packs: int, steps: int, step_s: list[float]) -> None:
    """The tier's CRC-32 (``files.crc32``: ISA-L's where installed) against
    zlib's: throughput on one buffer (the same checksum), then the stream of
    section 2 again with zlib's, its steady-state steps against ``step_s``."""
    buffer = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    rates = {}
    for name, fn in (("tier", files.crc32), ("zlib", zlib.crc32)):
        started = time.perf_counter()
        value = fn(buffer)
        rates[name] = (buffer.nbytes / (time.perf_counter() - started), value)
    same = rates["tier"][1] == rates["zlib"][1]
    print(
        f"\nCRC-32 on one core: the tier's ({files.crc32.__module__}) "
        f"{format_bytes(rates['tier'][0])}/s, zlib's {format_bytes(rates['zlib'][0])}/s "
        f"(x{rates['tier'][0] / rates['zlib'][0]:.2f}; same checksum: {same})"
    )
    if files.crc32 is zlib.crc32:
        return
    original = files.crc32
    files.crc32 = zlib.crc32
    try:
        with_zlib = stream(work / "tier-zlib", pack_numel, packs, steps)["step_s"]
    finally:
        files.crc32 = original
        shutil.rmtree(work / "tier-zlib", ignore_errors=True)
    if steps > 1:
        ours, theirs = statistics.median(step_s[1:]), statistics.median(with_zlib[1:])
        print(
            f"  steady-state step (median of steps 2..{steps}): {ours:.2f} s with the tier's "
            f"CRC-32, {theirs:.2f} s with zlib's: x{ours / theirs:.2f}"
        )


def duplex(directory: Path, packs: int) -> None:
    """Is the disk full duplex (reads and writes each at its bandwidth), or do
    they share its time (``Hardware.disk_shared``)? Pack 0's state read alone,
    pack 1's written alone, then pack 2's read while pack 3's is written: the
    time both take at once against the longer of the two alone (full duplex)
    and their sum (one shared disk)."""
    with DiskTier.open(directory) as tier:
        staged = tier.read(4 % packs, "optimizer")
        state = {name: t.clone() for name, t in staged.items()}
        staged.release()

        read_s = time_at_once(lambda: tier.read(0, "optimizer").release())
        write_s = time_at_once(lambda: tier.write(1 % packs, "optimizer", state))
        both_s = time_at_once(
            lambda: tier.read(2 % packs, "optimizer").release(),
            lambda: tier.write(3 % packs, "optimizer", state),
        )
    print(
        f"\none pack read and another written at once: {both_s:.2f} s; alone {read_s:.2f} s "
        f"and {write_s:.2f} s (full duplex: {max(read_s, write_s):.2f} s, one shared disk: "
        f"{read_s + write_s:.2f} s)"
    )


def mmap_vs_tier(directory: Path) -> tuple[float, int, float]:
    """Seconds and resident-memory growth of reading pack 0's state through a
    map; seconds through the tier."""
    with DiskTier.open(directory) as tier:
        started = time.perf_counter()
        tier.read(0, "optimizer").release()
        tier_s = time.perf_counter() - started
    path = directory / "pack-0.optimizer.0"  # either slot: both hold a whole state, same size
    before = meminfo("VmRSS")
    started = time.perf_counter()
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buffer = np.empty_like(mapped)
    np.copyto(buffer, mapped)
    map_s = time.perf_counter() - started
    grown = meminfo("VmRSS") - before - buffer.nbytes
    del mapped
    return map_s, grown, tier_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default=".", help="directory on the disk to measure (in a temporary subdirectory)"
    )
    parser.add_argument("--params", default="1.5GB", help="float32 parameter bytes of the model")
    parser.add_argument("--packs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--probe", default="512MB", help="size of the bandwidth probe file")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"disk of {Path(args.dir).absolute()}"
    )

    direct = measure_disk_bandwidth(args.dir, args.probe)
    cached = measure_disk_bandwidth(args.dir, args.probe, direct=False)
    print(f"measured, direct I/O:        {direct}")
    print(f"measured, page cache:        {cached}")
    print(f"preset NVME_PCIE4:           {NVME_PCIE4}")

    pack_numel = parse_bytes(args.params) // 4 // args.packs
    state_bytes = args.packs * 8 * pack_numel
    work = Path(tempfile.mkdtemp(prefix="disk-tier-bench-", dir=args.dir))
    try:
        got = stream(work / "tier", pack_numel, args.packs, args.steps)
        rss = peak_resident_bytes()
        moved = 2 * got["bytes"]  # read and written
        print(
            f"\nAdamW state of {format_bytes(parse_bytes(args.params))} of parameters: "
            f"{format_bytes(state_bytes)} in {args.packs} packs; per step (read + write back "
            f"+ commit) {format_bytes(moved)} moved"
        )
        for step, took in enumerate(got["step_s"], 1):
            write = direct.first_write if step == 1 else direct.write
            bound_s = got["bytes"] / direct.read + got["bytes"] / write
            print(
                f"  step {step}{' (new slot files)' if step == 1 else ''}: {took:.2f} s, "
                f"{format_bytes(moved / took)}/s; the probe's bandwidth allows {bound_s:.2f} s: "
                f"ratio {bound_s / took:.2f}"
            )
        nvme_s = got["bytes"] / NVME_PCIE4.read + got["bytes"] / NVME_PCIE4.write
        print(
            f"  on a PCIe 4 NVMe drive (preset): {nvme_s:.2f} s per step at its spec-sheet "
            "bandwidth"
        )
        print(
            f"  peak RSS {format_bytes(rss)}, tier staging + I/O buffers "
            f"{format_bytes(got['budget_peak'])}, page cache grew "
            f"{format_bytes(got['cache_growth'])} (state {format_bytes(state_bytes)})"
        )
        checksums(work, pack_numel, args.packs, args.steps, got["step_s"])
        duplex(work / "tier", args.packs)
        map_s, grown, tier_s = mmap_vs_tier(work / "tier")
        pack_bytes = 8 * pack_numel
        print(
            f"\none pack ({format_bytes(pack_bytes)}) read: tier "
            f"{format_bytes(pack_bytes / tier_s)}/s; numpy.memmap + copy "
            f"{format_bytes(pack_bytes / map_s)}/s, with {format_bytes(grown)} more resident "
            "while mapped"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
