"""A fast CPU AdamW for one layer pack: :class:`FlatAdamW`.

Harmony steps each backward pack's parameters on the host as soon as the
pack's gradient lands there (a UPD task, overlapping the backward of earlier
packs); the update of the pack that finishes backward last is the part of the
iteration nothing hides. An AdamW step reads each parameter, its gradient and
its two moments and writes the parameter and the moments back: 7 x 4 bytes
per float32 element, so its speed limit is the host's memory bandwidth.
``torch.optim.AdamW``'s default CPU implementation runs one elementwise op at
a time over whole tensors: 20 tensor reads and writes where 7 suffice, plus a
temporary the size of the tensor. :class:`FlatAdamW` makes one pass over
memory, or (``fused=False``) the same ops on blocks that stay in cache.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

from ..errors import HarmonyError

#: elements per block of the exact (``fused=False``) step: a block's five operands
#: (parameter, gradient, two moments, denominator; 4 MiB each in float32) stay in
#: a server's last-level cache from one op to the next, and blocks are few enough
#: that each op's start and join of torch's worker threads costs little
BLOCK = 1 << 20


@functools.cache
def fused_kernel_available() -> bool:
    """Whether this torch has the fused AdamW kernel for CPU tensors (PyTorch >= 2.4)."""
    x = torch.zeros(1)
    try:
        torch._fused_adamw_(
            [x],
            [x.clone()],
            [x.clone()],
            [x.clone()],
            [],
            [torch.ones(())],
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True


class FlatAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` for parameters in host memory, at memory bandwidth.

    Same hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``: decoupled
    weight decay, default 1e-2), the same semantics (parameters whose ``.grad``
    is None are skipped and their ``step`` does not advance; changes to
    ``param_groups`` such as a new ``lr`` apply at the next step) and the same
    state: per parameter ``step`` (a float32 tensor), ``exp_avg`` and
    ``exp_avg_sq``, so ``state_dict()`` moves between FlatAdamW and
    ``torch.optim.AdamW`` both ways.

    The moments a step creates live in two flat buffers per dtype (one pair per
    step that creates state), each parameter's state being a view of them; a
    state that arrives by ``load_state_dict`` is copied into buffers of the
    same kind (so the optimizer shares nothing with the state dict), and one
    that arrives by assignment (a disk tier's staging buffers: see
    :func:`~harmony.engine.tiers.adopt_state`) is stepped in place, where it
    is: the optimizer keeps no buffer of its own, so dropping its state frees
    it. The parameters are updated in place where they are (the same
    Parameter objects, on the same storage), and ``.grad`` is read afresh at
    every step, whoever replaced it.

    ``fused`` picks the arithmetic, like ``torch.optim.AdamW``'s argument of
    that name (it stays with the optimizer: loading a state dict does not
    change it):

    * ``True`` (the default, ``None``, where this torch has the kernel: PyTorch
      >= 2.4): torch's fused CPU AdamW kernel, one vectorized, multithreaded pass
      per tensor, all the tensors of the group in one call. Bitwise equal to
      ``torch.optim.AdamW(fused=True)``. Against the default
      ``torch.optim.AdamW`` it is allclose, not bitwise: the kernel computes
      ``p - (s * m) / d`` where the default computes ``p - s * (m / d)``, so an
      element may differ by an ulp or two per step.
    * ``False``: torch's own sequence of elementwise ops, on blocks of
      :data:`BLOCK` elements that stay in cache (a block may span several
      tensors). Bitwise equal to ``torch.optim.AdamW``'s default (for-loop) and
      ``foreach`` implementations; about a third of the fused kernel's speed
      and 1.5-2x the default's in ``bench/optimizer.py`` (its many short
      multithreaded ops lose most when other work shares the cores).

    ``amsgrad`` and ``maximize`` are not implemented and raise
    :class:`~harmony.errors.HarmonyError`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        fused: bool | None = None,
    ):
        params = list(params)
        if not params:
            raise HarmonyError(
                "FlatAdamW got no parameters: pass the parameters to optimize, "
                "e.g. FlatAdamW(model.parameters())"
            )
        if fused not in (None, True, False):
            raise HarmonyError(f"FlatAdamW: fused must be True, False or None, got {fused!r}")
        if fused and not fused_kernel_available():
            raise HarmonyError(
                f"this torch ({torch.__version__}) has no fused AdamW kernel for CPU tensors "
                "(PyTorch >= 2.4 has one): use FlatAdamW(..., fused=False)"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        super().__init__(params, defaults)
        # How to step, not a hyperparameter: kept out of param_groups, so that loading
        # a state dict (torch.optim.AdamW's has a "fused" entry) does not change it.
        self.fused: bool = fused_kernel_available() if fused is None else fused

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "fused": self.fused}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        for p in group["params"]:
            if p.device.type != "cpu" or not p.is_floating_point():
                raise HarmonyError(
                    "FlatAdamW steps real floating-point parameters in host memory; got a "
                    f"{p.dtype} parameter of shape {tuple(p.shape)} on {p.device}: use "
                    "torch.optim.AdamW for it (fused=True on a GPU)"
                )

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            loaded = [p for p in group["params"] if self.state.get(p)]
            for p, views in zip(loaded, _FlatMoments(loaded).views):
                state = self.state[p]
                _check_state(state, p)
                for key, view in zip(("exp_avg", "exp_avg_sq"), views):
                    state[key] = view.copy_(state[key])
                # a tensor of its own: load_state_dict hands over the source's step tensors
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    def ready_to_step(self) -> bool:
        """Raise what :meth:`step` would raise for its inputs as they are now (a
        hyperparameter out of range, a sparse gradient, a state that is not an AdamW
        state of its parameter), changing nothing. True when the step would then
        create no state: it only updates tensors that exist, so nothing but the
        interpreter itself (an interrupt, no memory at all) can make it fail."""
        creates = False
        for group in self.param_groups:
            _check_hyperparameters(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_dense(p)
                if self.state.get(p):
                    _check_state(self.state[p], p)
                else:
                    creates = True
        return not creates

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One AdamW step of every parameter that has a gradient; returns the
        closure's loss (if a closure is given, it is called first, with grad)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_hyperparameters(group)
            live = [p for p in group["params"] if p.grad is not None]
            for p in live:
                _check_dense(p)
            fresh = [p for p in live if not self.state.get(p)]
            for p, views in zip(fresh, _FlatMoments(fresh).views):
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"], state["exp_avg_sq"] = (v.zero_() for v in views)
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in live:
                state = self.state[p]
                _check_state(state, p)
                for key in ("exp_avg", "exp_avg_sq"):
                    if not state[key].is_contiguous():  # the kernels read raw memory
                        state[key] = state[key].contiguous()
                if not (torch.is_tensor(state["step"]) and state["step"].dtype == torch.float32):
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                params.append(p)
                # the fused kernel reads raw memory: it needs dense tensors
                grads.append(p.grad.contiguous())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            torch._foreach_add_(steps, 1.0)
            work = [p.contiguous() for p in params]  # the parameter itself, unless it is strided
            beta1, beta2 = group["betas"]
            update = _fused_adamw if self.fused else _blocked_adamw
            update(
                work,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
            )
            for p, w in zip(params, work):
                if w is not p:
                    p.copy_(w)
        return loss


def _check_hyperparameters(group: dict) -> None:
    beta1, beta2 = group["betas"]
    for name, ok in (
        ("lr", group["lr"] >= 0),
        ("eps", group["eps"] >= 0),
        ("betas[0]", 0 <= beta1 < 1),
        ("betas[1]", 0 <= beta2 < 1),
        ("weight_decay", group["weight_decay"] >= 0),
    ):
        if not ok:
            raise HarmonyError(
                f"FlatAdamW: invalid {name} in "
                f"{ ({k: v for k, v in group.items() if k != 'params'}) }; lr, eps and "
                "weight_decay must be >= 0 and each beta in [0, 1)"
            )
    for flag, instead in (
        ("amsgrad", "torch.optim.AdamW(amsgrad=True)"),
        ("maximize", "minimize the negated loss"),
    ):
        if group.get(flag):
            raise HarmonyError(f"FlatAdamW does not implement {flag}=True: use {instead}")


def _check_dense(p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise HarmonyError(
            "FlatAdamW got a sparse gradient for a parameter of shape "
            f"{tuple(p.shape)}; use torch.optim.SparseAdam for sparse gradients"
        )


def _check_state(state: dict, p: torch.Tensor) -> None:
    """``state`` is an AdamW state of parameter ``p``."""
    for key in ("exp_avg", "exp_avg_sq"):
        value = state.get(key)
        if "step" not in state or not torch.is_tensor(value) or value.shape != p.shape:
            raise HarmonyError(
                f"optimizer state of a parameter of shape {tuple(p.shape)} has {key!r} "
                f"{tuple(value.shape) if torch.is_tensor(value) else value!r} and step "
                f"{state.get('step')!r}: the state dict is not an AdamW state of these "
                "parameters"
            )


class _FlatMoments:
    """``exp_avg`` and ``exp_avg_sq`` of some parameters in flat buffers, one pair
    per dtype; ``views[i]`` are parameter i's, shaped like it. The buffers are
    not zeroed: a parameter's views are zeroed when its state is created, so
    parameters that never get a gradient never touch their pages."""

    def __init__(self, params: list[torch.Tensor]):
        sizes: dict[torch.dtype, int] = {}
        offsets = []
        for p in params:
            offsets.append(sizes.get(p.dtype, 0))
            sizes[p.dtype] = offsets[-1] + p.numel()
        buffers = {
            dtype: (torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype))
            for dtype, n in sizes.items()
        }
        self.views = [
            tuple(b[o : o + p.numel()].view(p.shape) for b in buffers[p.dtype])
            for p, o in zip(params, offsets)
        ]


def _fused_adamw(
    params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay
) -> None:
    """torch's fused AdamW kernel: one pass over each tensor, all tensors in one call."""
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def _blocked_adamw(
    params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay
) -> None:
    """torch.optim.AdamW's arithmetic op for op (so bitwise equal to it), block by
    block: each op streams a block that the previous op left in cache."""
    step_size, bias_correction2_sqrt = [], []
    for step in steps:
        t = step.item()
        step_size.append(lr / (1 - beta1**t))
        bias_correction2_sqrt.append((1 - beta2**t) ** 0.5)
    flat = [tuple(t.view(-1) for t in ts) for ts in zip(params, grads, exp_avgs, exp_avg_sqs)]
    scratch = {dtype: torch.empty(BLOCK, dtype=dtype) for dtype in {p.dtype for p in params}}
    for block in _blocks([p.numel() for p in params]):
        P, G, M, V, D, minus_step, bc2 = [], [], [], [], [], [], []
        at = 0
        for i, lo, hi in block:
            p, g, m, v = (t[lo:hi] for t in flat[i])
            P.append(p), G.append(g), M.append(m), V.append(v)
            D.append(scratch[p.dtype][at : at + hi - lo])
            minus_step.append(-step_size[i])
            bc2.append(bias_correction2_sqrt[i])
            at += hi - lo
        if weight_decay != 0:
            torch._foreach_mul_(P, 1 - lr * weight_decay)
        torch._foreach_lerp_(M, G, 1 - beta1)
        torch._foreach_mul_(V, beta2)
        torch._foreach_addcmul_(V, G, G, 1 - beta2)
        for d, v in zip(D, V):
            torch.sqrt(v, out=d)
        torch._foreach_div_(D, bc2)
        torch._foreach_add_(D, eps)
        torch._foreach_addcdiv_(P, M, D, minus_step)


def _blocks(sizes: list[int]) -> list[list[tuple[int, int, int]]]:
    """Tensors of ``sizes`` elements, laid end to end, cut into blocks of
    :data:`BLOCK` elements: each block a list of (tensor, start, stop)."""
    blocks, block, room = [], [], BLOCK
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            hi = min(n, lo + room)
            block.append((i, lo, hi))
            room -= hi - lo
            lo = hi
            if room == 0:
                blocks.append(block)
                block, room = [], BLOCK
    if block:
        blocks.append(block)
    return blocks
