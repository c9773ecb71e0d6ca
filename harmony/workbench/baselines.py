"""PyTorch's own offload, as a user assembles it: the baseline harmony is
measured against (``bench/vs_torch.py``, ``notebooks/18_vs_torch.ipynb``).

When a model's training footprint (weights, gradients, optimizer state,
activations) does not fit the GPU, PyTorch offers pieces a user can combine
without a new system: activation checkpointing on every layer
(``torch.utils.checkpoint``), what the checkpoints save sent to host memory
(``torch.autograd.graph.save_on_cpu``), gradient accumulation over
microbatches, and the optimizer on the host. :class:`TorchOffload` is that
recipe, run on an emulated GPU (a memory ledger with a hard capacity, links
paced like the engine's) or a real one:

* weights and gradients stay on the device for the whole run;
* each layer's forward is checkpointed; what a checkpoint saves (the layer's
  input) goes to the host as ``save_on_cpu`` does it (a copy out at the
  forward pass, a copy back when backward recomputes the layer);
* after the last microbatch, gradients to the host, the optimizer step there
  on the float32 master weights, updated weights back to the device.

Everything runs on one thread, in order, as on one CUDA stream: this is what
the recipe gives without hand-written stream code, so copies do not overlap
compute. The loss is computed inside the last layer's checkpoint (the logits
are recomputed rather than sent to the host), which favours the recipe.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..costs.spec import ModelSpec
from ..engine.devices import EmulatedDevice, Ledger
from ..engine.reference_loop import as_args
from ..engine.tiers.pacing import LinkPacer
from ..errors import OutOfMemoryError
from ..plan import split_samples

#: out of device memory: the emulated ledger's error, or the CUDA allocator's
OOM = (OutOfMemoryError, torch.OutOfMemoryError)


def timed(step: Callable[[], object]) -> float:
    """Seconds one call of ``step`` takes."""
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class TorchOffload:
    """The PyTorch-native offload recipe (see the module docstring), one step at a time.

    ``model``: the chain on the host; it stays the float32 master copy that
    ``optimizer(params)`` (one optimizer over all of them) updates.
    ``device``: an :class:`~harmony.EmulatedDevice` (copies are real copies
    paced to its links; a ledger with its capacity raises
    :class:`~harmony.errors.OutOfMemoryError`) or ``"cuda:N"`` (copies through
    page-locked host memory, as ``save_on_cpu(pin_memory=True)`` makes them;
    the ledger only counts). ``spec``: the chain's profile, for what one
    layer's recompute holds on the device (``bwd_extra``; None: not charged,
    as on a GPU, where the allocator holds the cap). ``autocast``: the
    compute dtype under ``torch.autocast`` (None: float32).

    Charged to the ledger: weights (parameters and buffers) and gradients, for
    the whole run; the microbatch's inputs and target; in the forward pass the
    input and output of the layer running (what a checkpoint saves is on the
    host); in the backward pass, for the layer being recomputed only, its input
    brought back, the gradient of its output and its recompute's saved
    activations (the profile's ``bwd_extra``). Transients inside one operator
    are not charged, as in harmony's ledger.

    Bytes over the host link per step (``moved``), in closed form:
    h2d = inputs + targets + saved + parameters, d2h = saved + parameters,
    where saved = the inputs of every layer for every sample of the minibatch
    (``sum(spec.input_bytes(i, minibatch))``)."""

    def __init__(
        self,
        model: nn.Sequential,
        optimizer: Callable,
        loss_fn: Callable,
        device,
        microbatch_size: int,
        spec: ModelSpec | None = None,
        autocast: torch.dtype | None = None,
    ):
        self.emulated = isinstance(device, EmulatedDevice)
        self.torch_device = torch.device("cpu" if self.emulated else device)
        self.pin = not self.emulated
        self.rates = {"h2d": device.h2d_rate, "d2h": device.d2h_rate} if self.emulated else {}
        self.pacer = LinkPacer(self.rates) if self.emulated else None
        self.ledger = Ledger("gpu0", device.capacity if self.emulated else None)
        self.loss_fn, self.microbatch_size, self.spec, self.autocast = (
            loss_fn,
            microbatch_size,
            spec,
            autocast,
        )
        self.layers = copy.deepcopy(model).to(
            self.torch_device
        )  # on the emulated device: a copy in host memory
        self.params = list(self.layers.parameters())
        self.ledger.charge(
            nbytes(self.params) * 2 + nbytes(self.layers.buffers()), "weights and gradients"
        )
        self.master = list(model.parameters())
        if self.pin:
            for p in self.master:
                p.data = p.data.pin_memory()
        for p in self.master:  # gradients land in these host buffers at every step
            p.grad = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin)
        self.optimizer = optimizer(self.master)
        self.moved = {"h2d": 0, "d2h": 0}
        self.transient = 0.0  # bytes charged for the step in progress

    @property
    def peak_memory(self) -> float:
        """Peak device bytes of the last step."""
        return (
            self.ledger.peak
            if self.emulated
            else torch.cuda.max_memory_allocated(self.torch_device)
        )

    def step(self, inputs, target: torch.Tensor) -> float:
        """One synchronous step over the minibatch; returns its loss."""
        inputs = as_args(inputs)
        total = target.shape[0]
        self.moved = {"h2d": 0, "d2h": 0}
        self.ledger.reset(time.perf_counter())
        if not self.emulated:
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        loss = 0.0
        try:
            for a, b in split_samples(total, self.microbatch_size):
                loss += self._microbatch(
                    tuple(t[a:b] for t in inputs), target[a:b], (b - a) / total
                )
        except BaseException:
            self.layers.zero_grad(
                set_to_none=True
            )  # a failed step leaves no half-accumulated gradient
            raise
        finally:
            self._release(self.transient)
        self._update()
        return loss

    def _microbatch(self, inputs: tuple, target: torch.Tensor, scale: float) -> float:
        self.u = target.shape[0]
        h = tuple(self._to_device(t) for t in inputs)
        y = self._to_device(target)
        self._charge(nbytes(h) + nbytes(y), "microbatch")
        self.output_bytes: list[int] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        autocast = torch.autocast(
            self.torch_device.type, dtype=self.autocast, enabled=self.autocast is not None
        )
        with hooks, autocast:
            for i, layer in enumerate(self.layers):
                self.current = i
                if i == len(self.layers) - 1:

                    def fn(*args, layer=layer):
                        return self.loss_fn(*as_args(layer(*args)), y)
                else:
                    fn = layer
                out = as_args(checkpoint(fn, *h, use_reentrant=False))
                self._charge(nbytes(out), f"output of layer {i}")
                self._release(nbytes(h))
                self.output_bytes.append(nbytes(out))
                h = out
            loss = h[0] * scale
        self.recomputing, self.recompute_bytes = None, 0.0
        loss.backward()
        self._release(self.recompute_bytes + nbytes(h) + nbytes(y))
        return loss.item()

    def _pack(self, t: torch.Tensor):
        """save_on_cpu's pack: a synchronous copy to (page-locked) host memory."""
        started = time.perf_counter()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        host.copy_(t)
        self._paced("d2h", host, started)
        return self.current, host

    def _unpack(self, packed) -> torch.Tensor:
        """save_on_cpu's unpack, at the recompute of the checkpoint that saved it.
        Backward reaches the layers in reverse order, so the first unpack of a
        layer means the layer after it is done: its recompute is freed."""
        layer, host = packed
        if layer != self.recomputing:
            self._release(self.recompute_bytes)
            self.recomputing = layer
            recompute = self.spec.layers[layer].bwd_extra(self.u) if self.spec is not None else 0.0
            self.recompute_bytes = recompute + self.output_bytes[layer]
            self._charge(self.recompute_bytes, f"recompute of layer {layer}")
        t = self._to_device(host)
        self.recompute_bytes += nbytes([t])
        self._charge(nbytes([t]), f"input of layer {layer}")
        return t

    def _update(self) -> None:
        """Gradients out, the optimizer step on the host, weights in."""
        for p, m in zip(self.params, self.master):
            started = time.perf_counter()
            m.grad.copy_(p.grad, non_blocking=self.pin)
            self._paced("d2h", m.grad, started)
        self._synchronize()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                started = time.perf_counter()
                p.copy_(m, non_blocking=self.pin)
                self._paced("h2d", p, started)
        self.layers.zero_grad(set_to_none=True)
        self._synchronize()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = t.to(self.torch_device, non_blocking=self.pin, copy=True)
        self._paced("h2d", out, started)
        return out

    def _paced(self, route: str, t: torch.Tensor, started: float) -> None:
        """Count a copy's bytes; on the emulated device, sleep until the link would have carried
        them."""
        n = nbytes([t])
        self.moved[route] += n
        if self.pacer is not None:
            self.pacer.wait((route,), n, self.rates[route], started)

    def _charge(self, n: float, what: str) -> None:
        self.ledger.charge(n, what)
        self.transient += n

    def _release(self, n: float) -> None:
        self.ledger.release(n)
        self.transient -= n

    def _synchronize(self) -> None:
        if not self.emulated:
            torch.cuda.synchronize(self.torch_device)


def fastest_microbatch(run: Callable[[int], float], sizes, log=print) -> int | None:
    """The microbatch size a user would pick: from the largest of ``sizes`` down,
    ``run(u)`` times one step; the fastest that does not run out of memory,
    stopping at the first that is slower than the best so far. None: none fits."""
    best, best_s = None, math.inf
    for u in sorted(set(sizes), reverse=True):
        try:
            seconds = run(u)
        except OOM as e:
            log(f"microbatch {u}: out of memory ({str(e).splitlines()[0][:110]})")
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log(f"microbatch {u}: {seconds:.2f} s/step")
        if seconds >= best_s:
            break
        best, best_s = u, seconds
    return best
