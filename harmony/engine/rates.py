"""Rates measured on this machine: a device's matmul FLOP/s and optimizer bandwidth.

:func:`matmul_flops` times a square matmul on any device (on a GPU, after
warm-up, synchronised); :func:`cpu_update_bandwidth` times a real
:class:`~harmony.engine.optim.FlatAdamW` step, the host update the engine
runs, and :func:`update_bandwidth` a fused ``torch.optim.AdamW`` step on a
device, the update a resident plan runs on its GPU
(:mod:`harmony.engine.step.resident`); both say it in the unit the cost model
takes (:meth:`~harmony.costs.spec.ModelSpec.update_time`: the bytes an AdamW
step streams, weights, gradient and both moments read and the weights and
moments written, 4 x 7 bytes per float32 element, per second).
"""

from __future__ import annotations

import statistics
import time

import torch

from .optim import FlatAdamW

#: bytes an AdamW step streams per float32 element, as ModelSpec.update_time counts them
ADAMW_BYTES_PER_ELEMENT = 4 * (3 + 2 * 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of an ``n`` x ``n`` matmul in ``dtype`` on ``device`` (median of ``repeats``)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up: kernels chosen, memory allocated
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def cpu_update_bandwidth(numel: int = 1 << 22, repeats: int = 3) -> float:
    """Bytes/s a FlatAdamW step on ``numel`` float32 host parameters streams (median)."""
    return _step_bandwidth(lambda ps: FlatAdamW(ps, lr=1e-4), torch.device("cpu"), numel, repeats)


def update_bandwidth(device: torch.device, numel: int = 1 << 24, repeats: int = 5) -> float:
    """Bytes/s a fused ``torch.optim.AdamW`` step on ``numel`` float32 parameters on
    ``device`` streams (median, synchronised)."""
    return _step_bandwidth(
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), device, numel, repeats
    )


def _step_bandwidth(optimizer, device: torch.device, numel: int, repeats: int) -> float:
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device)
    opt = optimizer([p])
    opt.step()  # warm-up: the moments are made, the kernels chosen
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return numel * ADAMW_BYTES_PER_ELEMENT / statistics.median(times)
