"""What a resident plan's W_IN, G_OUT and UPD do: nothing crosses a link.

A plan of the policy :mod:`harmony.policies.resident` keeps the model's
master weights, their gradients and the optimizer state on its GPU from
step to step, as the plain PyTorch loop does: at the first step the model's
parameters and buffers move to the GPU (``engine.model`` lives there from
then on) and the optimizer's state with them; an optimizer that steps host
memory only (:class:`~harmony.engine.optim.FlatAdamW`) is replaced by
``torch.optim.AdamW`` with the same hyperparameters and ``fused=True`` (the
same fused kernel FlatAdamW runs on the host). A device that computes on host
memory (``cpu``, an emulated GPU) holds them where they are. On a GPU the
state stays there: another plan cannot be set on that engine afterwards
(its optimizers would be made over parameters on the GPU).

W_IN hands the forward the master weights themselves (under mixed precision,
copies cast to the compute dtype on the GPU, BatchNorm's kept in float32);
autograd sums every microbatch's gradient into their ``.grad`` as the plain
loop does; G_OUT casts the sums of the copies into the master gradients (on
the GPU); UPD steps the optimizer there, as the host update would (same
checks, same loss-scale division).
"""

from __future__ import annotations

import time

import torch

from ...graph import Task
from ..context import StepContext
from ..optim import FlatAdamW
from .memory import StepMemory, nbytes
from .transfers import Transfers
from .updates import Updates


def on_device(ctx: StepContext, device: torch.device) -> None:
    """The model's parameters, buffers and optimizer state on ``device`` (once): each
    host storage moved whole, its tensors views of the copy where they were in it (the
    host layout's flat buffers stay flat, so that a weight load casts one run of them)."""
    tensors = [t for layer in ctx.host.params + ctx.host.buffers for t in layer.values()]
    if all(t.device == device for t in tensors):
        return
    moved: dict[tuple, torch.Tensor] = {}  # (host storage, dtype) -> all of it on the device
    with torch.no_grad():
        for t in {id(t): t for t in tensors}.values():
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in moved:
                moved[key] = _whole_storage(t).to(device)
            t.data = moved[key].as_strided(t.shape, t.stride(), t.storage_offset())
    for key, opt in ctx.optimizers.items():
        if opt is None:
            continue
        if isinstance(opt, FlatAdamW):  # steps host memory only
            ctx.optimizers[key] = opt = fused_adamw(opt)
        # a fused optimizer keeps its step counters with the parameters; others on the host
        counters_too = bool(opt.defaults.get("fused"))
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and (v.dim() > 0 or counters_too):
                    state[k] = v.to(device)


