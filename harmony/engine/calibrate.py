"""The devices at hand as the planner and the simulator see them.

A device description (``"cpu"``, ``"cuda:N"``, a list of them,
:class:`~harmony.engine.devices.EmulatedDevice`,
:class:`~harmony.engine.devices.EmulatedServer`) says most of a
:class:`~harmony.costs.hardware.Hardware`; :func:`calibrate` adds what only a
measurement on this machine tells: the engine's own cost per compute task
(every backend), the FLOP rate of this CPU (the cpu and emulated backends
compute on it), the host's optimizer bandwidth (a real FlatAdamW step,
:mod:`.rates`: also the rate of an update on a device that computes on host
memory) and, for a real GPU, its matmul FLOP rate (in bfloat16 where it has
it: what mixed precision runs at), its optimizer bandwidth (a fused AdamW step
on it), link bandwidth and memory. Each
measurement is made once per process and kept, so every engine, search and
bench on the same device sees the same numbers.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch

from ..costs.hardware import GB, Hardware
from ..errors import HarmonyError
from .devices import EmulatedDevice, EmulatedServer


def calibrate(device) -> Hardware:
    """``device`` as a :class:`~harmony.costs.hardware.Hardware`, with the engine's cost
    per compute task and the compute rate measured on this machine."""
    # an emulated GPU computes on this CPU, and its host update is this CPU's
    if isinstance(device, EmulatedServer):
        hw = device.hardware(_cpu_update_bandwidth(), gpu_flops=_cpu_flops())
        return replace(hw, task_overhead_s=task_overhead("emulated", device.device()))
    if isinstance(device, EmulatedDevice):
        return replace(
            device.hardware(_cpu_update_bandwidth(), gpu_flops=_cpu_flops()),
            task_overhead_s=task_overhead("emulated", device),
        )
    if isinstance(device, str) and device == "cpu":
        # the cpu backend moves nothing: links and memory are no limit
        return Hardware(
            name="cpu",
            n_gpus=1,
            gpu_memory=10**15,
            gpu_flops=_cpu_flops(),
            h2d=100 * GB,
            d2h=100 * GB,
            uplink=100 * GB,
            gpus_per_switch=1,
            p2p=100 * GB,
            cpu_update_bandwidth=_cpu_update_bandwidth(),
            gpu_update_bandwidth=_cpu_update_bandwidth(),
            cpu_update_workers=1,
            host_memory=10**15,
            task_overhead_s=task_overhead("cpu", "cpu"),
        )
    devices = (
        [device]
        if isinstance(device, str)
        else list(device)
        if isinstance(device, (list, tuple))
        else None
    )
    if devices and all(isinstance(d, str) and d.startswith("cuda") for d in devices):
        return _cuda(tuple(devices))
    raise HarmonyError(
        f"cannot calibrate device {device!r}: use 'cpu', 'cuda:N', a list of 'cuda:N', "
        "harmony.EmulatedDevice(...) or harmony.EmulatedServer(...)"
    )


@cache
def task_overhead(kind: str, one_device) -> float:
    """The engine's cost per compute task on a backend of ``kind`` (measured on
    ``one_device`` the first time, then kept)."""
    from .task_overhead import measure_task_overhead

    return measure_task_overhead(one_device)


@cache
def _cpu_flops() -> float:
    from .profiler import cpu_flops

    return cpu_flops()


@cache
def _cpu_update_bandwidth() -> float:
    from .rates import cpu_update_bandwidth

    return cpu_update_bandwidth()


def _gpu_flops(dev: torch.device) -> float:
    """A 4096 x 4096 matmul's FLOP/s on ``dev``: in bfloat16 where the GPU has it."""
    from .rates import matmul_flops

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return matmul_flops(dev, dtype, 4096)


@cache
def _cuda(devices: tuple[str, ...]) -> Hardware:
    """The GPUs at hand: memory from the driver (90% usable: the CUDA context and
    the caching allocator take the rest), link bandwidth measured; all GPUs
    assumed behind one uplink of their summed bandwidth and with peer access."""
    from .profiler import measure_link
    from .rates import update_bandwidth

    if not torch.cuda.is_available():
        raise HarmonyError(f"device {devices[0]!r} asked for, but this torch has no CUDA device")
    dev = torch.device(devices[0])
    h2d, d2h = measure_link(dev)
    props = torch.cuda.get_device_properties(dev)
    n = len(devices)
    return Hardware(
        name=f"{n}x {props.name}",
        n_gpus=n,
        gpu_memory=int(0.9 * props.total_memory),
        gpu_flops=_gpu_flops(dev),
        h2d=h2d,
        d2h=d2h,
        uplink=n * max(h2d, d2h),
        gpus_per_switch=n,
        p2p=h2d,
        cpu_update_bandwidth=_cpu_update_bandwidth(),
        gpu_update_bandwidth=update_bandwidth(dev),
        cpu_update_workers=n,
        host_memory=10**12,
        task_overhead_s=task_overhead(f"cuda:{dev.index or 0}", devices[0]),
    )
