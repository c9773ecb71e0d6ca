"""Where the engine's "GPU" tensors live, and how bytes get there.

Three backends behind one small interface (:class:`Backend`):

* ``cpu``: tensors stay in host memory and "copies" are views: the overhead
  floor of the engine, no emulation.
* ``emulated``: a GPU emulated on the CPU for laptops, CI and teaching.
  Compute is real PyTorch on the CPU. Device memory is a **ledger with a hard
  capacity**: every tensor the engine places on the device is charged, and
  going over raises :class:`~harmony.errors.OutOfMemoryError` with what was
  asked, what was free and which task asked. Each copy is a real copy made on
  the lane's own thread and paced to the link's bandwidth (the thread sleeps
  for the rest of bytes / bandwidth), so transfers really overlap compute. Its
  memory is host memory: each copy goes into a buffer of its own
  (:func:`~harmony.engine.host_pages.fresh_buffer`), freed, like what the
  device computes, when the last view of it goes, and freed memory goes back
  to the operating system; so the device takes about as much host memory as
  its ledger holds, at most its capacity (buffers kept for reuse would hold
  one per copy of a step, several times the capacity).
* ``cuda``: a real GPU; the ledger then only counts (the CUDA allocator
  enforces the capacity) and copies are real host<->device copies, from and
  to page-locked host memory.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from ..costs.hardware import GB, Hardware, format_bytes, parse_bytes, parse_rate
from ..errors import HarmonyError, OutOfMemoryError
from .buffers import BufferPool
from .host_pages import fresh_buffer


@dataclass(frozen=True)
class EmulatedDevice:
    """A GPU emulated on the CPU: ``memory`` capacity, ``h2d``/``d2h`` link rates.

    Pick link rates with the compute-to-bandwidth ratio of the server you study:
    the CPU computes ~100x slower than a GPU, so ~100x slower than PCIe."""

    memory: str | int = "256MB"
    h2d: str | float = "200MB/s"
    d2h: str | float = "200MB/s"

    def __post_init__(self):
        self.hardware()  # a bad size or rate is said now, not at the first step

    @property
    def capacity(self) -> int:
        return parse_bytes(self.memory, "emulated device memory")

    @property
    def h2d_rate(self) -> float:
        return parse_rate(self.h2d, "emulated h2d bandwidth")

    @property
    def d2h_rate(self) -> float:
        return parse_rate(self.d2h, "emulated d2h bandwidth")

    def hardware(self, cpu_update_bandwidth: float = 5 * GB, gpu_flops: float = 1e10) -> Hardware:
        """The :class:`Hardware` the planner and simulator see for this device."""
        return Hardware(
            name=f"emulated-{self.memory}",
            n_gpus=1,
            gpu_memory=self.capacity,
            gpu_flops=gpu_flops,
            h2d=self.h2d_rate,
            d2h=self.d2h_rate,
            uplink=max(self.h2d_rate, self.d2h_rate),
            gpus_per_switch=1,
            p2p=None,
            cpu_update_bandwidth=cpu_update_bandwidth,
            gpu_update_bandwidth=cpu_update_bandwidth,  # its updates run on this CPU
            cpu_update_workers=1,
            host_memory=10**12,
            notes="an emulated GPU: real CPU compute, ledger capacity, paced links",
        )


@dataclass(frozen=True)
class EmulatedServer:
    """Several emulated GPUs in one server: each with ``memory`` and its own
    ``h2d``/``d2h`` link; ``gpus_per_switch`` of them share one host ``uplink``
    per direction (default: as fast as all their links together, i.e. not a
    limit); ``p2p`` paces GPU->GPU copies on a switch (None: through host memory)."""

    gpus: int = 2
    memory: str | int = "256MB"
    h2d: str | float = "200MB/s"
    d2h: str | float = "200MB/s"
    uplink: str | float | None = None
    p2p: str | float | None = None
    gpus_per_switch: int | None = None

    def __post_init__(self):
        self.hardware()  # bad settings are said now, not at the first step

    def device(self) -> EmulatedDevice:
        return EmulatedDevice(self.memory, self.h2d, self.d2h)

    def hardware(self, cpu_update_bandwidth: float = 5 * GB, gpu_flops: float = 1e10) -> Hardware:
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise HarmonyError(f"EmulatedServer needs gpus >= 1, got {self.gpus!r}")
        if self.gpus_per_switch is not None and (
            not isinstance(self.gpus_per_switch, int) or not 1 <= self.gpus_per_switch <= self.gpus
        ):
            raise HarmonyError(
                f"gpus_per_switch must be between 1 and gpus ({self.gpus}), "
                f"got {self.gpus_per_switch!r}"
            )
        one = self.device()
        per_switch = self.gpus_per_switch or self.gpus
        uplink = (
            parse_rate(self.uplink, "emulated uplink bandwidth")
            if self.uplink is not None
            else per_switch * max(one.h2d_rate, one.d2h_rate)
        )
        return Hardware(
            name=f"emulated-{self.gpus}x{self.memory}",
            n_gpus=self.gpus,
            gpu_memory=one.capacity,
            gpu_flops=gpu_flops,
            h2d=one.h2d_rate,
            d2h=one.d2h_rate,
            uplink=uplink,
            gpus_per_switch=per_switch,
            p2p=None if self.p2p is None else parse_rate(self.p2p, "emulated p2p bandwidth"),
            cpu_update_bandwidth=cpu_update_bandwidth,
            gpu_update_bandwidth=cpu_update_bandwidth,  # its updates run on this CPU
            cpu_update_workers=self.gpus,
            host_memory=10**12,
            notes="emulated GPUs: real CPU compute, ledger capacity, paced links",
        )


class Ledger:
    """Bytes in use on one device, with a peak and (optionally) a hard capacity.

    ``in_use`` is what the device has given out: the buffers the task graph
    declared, admitted in the plan's memory order, plus whatever a task held
    beyond what its buffers declared (``undeclared``, charged as it happens).
    ``held`` follows the bytes of the tensors themselves, to check that the
    declared sizes cover them."""

    def __init__(self, device: str, capacity: float | None):
        self.device, self.capacity = device, capacity
        self.in_use = 0.0
        self.peak = 0.0
        self.undeclared = 0.0
        self.undeclared_peak = 0.0
        self.held = 0.0
        self.held_peak = 0.0
        self.unheld_work = 0.0
        self.history: list[tuple[float, float]] = []  # (seconds since reset, bytes in use)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def charge(self, nbytes: float, what: str, declared: bool = True) -> None:
        with self._lock:
            if self.capacity is not None and self.in_use + nbytes > self.capacity:
                raise OutOfMemoryError(
                    f"{self.device} out of memory: {what} needs {format_bytes(nbytes)} but only "
                    f"{format_bytes(self.capacity - self.in_use)} of "
                    f"{format_bytes(self.capacity)} are free. Use a plan with smaller "
                    "microbatches or more (smaller) packs."
                )
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            if not declared:
                self.undeclared += nbytes
                self.undeclared_peak = max(self.undeclared_peak, self.undeclared)
            self.history.append((time.perf_counter() - self._t0, self.in_use))

    def release(self, nbytes: float, declared: bool = True) -> None:
        if nbytes:
            with self._lock:
                self.in_use -= nbytes
                if not declared:
                    self.undeclared -= nbytes
                self.history.append((time.perf_counter() - self._t0, self.in_use))

    def note_held(self, delta: float) -> None:
        """Tensors of ``delta`` bytes now live on (or left) the device."""
        if delta:
            with self._lock:
                self.held += delta
                self.held_peak = max(self.held_peak, self.held)

    def note_unheld_work(self, nbytes: float) -> None:
        """A task ended that held ``nbytes`` less than its declared working memory."""
        with self._lock:
            self.unheld_work = max(self.unheld_work, nbytes)

    def reset(self, t0: float) -> None:
        """Start a new step: peaks from what is in use now, history from ``t0``."""
        with self._lock:
            self.peak = self.in_use
            self.undeclared_peak = self.undeclared
            self.held_peak = self.held
            self.unheld_work = 0.0
            self._t0 = t0
            self.history = [(0.0, self.in_use)]


class Backend:
    """One device as the executor uses it."""

    kind = "cpu"
    paced = False  # copies are paced to the emulated link bandwidths
    # False: the device computes on host memory as it is (a tensor "moved" is the same tensor)
    copies = False
    # Whether compute tasks measure what they hold beyond their buffers (the tensors
    # autograd saves, through a hook on each: see harmony.engine.meters). Not here:
    # the cpu backend has no capacity to weigh a task's bytes against (its ledger is
    # mostly not even charged the declared buffers: a memory order is kept only with
    # a disk tier), and the hooks are a cost the plain loop it is measured against
    # does not pay. Emulated and CUDA devices measure.
    meters_work = False

    def __init__(self, name: str = "gpu0"):
        self.name = name
        self.torch_device = torch.device("cpu")
        self.ledger = Ledger(name, None)
        # device buffers reused from step to step (None: each copy makes its own, buffer())
        self.pool: BufferPool | None = BufferPool(self.torch_device)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D tensor of ``numel`` elements on the device, freed when its last
        view goes (contents undefined)."""
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def lane(self, lane: str):
        """Context for running one task of ``lane`` (its CUDA stream on a GPU)."""
        return contextlib.nullcontext()