def fused_adamw(opt: FlatAdamW) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` (fused) with ``opt``'s parameter groups and state."""
    groups = [
        {k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
        for g in opt.param_groups
    ]
    twin = torch.optim.AdamW(groups, fused=True)
    for p, state in opt.state.items():
        twin.state[p] = {
            k: v if k != "step" else torch.as_tensor(v, dtype=torch.float32)
            for k, v in state.items()
        }
    return twin


class ResidentSteps:
    """The W_IN, G_OUT and UPD handlers of a resident plan's step.

    Given the step's ``ctx``, its ``memory`` (buffers, the compute dtype),
    ``transfers`` (which BatchNorm statistics a load brought), ``updates`` (the
    host update's checks, run here on the device) and ``moved``
    (:meth:`~.memory.BytesMoved.count`)."""

    def __init__(
        self,
        ctx: StepContext,
        memory: StepMemory,
        transfers: Transfers,
        updates: Updates,
        moved,
    ):
        self.ctx, self.memory, self.transfers, self.updates = ctx, memory, transfers, updates
        self._moved = moved

    def handlers(self) -> dict:
        return {"W_IN": self.weights_in, "G_OUT": self.grads_out, "UPD": self.update}

    def weights_in(self, task: Task) -> None:
        started = time.perf_counter()
        s, e = task.layers
        on_device(self.ctx, self.memory.backends[task.device].torch_device)
        host, memory = self.ctx.host, self.memory
        copies: dict[int, torch.Tensor] = {}  # a tensor several layers share: one copy
        weights, leaves = {i: {} for i in range(s, e)}, {i: {} for i in range(s, e)}
        casts = RunCasts(self._to_cast(s, e))
        for i in range(s, e):
            for is_param, tensors in ((True, host.params[i]), (False, host.buffers[i])):
                for name, t in tensors.items():
                    first = id(t) not in copies
                    if first:
                        copies[id(t)] = casts.get(t)
                    weights[i][name] = copies[id(t)]
                    if first and is_param and t.requires_grad:
                        leaves[i][name] = copies[id(t)]
        self.transfers.note_loaded(task.io["weights"], s, e)
        # a tensor several layers share is held once, as the plan declares it
        memory.reserve(task.io["weights"], sum(map(nbytes, copies.values())))
        memory.put(task.io["weights"], weights)
        memory.put(task.io["grads"], leaves)
        self._moved(task, 0, started)

    def _to_cast(self, s: int, e: int) -> dict[int, tuple[torch.Tensor, torch.dtype]]:
        """id -> (tensor, the compute dtype) of layers [s, e)'s tensors the forward
        computes with in another dtype than their own, as a weight load casts them
        (BatchNorm's parameters and statistics keep theirs, updated in place)."""
        host, out = self.ctx.host, {}
        for i in range(s, e):
            for name, t in [*host.params[i].items(), *host.buffers[i].items()]:
                dtype = t.dtype if name in self.ctx.norm_tensors[i] else self.memory.wire_dtype(t)
                if dtype != t.dtype:
                    out[id(t)] = (t, dtype)
        return out

    def grads_out(self, task: Task) -> None:
        """The sums of the compute-dtype copies into the master gradients, on the GPU."""
        started = time.perf_counter()
        leaves = self.memory.store[task.io["src"][0]]
        dsts, srcs = [], []
        with torch.no_grad():
            for i, named in leaves.items():
                for name, leaf in named.items():
                    p = self.ctx.host.params[i][name]
                    if leaf is p or leaf.grad is None:
                        continue  # autograd summed into the master gradient itself
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    dsts.append(p.grad)
                    srcs.append(leaf.grad)
            if dsts:
                torch._foreach_copy_(dsts, srcs)  # one call: a pack has hundreds of tensors
        self._moved(task, 0, started)

    def update(self, task: Task) -> None:
        key = (task.pack, task.data.shard[0])
        opt = self.ctx.optimizers[key]
        if opt is not None:
            self.updates.host_update(task, key, opt)


class RunCasts:
    """The compute-dtype copies of ``to_cast`` (id -> (tensor, dtype)), made with one
    cast per run of a storage they lie in (a flat buffer of the host layout holds
    them all): per tensor, a pack of hundreds would launch a kernel for each."""

    def __init__(self, to_cast: dict[int, tuple[torch.Tensor, torch.dtype]]):
        self.to_cast = to_cast
        # (storage, dtypes) -> [first, end) element, a tensor in that storage
        spans: dict[tuple, list] = {}
        for t, dtype in to_cast.values():
            lo, hi = t.storage_offset(), t.storage_offset() + _extent(t)
            span = spans.setdefault(self._key(t, dtype), [lo, hi, t])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
        self.runs: dict[tuple, tuple[int, torch.Tensor]] = {
            key: (lo, _whole_storage(t)[lo:hi].to(key[2])) for key, (lo, hi, t) in spans.items()
        }

    @staticmethod
    def _key(t: torch.Tensor, dtype: torch.dtype) -> tuple:
        return (t.untyped_storage().data_ptr(), t.dtype, dtype)

    def get(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the forward computes with it: itself, or its cast (a leaf that
        requires grad as ``t`` does)."""
        if id(t) not in self.to_cast:
            return t
        _, dtype = self.to_cast[id(t)]
        lo, run = self.runs[self._key(t, dtype)]
        view = run.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        return view.detach().requires_grad_(isinstance(t, torch.nn.Parameter) and t.requires_grad)


def _extent(t: torch.Tensor) -> int:
    """Elements of its storage ``t`` spans from its offset on."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``'s storage, flat, in ``t``'s dtype and on its device."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
