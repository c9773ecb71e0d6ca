"""The plain PyTorch loop the engine is exactly equal to, and the conventions
both share.

* A chain is a list of modules: layer 0 gets the minibatch inputs unpacked,
  each next layer the previous output (unpacked if a tuple); the loss function
  gets the last output and the labels.
* A minibatch is split into microbatches of ``microbatch_size`` samples (the
  last may be smaller); each microbatch's loss is scaled by its share of the
  minibatch, so the accumulated gradient is that of the minibatch mean.
* Before running layer ``l`` on the microbatch that starts at sample ``a`` in
  step ``s`` the CPU random generator is seeded with :func:`layer_seed` (and the
  device's, on CUDA), so dropout draws the same mask in the forward pass and in
  the engine's recompute, whatever the packing and whichever GPU runs it.

Exactness: with equal forward and backward microbatch sizes in float32, the
engine's weights after any number of steps are bitwise identical to
:func:`reference_step`'s on one device and with harmony-pp, gpipe-swap or
model-parallel on several; harmony-dp sums gradients across GPUs in another
order (allclose), and so does layer-swap unless its gradient sums stay on the
GPUs (``gpu_gradients``: each replica's sum, then their sum in GPU order,
deterministic).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..plan import split_samples

_PRIME = 1_000_003


def layer_seed(seed: int, step: int, first_sample: int, layer: int) -> int:
    return (((seed * _PRIME + step) * _PRIME + first_sample) * _PRIME + layer) % (2**63 - 1)


def as_args(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def seed_layer(
    seed: int, step: int, first_sample: int, layer: int, device: torch.device | None = None
) -> None:
    s = layer_seed(seed, step, first_sample, layer)
    # the CPU generator alone: torch.manual_seed would also queue a seed for every
    # lazily initialised accelerator, formatting a stack trace each time (~0.4 ms)
    torch.default_generator.manual_seed(s)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(s)


def reference_step(
    layers: Sequence[nn.Module],
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    inputs,
    target: torch.Tensor,
    microbatch_size: int | None,
    step: int,
    seed: int = 0,
    microbatches: Sequence[tuple[int, int]] | None = None,
    autocast: torch.dtype | None = None,
) -> float:
    """One synchronous SGD step over ``inputs``/``target`` the plain way: microbatch
    by microbatch through the whole chain with gradient accumulation, then one
    optimizer step. Returns the minibatch loss. Use it to check that harmony
    trains your model exactly as PyTorch would. ``microbatches`` (sample
    ranges) replaces ``microbatch_size`` to match a data-parallel split.
    ``autocast``: run forward and loss under ``torch.autocast`` in that dtype
    (the plain mixed-precision loop an engine with ``precision`` is close to)."""
    inputs = as_args(inputs)
    total = target.shape[0]
    loss_sum = 0.0
    device_type = target.device.type
    for a, b in microbatches or split_samples(total, microbatch_size):
        h = tuple(t[a:b] for t in inputs)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            for index, layer in enumerate(layers):
                seed_layer(seed, step, a, index)
                h = as_args(layer(*h))
            loss = loss_fn(*h, target[a:b]) * ((b - a) / total)
        loss.backward()
        loss_sum += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum
