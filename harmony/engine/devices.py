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
  for the rest of bytes / bandwidth), so transfers really overlap compute.
* ``cuda``: a real GPU; the ledger then only counts (the CUDA allocator
  enforces the capacity) and copies are real host<->device copies.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import HarmonyError, OutOfMemoryError
from ..hardware import GB, Hardware, parse_bytes, parse_rate


@dataclass(frozen=True)
class EmulatedDevice:
    """A GPU emulated on the CPU: ``memory`` capacity, ``h2d``/``d2h`` link rates.

    Pick link rates with the compute-to-bandwidth ratio of the server you study:
    the CPU computes ~100x slower than a GPU, so ~100x slower than PCIe."""

    memory: str | int = "256MB"
    h2d: str | float = "200MB/s"
    d2h: str | float = "200MB/s"

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
            name=f"emulated-{self.memory}", n_gpus=1, gpu_memory=self.capacity, gpu_flops=gpu_flops,
            h2d=self.h2d_rate, d2h=self.d2h_rate, uplink=max(self.h2d_rate, self.d2h_rate), gpus_per_switch=1,
            p2p=None, cpu_update_bandwidth=cpu_update_bandwidth, cpu_update_workers=1, host_memory=10**12,
            notes="an emulated GPU: real CPU compute, ledger capacity, paced links",
        )


class Ledger:
    """Bytes in use on one device, with a peak and (optionally) a hard capacity."""

    def __init__(self, device: str, capacity: float | None):
        self.device, self.capacity = device, capacity
        self.in_use = 0.0
        self.peak = 0.0
        self.history: list[tuple[float, float]] = []  # (seconds since reset, bytes in use)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def charge(self, nbytes: float, what: str) -> None:
        with self._lock:
            if self.capacity is not None and self.in_use + nbytes > self.capacity:
                raise OutOfMemoryError(
                    f"{self.device} out of memory: {what} needs {nbytes / 1e6:.2f} MB but only "
                    f"{(self.capacity - self.in_use) / 1e6:.2f} MB of {self.capacity / 1e6:.2f} MB are free. "
                    "Use a plan with smaller microbatches or more (smaller) packs."
                )
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.history.append((time.perf_counter() - self._t0, self.in_use))

    def release(self, nbytes: float) -> None:
        if nbytes:
            with self._lock:
                self.in_use -= nbytes
                self.history.append((time.perf_counter() - self._t0, self.in_use))

    def reset(self, t0: float) -> None:
        """Start a new step: peak from what is in use now, history from ``t0``."""
        with self._lock:
            self.peak = self.in_use
            self._t0 = t0
            self.history = [(0.0, self.in_use)]


class Backend:
    """One device as the executor uses it."""

    kind = "cpu"

    def __init__(self, name: str = "gpu0"):
        self.name = name
        self.torch_device = torch.device("cpu")
        self.ledger = Ledger(name, None)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device tensor (a view on the cpu backend)."""
        return t.detach()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def pace(self, nbytes: float, direction: str, started: float) -> None:
        """Make a copy of ``nbytes`` that began at ``started`` last as long as the link says."""

    def lane(self, lane: str):
        """Context for running one task of ``lane`` (its CUDA stream on a GPU)."""
        return contextlib.nullcontext()

    def prepare_host(self, module: nn.Module) -> None:
        """Make the host copy of the weights suitable for this device's copies."""


class EmulatedBackend(Backend):
    kind = "emulated"

    def __init__(self, spec: EmulatedDevice, name: str = "gpu0"):
        super().__init__(name)
        self.spec = spec
        self.ledger = Ledger(name, spec.capacity)
        self.rates = {"h2d": spec.h2d_rate, "d2h": spec.d2h_rate}

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def pace(self, nbytes: float, direction: str, started: float) -> None:
        left = started + nbytes / self.rates[direction] - time.perf_counter()
        if left > 0:
            time.sleep(left)


class CudaBackend(Backend):
    kind = "cuda"

    def __init__(self, device: str, name: str = "gpu0"):
        super().__init__(name)
        if not torch.cuda.is_available():
            raise HarmonyError(f"device {device!r} asked for, but this torch has no CUDA device "
                               "(use harmony.EmulatedDevice(...) or 'cpu')")
        self.torch_device = torch.device(device)
        self.ledger = Ledger(name, None)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.torch_device, non_blocking=True)

    def prepare_host(self, module: nn.Module) -> None:
        """Page-locked host weights: copies from them are asynchronous and run at
        full link speed."""
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if not t.is_pinned():
                    t.data = t.data.pin_memory()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu")

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


def make_backend(device) -> Backend:
    """``"cpu"``, ``"cuda:0"`` or an :class:`EmulatedDevice` -> a backend."""
    if isinstance(device, EmulatedDevice):
        return EmulatedBackend(device)
    if isinstance(device, Backend):
        return device
    if isinstance(device, str):
        if device == "cpu":
            return Backend()
        if device.startswith("cuda"):
            return CudaBackend(device)
    raise HarmonyError(
        f"unknown device {device!r}: use 'cpu', 'cuda:N' or harmony.EmulatedDevice(memory=..., h2d=..., d2h=...)"
    )
