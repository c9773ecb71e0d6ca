"""FSDP2 with ``CPUOffloadPolicy`` on one device: a baseline harmony is measured against.

:class:`FSDP2Offload` is PyTorch's own sharded offload run on one GPU (or, to
test it, on the CPU over gloo): every layer and the root sharded with
``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (float32 parameters,
gradients and ``torch.optim.AdamW`` on the host; each layer's weights
gathered to the device as it runs), checkpointed layers, gradient
accumulation over microbatches.

Mixed precision: the parameters stay float32 (the master weights) and
``MixedPrecisionPolicy(param_dtype=...)`` gathers them in the compute dtype,
gradients reduced in float32. FSDP2 casts parameters only: a model's float32
buffers (the causal mask a GPT-2 adds to its attention scores) then promote
its activations back to float32, and the next matmul with a bfloat16 weight
fails ("expected scalar type Float but found BFloat16"). So the forward also
runs under ``torch.autocast``, as the other systems' forwards do.

:func:`single_process_group` makes the process group of one rank FSDP2 needs.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import replace
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..plan import split_samples


class Checkpointed(nn.Module):
    """A layer whose forward is activation-checkpointed (what torch's checkpoint_wrapper does)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False)


@contextlib.contextmanager
def single_process_group(device: torch.device):
    """A torch.distributed group of this one process (``nccl`` on a GPU, ``gloo`` on
    the CPU), destroyed on exit."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    if device.type == "cuda":
        torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


class FSDP2Offload:
    """FSDP2 + ``CPUOffloadPolicy`` on ``device`` (see the module docstring): ``model``
    (an ``nn.Sequential``, float32) trained with ``loss_fn`` in microbatches of
    ``microbatch_size``, in ``dtype`` (None: float32)."""

    def __init__(
        self,
        model: nn.Sequential,
        loss_fn: Callable,
        microbatch_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device = "cuda",
        lr: float = 1e-4,
    ):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.device = torch.device(device)
        mesh = init_device_mesh(self.device.type, (1,))
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        self.model = nn.Sequential(*(Checkpointed(layer) for layer in model))
        for block in self.model:
            fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=mp)
        # the logits in float32 for the loss, as under torch.autocast
        root = replace(mp, output_dtype=torch.float32)
        fully_shard(self.model, mesh=mesh, offload_policy=offload, mp_policy=root)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.loss_fn, self.microbatch_size, self.dtype = loss_fn, microbatch_size, dtype

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step over the minibatch ``(x, y)``; its mean loss."""
        total, loss_sum = y.shape[0], 0.0
        autocast = torch.autocast(
            self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        )
        for a, b in split_samples(total, self.microbatch_size):
            xs = x[a:b].to(self.device, non_blocking=True)
            ys = y[a:b].to(self.device, non_blocking=True)
            with autocast:
                loss = self.loss_fn(self.model(xs), ys) * ((b - a) / total)
            loss.backward()
            loss_sum += loss.item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss_sum
