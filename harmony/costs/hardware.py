"""What the server is: GPUs, their memory, the links between host and GPUs and
between GPUs, the CPU that runs the optimizer, host memory and the disk under it.

Bandwidths are bytes per second **per direction**. GPUs hang off PCIe
switches: each GPU has its own link to its switch, and each switch has one
uplink to the host that its GPUs share. A host<->GPU copy is limited by both.
Host memory is a budget: training state that does not fit it goes to a disk
tier when the server has one (``disk_read`` / ``disk_write``; see
:mod:`harmony.costs.placement`).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict, dataclass, replace

from ..errors import HarmonyError

GiB = 1024**3
GB = 10**9
#: bytes/s a GTX 1080 Ti's optimizer step streams: an assumption (not measured), most of
#: its 484 GB/s of memory bandwidth (the step is short next to its state's trip over PCIe)
GTX_1080TI_UPDATE_BANDWIDTH = 400e9
#: what fraction of its memory bandwidth an H100's fused AdamW step streams, measured
#: (bench/gpu.py, an H100 SXM: the resident update of a 255 M GPT-2, 7.6 GB streamed in
#: 5-6 ms, ~1.4 TB/s of its 3.35 TB/s); the presets of other recent GPUs assume it too
MEASURED_UPDATE_FRACTION = 0.4
#: what :attr:`Hardware.task_overhead_s` is charged to
OVERHEAD_PER = ("task", "pack")


@dataclass(frozen=True)
class Hardware:
    name: str
    n_gpus: int
    gpu_memory: int  # bytes usable by tensors on one GPU
    gpu_flops: float  # FLOP/s that layers without a measured time achieve (fp32)
    h2d: float  # bytes/s, host -> one GPU, through its own PCIe link
    d2h: float  # bytes/s, one GPU -> host
    uplink: float  # bytes/s per direction, shared by the GPUs of one switch
    gpus_per_switch: int  # GPUs sharing one uplink
    p2p: float | None  # bytes/s GPU -> GPU on one switch; None: no peer access, goes via host
    cpu_update_bandwidth: float  # bytes/s the CPU optimizer streams (reads + writes)
    cpu_update_workers: int  # optimizer steps that can run in parallel on the host
    host_memory: int  # bytes of host RAM
    notes: str = ""
    #: bytes/s an optimizer step on a GPU streams, counted as ``cpu_update_bandwidth`` is
    #: (weights, gradient and state read, weights and state written): the resident plan's
    #: update and the swapping baselines' ``gpu_optimizer``. The engine measures it on the
    #: device at hand (:func:`harmony.engine.rates.update_bandwidth`); the default is
    #: an assumption for a GTX 1080 Ti, most of its 484 GB/s of memory bandwidth
    gpu_update_bandwidth: float = GTX_1080TI_UPDATE_BANDWIDTH
    #: seconds of fixed cost (launch, Python, synchronisation, freeing) on top of the
    #: compute, charged as ``overhead_per`` says; the Harmony authors' simulator uses
    #: 40 ms (time_del), and the engine's profiler measures it for the device at hand
    task_overhead_s: float = 0.0
    #: what ``task_overhead_s`` is charged to: ``"task"``, every GPU compute task (each
    #: microbatch's FWD, REC, BWD, FWDBWD: what the engine pays, and what its profiler
    #: measures), or ``"pack"``, once per pack task (a pack's weight group: its run over
    #: a group of microbatches while its weights are resident), as the Harmony authors'
    #: simulator charges time_del (there at the task's end, here on its first compute
    #: task: the same total)
    overhead_per: str = "task"
    #: bytes/s of the disk tier under host memory, disk -> host and host -> disk (the
    #: sequential streams of whole per-pack files); None: no disk tier, so the training
    #: state must fit ``host_memory``. Both or neither.
    disk_read: float | None = None
    disk_write: float | None = None
    #: whether reads and writes share the disk's time: a read and a write at once take the
    #: sum of their times alone (a disk that is not full duplex, as most are under mixed
    #: streams), and the simulator plays them on one link, ``host.disk``, that each byte
    #: read takes ``1/disk_read`` seconds of and each byte written ``1/disk_write``
    #: (:mod:`harmony.policies.disk_tier`); False: each direction streams at its own
    #: bandwidth whatever the other does
    disk_shared: bool = False

    def __post_init__(self) -> None:
        for fld in ("n_gpus", "gpus_per_switch", "cpu_update_workers"):
            v = getattr(self, fld)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HarmonyError(
                    f"hardware {self.name!r}: {fld} must be >= 1, got {getattr(self, fld)}"
                )

        def number(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        for fld in (
            "gpu_memory",
            "gpu_flops",
            "h2d",
            "d2h",
            "uplink",
            "cpu_update_bandwidth",
            "gpu_update_bandwidth",
            "host_memory",
        ):
            v = getattr(self, fld)
            if not number(v) or not v > 0:
                raise HarmonyError(
                    f"hardware {self.name!r}: {fld} must be a positive number, got {v!r}"
                )
        if not number(self.task_overhead_s) or not self.task_overhead_s >= 0:
            raise HarmonyError(
                f"hardware {self.name!r}: task_overhead_s must be >= 0, got "
                f"{self.task_overhead_s!r}"
            )
        if self.overhead_per not in OVERHEAD_PER:
            raise HarmonyError(
                f"hardware {self.name!r}: overhead_per must be one of "
                f"{', '.join(OVERHEAD_PER)}, got {self.overhead_per!r}"
            )
        for fld in ("p2p", "disk_read", "disk_write"):
            v = getattr(self, fld)
            if v is not None and (not number(v) or not v > 0):
                raise HarmonyError(
                    f"hardware {self.name!r}: {fld} must be positive or None, got {v!r}"
                )
        if (self.disk_read is None) != (self.disk_write is None):
            raise HarmonyError(
                f"hardware {self.name!r}: give both disk_read and disk_write (a disk tier) "
                f"or neither, got {self.disk_read!r} and {self.disk_write!r}"
            )
        if not isinstance(self.disk_shared, bool) or (self.disk_shared and not self.has_disk):
            raise HarmonyError(
                f"hardware {self.name!r}: disk_shared must be True or False, and True only "
                f"with a disk (disk_read and disk_write), got {self.disk_shared!r}"
            )

    @property
    def has_disk(self) -> bool:
        """Whether state that does not fit host memory can go to a disk tier."""
        return self.disk_read is not None

    def switch_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_switch

    def with_gpus(self, n: int) -> "Hardware":
        return replace(
            self, n_gpus=n, name=f"{self.name}[{n} gpus]" if n != self.n_gpus else self.name
        )

    def with_host_memory(self, size: str | int) -> "Hardware":
        """The same server with a host memory budget of ``size`` (bytes or ``"24GiB"``)."""
        return replace(self, host_memory=parse_bytes(size, "host memory"))

    def with_disk(self, disk: str | tuple | None) -> "Hardware":
        """The same server with a disk tier: a name in :data:`DISKS` (``"nvme"``),
        ``"<read>,<write>[,shared]"`` bandwidths (``"3GB/s,2GB/s"``; ``shared``: reads
        and writes share the disk's time, :attr:`disk_shared`), a (read, write) or
        (read, write, shared) tuple in bytes/s, or None for none."""
        if disk is None:
            return replace(self, disk_read=None, disk_write=None, disk_shared=False)
        read, write, shared = disk_rates(disk)
        return replace(self, disk_read=read, disk_write=write, disk_shared=shared)

    def disk_seconds(self, read_bytes: float, write_bytes: float) -> float:
        """The least time the disk takes to read and write these bytes: the sum of the
        two where they share its time (:attr:`disk_shared`), else the longer one."""
        read, write = read_bytes / self.disk_read, write_bytes / self.disk_write
        return read + write if self.disk_shared else max(read, write)

    def to_dict(self) -> dict:
        return asdict(self)


# The Harmony paper's testbed (see its entry in PRESETS for where each number comes from).
PAPER_4X1080TI = Hardware(
    name="paper-4x1080ti",
    n_gpus=4,
    gpu_memory=10 * GiB,
    gpu_flops=0.5 * 11.34e12,
    h2d=11.5 * GiB,
    d2h=11.5 * GiB,
    uplink=11.5 * GiB,
    gpus_per_switch=4,
    p2p=8.2 * GiB,
    # ~10 GB/s: the reference profiles' CPU AdamW takes 2.21 s for GPT-2 XL's
    # 6.55 GB of weights (x 7 tensors streamed, rounded down for caching).
    cpu_update_bandwidth=10 * GB,
    cpu_update_workers=4,
    host_memory=750 * GB,
    notes="Harmony paper server; link and memory constants from the authors' scheduler",
    # the scheduler's time_del: 40 ms once per task of its simulator, a pack over
    # its group of microbatches (its DEL event)
    task_overhead_s=0.04,
    overhead_per="pack",
)

# Every number below names where it comes from.
PRESETS: dict[str, Hardware] = {
    # The Harmony paper's testbed (VLDB 2022): 4 x GTX 1080 Ti (11 GB) behind one
    # PCIe 3.0 switch. Bandwidths and the usable memory are the constants of the
    # authors' scheduler (sched_args.py: bw_swap 11.5 GiB/s per direction,
    # bw_p2p 8.2 GiB/s, memory_cap 10 GiB); their simulator divides the host link
    # among the GPUs in use, which is what a shared uplink of bw_swap does.
    # 11.34 TFLOP/s fp32 is NVIDIA's boost-clock peak; layers of the zoo reach
    # about half of it (the reference profiles carry measured times instead).
    "paper-4x1080ti": PAPER_4X1080TI,
    # The paper's 8-GPU configuration: two such switches, each with its own uplink.
    "paper-8x1080ti": replace(
        PAPER_4X1080TI,
        name="paper-8x1080ti",
        n_gpus=8,
        cpu_update_workers=8,
        notes=(
            "two 4-GPU PCIe 3.0 switches, one uplink each "
            "(assumption: the paper does not draw the topology)"
        ),
    ),
    # One H100 80 GB PCIe on PCIe 5.0 x16: 64 GB/s theoretical, ~50 GB/s measured by
    # bandwidthTest-style copies from pinned memory; 51 TFLOP/s fp32 (NVIDIA
    # datasheet, PCIe card), of which ~60% is achievable on large GEMMs.
    "h100-pcie5": Hardware(
        name="h100-pcie5",
        n_gpus=1,
        gpu_memory=80 * GB,
        gpu_flops=0.6 * 51e12,
        h2d=50 * GB,
        d2h=50 * GB,
        uplink=50 * GB,
        gpus_per_switch=1,
        p2p=None,
        cpu_update_bandwidth=40 * GB,
        cpu_update_workers=8,
        host_memory=512 * GB,
        # assumed: the fraction an H100 SXM was measured at, of the PCIe card's 2.0 TB/s
        gpu_update_bandwidth=MEASURED_UPDATE_FRACTION * 2.0e12,
        notes="modern single-GPU box; datasheet peaks, derated as commented",
    ),
    # 8 x RTX 4090 (24 GB) on PCIe 4.0 x16 (~25 GB/s measured per direction),
    # 82.6 TFLOP/s fp32 peak. GeForce cards have peer-to-peer disabled, so
    # GPU->GPU goes through the host. Assumed two switches of 4 GPUs.
    "8x4090-pcie4": Hardware(
        name="8x4090-pcie4",
        n_gpus=8,
        gpu_memory=24 * GB,
        gpu_flops=0.5 * 82.6e12,
        h2d=25 * GB,
        d2h=25 * GB,
        uplink=25 * GB,
        gpus_per_switch=4,
        p2p=None,
        cpu_update_bandwidth=40 * GB,
        cpu_update_workers=16,
        host_memory=1024 * GB,
        # assumed: the fraction an H100 SXM was measured at, of the 4090's 1008 GB/s
        gpu_update_bandwidth=MEASURED_UPDATE_FRACTION * 1008 * GB,
        notes="commodity 8-GPU server; no P2P on GeForce; topology assumed",
    ),
}


#: A PCIe 4.0 x4 NVMe SSD as its spec sheet gives it: sequential read up to 7,000 MB/s
#: and write up to 5,000 MB/s (Samsung 980 PRO 1 TB data sheet; the typical figures of
#: that generation). Peaks at a deep queue: large sequential requests on several
#: threads come near them; writes slow down once the drive's SLC cache is full.
NVME_PCIE4_READ = 7.0e9
NVME_PCIE4_WRITE = 5.0e9
NVME_PCIE4_SOURCE = "PCIe 4.0 NVMe spec sheet (Samsung 980 PRO 1 TB)"
#: disks by name, for :meth:`Hardware.with_disk` and ``--disk``: (read, write) bytes/s
DISKS: dict[str, tuple[float, float]] = {"nvme": (NVME_PCIE4_READ, NVME_PCIE4_WRITE)}


#: the word after a disk's bandwidths that says reads and writes share its time
SHARED = "shared"


def parse_disk(text: str, what: str = "disk") -> tuple[float, float, bool]:
    """``"nvme"`` -> the preset's (read, write, False); ``"3GB/s,2GB/s"`` ->
    (3e9, 2e9, False); ``"3GB/s,2GB/s,shared"`` -> (3e9, 2e9, True): reads and
    writes share the disk's time (:attr:`Hardware.disk_shared`)."""
    name = str(text).strip().lower()
    if name in DISKS:
        return (*DISKS[name], False)
    parts = [p.strip() for p in str(text).split(",")]
    shared = len(parts) == 3 and parts[2].lower() == SHARED
    if len(parts) != 2 and not shared:
        raise HarmonyError(
            f"cannot read {what} {text!r}: give a disk by name ({', '.join(DISKS)}) or its "
            f"read and write bandwidths, e.g. '3GB/s,2GB/s', and ',{SHARED}' after them where "
            "reads and writes share the disk's time (a read and a write at once take the sum "
            "of their times)"
        )
    read = parse_rate(parts[0], f"{what} read bandwidth")
    return read, parse_rate(parts[1], f"{what} write bandwidth"), shared


def disk_rates(disk: str | tuple) -> tuple[float, float, bool]:
    """(read bytes/s, write bytes/s, whether reads and writes share the disk's time)
    of a disk given as :func:`parse_disk` reads it, or as a (read, write) or
    (read, write, shared) tuple."""
    if isinstance(disk, str):
        return parse_disk(disk)
    read, write, *shared = disk
    return float(read), float(write), bool(shared and shared[0])


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise HarmonyError(
            f"unknown hardware preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int | float, what: str = "size") -> int:
    """``"256MB"`` -> 256_000_000, ``"1.5GiB"``, ``1024`` -> 1024. Clear error on junk."""
    return int(_parse_amount(value, what))


def _parse_amount(value: str | int | float, what: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise HarmonyError(
                f"cannot read {what} {value!r}: write a number with an optional unit, "
                f"e.g. '256MB', '1.5GiB', '4096' (units: {', '.join(u for u in _UNITS if u)})"
            )
        unit = m.group(2)
        if (
            len(unit) == 2 and unit[0].isupper() and unit[1] == "b"
        ):  # "Gb": gigabits, not gigabytes
            raise HarmonyError(
                f"{what} {value!r} reads as bits ('{unit}'); write bytes, e.g. "
                f"'{unit[:-1].upper()}B'"
            )
        number = float(m.group(1))
    amount = number * _UNITS[unit.lower()]
    if not math.isfinite(amount):
        raise HarmonyError(f"{what} must be a finite number, got {value!r}")
    if amount < 0:
        raise HarmonyError(f"{what} must be non-negative, got {value!r}")
    return amount


def format_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'``: three significant digits in the unit that fits."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def parse_rate(value: str | int | float, what: str = "bandwidth") -> float:
    """``"200MB/s"`` -> 2e8 bytes/s. Must be positive."""
    text = value if not isinstance(value, str) else re.sub(r"\s*/\s*s(ec)?\s*$", "", value)
    rate = _parse_amount(text, what)
    if rate <= 0:
        raise HarmonyError(f"{what} must be positive, got {value!r}")
    return rate
