"""Measure a chain of layers on the device at hand: the ModelSpec the planner needs.

For every layer and microbatch size ``u``: forward time without autograd,
backward time *including the recompute forward* (the reference profiles'
convention) and the CPU time of the optimizer step; sizes and working memory
come from :func:`~harmony.engine.describe.describe`, measured the way the
engine's meters count them. Layers are measured on copies, one at a time, so
the model's weights and BatchNorm statistics are left untouched; a model built
under :func:`~harmony.engine.lazy_weights.empty_weights` is measured on
placeholders (zeros), its weights left for the engine to make.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn

from ..costs.spec import Curve, ModelSpec
from .describe import describe, layer_inputs
from .journal import UpdateJournal, apply_update, optimizer_kind
from .lazy_weights import UnmadeWeights
from .meters import SavedBytes
from .reference_loop import as_args
from .structure import structure


def default_sizes(minibatch: int) -> list[int]:
    sizes = [1 << i for i in range(minibatch.bit_length()) if (1 << i) <= minibatch]
    return sorted(set(sizes + [minibatch]))


def median_time(
    fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call;
    ``sync`` waits for the work ``fn`` queued (a GPU's stream)."""
    fn()  # warm-up (allocations, lazy init)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(
    layers: Sequence[nn.Module],
    inputs,
    target: torch.Tensor,
    loss_fn: Callable,
    optimizer: Callable | None = None,
    sizes: Sequence[int] | None = None,
    repeats: int = 3,
    device: torch.device | str = "cpu",
    name: str = "model",
    safe_updates: bool = True,
    dtype: torch.dtype | None = None,
    described: ModelSpec | None = None,
) -> ModelSpec:
    """A measured :class:`~harmony.costs.spec.ModelSpec` of ``layers`` on ``device``.

    ``inputs``/``target``: an example minibatch (its size bounds ``sizes``).
    ``optimizer``: the factory the engine will use (for the CPU update time);
    ``safe_updates``: whether the engine journals updates (as it does by default).
    ``dtype``: mixed precision: time forward and backward under ``torch.autocast``
    in this dtype, with the sizes the engine then moves (see ``describe``).
    ``described``: what ``describe`` made of these layers with these arguments
    (an engine's own spec), so they are not described twice."""
    inputs = as_args(inputs)
    device = torch.device(device)
    # parameters on the meta device (a model built under empty_weights): placeholders,
    # as the engine holds them until it makes them (sizes and times need no values)
    UnmadeWeights.of(None, list(layers), None, 0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    spec = (
        described
        if described is not None
        else describe(
            layers,
            inputs,
            target,
            name=name,
            optimizer=optimizer_kind(optimizer) if optimizer else "adamw",
            loss_fn=loss_fn,
            device=device,
            dtype=dtype,
            sizes=sizes or (),
        )
    )
    sizes = [u for u in sizes or default_sizes(target.shape[0]) if u >= spec.min_microbatch]

    acts = {u: tuple(t[:u].to(device) for t in inputs) for u in sizes}
    cuda = device.type == "cuda"
    times = _time_layers(layers, acts, target, loss_fn, device, dtype, repeats, sync, cuda)
    measured = tuple(
        replace(
            cost,
            fwd_time=Curve.table(sizes, times[i][0]),
            bwd_time=Curve.table(sizes, times[i][1]),
            update_time_s=_update_time(layers[i], optimizer, repeats, safe_updates)
            if optimizer
            else None,
        )
        for i, cost in enumerate(spec.layers)
    )
    return replace(
        spec,
        layers=measured,
        source=f"profiled on {device} ({repeats} repeats per point)",
    )


def _time_layers(
    layers: Sequence[nn.Module],
    acts: dict[int, tuple],
    target: torch.Tensor,
    loss_fn: Callable,
    device: torch.device,
    dtype: torch.dtype | None,
    repeats: int,
    sync: Callable[[], None],
    once_per_structure: bool = False,
) -> list[tuple[list[float], list[float]]]:
    """Each layer's forward and backward times at each microbatch size (``acts``:
    size -> the first layer's input). On a host (an emulated GPU computes there) every
    layer is timed, equal ones too: timing one block of a transformer for all of them
    made the simulator 9% optimistic on an emulated GPU (``bench/emulated.py``:
    measured / simulated 1.09 against 0.99), where its memory, which is exact, is
    shared (``describe``). On a GPU (``once_per_structure``), layers of one structure
    (:mod:`.structure`) take the time of the first: timing the 24 blocks of a 1.4 B
    GPT-2 one by one took 24 s of its first step on an H100."""
    times: list[tuple[list[float], list[float]]] = []
    timed: dict[tuple, tuple[list[float], list[float]]] = {}  # structure -> its times
    for i, original in enumerate(layers):
        last = i == len(layers) - 1
        # one layer copied to the device at a time: a model near the size of host memory
        # (or larger: its weights unmade, see lazy_weights) is never copied whole
        layer = copy.deepcopy(original).to(device)
        key = structure(original, acts.values(), last) if once_per_structure else None
        if key is None or key not in timed:
            timed[key] = _time_layer(
                layer, acts, target, loss_fn if last else None, device, dtype, repeats, sync
            )
        times.append(timed[key])
        if not last:
            for u, x in acts.items():  # the next layer's input
                acts[u] = layer_inputs([layer], x)[1]
        layer = None  # freed before the next layer is copied
    return times


def _time_layer(
    layer: nn.Module,
    acts: dict[int, tuple],
    target: torch.Tensor,
    loss_fn: Callable | None,
    device: torch.device,
    dtype: torch.dtype | None,
    repeats: int,
    sync: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Median forward and backward (with recompute) times of ``layer`` on its input
    at each microbatch size (``acts``: size -> input); ``loss_fn``: the last layer,
    timed with the loss."""
    last = loss_fn is not None
    fwd_times, bwd_times = [], []

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    for u in acts:
        x = acts[u]
        y = target[:u].to(device)

        def fwd():
            with torch.no_grad(), autocast():
                layer(*x)

        def bwd(meter: SavedBytes | None = None):
            xs = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in x)
            with meter if meter is not None else contextlib.nullcontext(), autocast():
                out = as_args(layer(*xs))
                if last:
                    out = (loss_fn(*out, y),)
            floats = [o for o in out if o.requires_grad]
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])

        fwd_times.append(median_time(fwd, repeats, sync))
        # with the saved-tensor meter on, as the engine runs recompute (it charges the ledger)
        bwd_times.append(median_time(lambda: bwd(SavedBytes()), repeats, sync))
        layer.zero_grad(set_to_none=True)
    return fwd_times, bwd_times


def _update_time(layer: nn.Module, optimizer: Callable, repeats: int, journal: bool) -> float:
    """CPU time of one update task on copies of the layer's parameters: the
    optimizer step, the engine's finite-gradient check and (``journal``: the
    engine's ``safe_updates``) the copy it keeps to undo the step."""
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = optimizer(params)
    record = UpdateJournal() if journal else None

    def update():
        if record is not None:
            record.start_step()
        apply_update(opt, (0, 1), None, record)

    return median_time(update, repeats)


def measure_link(
    device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 3
) -> tuple[float, float]:
    """Host->device and device->host bandwidth (bytes/s) of a CUDA device, with
    page-locked host memory, medians of ``repeats`` copies of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    h2d = median_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = median_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return nbytes / h2d, nbytes / d2h


#: a GTX 1080 Ti's compute : its PCIe 3.0 link, FLOP per byte (11.3 TFLOP/s float32,
#: 12.3 GB/s host-to-device): an emulated GPU with this ratio to the CPU's compute has
#: the balance of the paper's server
FLOP_PER_BYTE_1080TI = 11.3e12 / 12.3e9


def cpu_flops(dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """FLOP/s of the CPU (torch's threads) on an ``n`` x ``n`` matmul in ``dtype``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * n**3 / (time.perf_counter() - t0)


def link_like_1080ti() -> float:
    """Bytes/s of an emulated link as many times slower than a 1080 Ti's PCIe as
    this CPU (one thread) is slower than a 1080 Ti."""
    return cpu_flops() / FLOP_PER_BYTE_1080TI