class EmulatedBackend(Backend):
    kind = "emulated"
    paced = True
    copies = True
    meters_work = True

    def __init__(self, spec: EmulatedDevice, name: str = "gpu0"):
        super().__init__(name)
        self.spec = spec
        self.ledger = Ledger(name, spec.capacity)
        self.pool = None  # see the module docstring

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return fresh_buffer(numel, dtype)


class CudaBackend(Backend):
    """A real GPU. Device buffers come from PyTorch's caching allocator, which
    already reuses memory from step to step (and, unlike a pool of exact sizes,
    splits blocks, so what it holds stays within the plan's peak)."""

    kind = "cuda"
    copies = True
    meters_work = True

    def __init__(self, device: str, name: str = "gpu0"):
        super().__init__(name)
        if not torch.cuda.is_available():
            raise HarmonyError(
                f"device {device!r} asked for, but this torch has no CUDA device "
                "(use harmony.EmulatedDevice(...) or 'cpu')"
            )
        self.torch_device = torch.device(device)
        self.ledger = Ledger(name, None)
        self.pool = None
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lane(self, lane: str):
        """Each lane issues on its own stream; a task ends when its stream has
        drained, so dependencies between lanes hold on the host side."""
        with self._lock:
            stream = self._streams.get(lane)
            if stream is None:
                stream = self._streams[lane] = torch.cuda.Stream(self.torch_device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


def make_backends(device) -> list[Backend]:
    """``"cpu"``, ``"cuda:N"``, a list of CUDA devices, an :class:`EmulatedDevice`
    or an :class:`EmulatedServer` -> one backend per GPU, named gpu0, gpu1, ..."""
    if isinstance(device, EmulatedDevice):
        return [EmulatedBackend(device)]
    if isinstance(device, EmulatedServer):
        device.hardware()  # validates
        return [EmulatedBackend(device.device(), f"gpu{i}") for i in range(device.gpus)]
    if isinstance(device, str) and device == "cpu":
        return [Backend()]
    if isinstance(device, str) and device.startswith("cuda"):
        return [CudaBackend(device)]
    if (
        isinstance(device, (list, tuple))
        and device
        and all(isinstance(d, str) and d.startswith("cuda") for d in device)
    ):
        return [CudaBackend(d, f"gpu{i}") for i, d in enumerate(device)]
    raise HarmonyError(
        f"unknown device {device!r}: use 'cpu', 'cuda:N', a list of 'cuda:N', "
        "harmony.EmulatedDevice(memory=..., h2d=..., d2h=...) or "
        "harmony.EmulatedServer(gpus=..., ...)"
    )
