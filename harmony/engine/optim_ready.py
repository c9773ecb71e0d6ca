"""Whether an optimizer's next step can fail: the question a step's point of no
return asks of every update left (:meth:`~harmony.engine.step.updates.Updates._commit`).

Past that point the updates are not journaled, so one that raised halfway would
leave the step neither undone nor done. It is passed only for optimizers whose
step, given the gradients checked finite beforehand, nothing but the interpreter
itself (an interrupt, no memory at all) can make fail: it updates tensors that
exist, of the shapes, dtypes and devices its arithmetic expects, creating none.

* :class:`~harmony.engine.optim.FlatAdamW`: its own :meth:`~.optim.FlatAdamW.ready_to_step`.
* ``torch.optim.AdamW`` and ``torch.optim.Adam`` (the class itself, not a subclass,
  which may step differently), in their for-loop, ``foreach`` and ``fused`` forms,
  and ``torch.optim.SGD``: when every group's hyperparameters are plain numbers,
  its flags the defaults torch steps on the host with (not ``capturable``, not
  ``differentiable``), no code of the caller's runs in the step (a step hook, a
  ``step`` set on the optimizer itself, a gradient scaler's), and every parameter
  with a gradient is a dense floating-point host tensor with a gradient and a
  state like it (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``, and
  ``max_exp_avg_sq`` under ``amsgrad``; SGD with momentum: ``momentum_buffer``).

Anything else is not sure: the step then journals every update, as before.
"""

from __future__ import annotations

from numbers import Real

import torch
from torch.optim import optimizer as torch_optimizer

from .optim import FlatAdamW

_ADAM_NUMBERS = ("lr", "eps", "weight_decay")
_ADAM_FLAGS = {"capturable": (False,), "differentiable": (False,)}
_SGD_NUMBERS = ("lr", "momentum", "dampening", "weight_decay")
_SGD_FLAGS = {"differentiable": (False,)}
_MODES = {"foreach": (None, False, True), "fused": (None, False, True)}
_SWITCHES = ("amsgrad", "maximize", "nesterov", "decoupled_weight_decay")


def ready_to_step(opt: torch.optim.Optimizer) -> bool:
    """True when ``opt.step()`` cannot fail as things stand (see the module's
    docstring); False when not sure. A :class:`FlatAdamW` raises here what its
    step would raise."""
    if type(opt) is FlatAdamW:
        return opt.ready_to_step()
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        numbers, flags, state_of = _ADAM_NUMBERS, _ADAM_FLAGS, _adam_state
    elif type(opt) is torch.optim.SGD:
        numbers, flags, state_of = _SGD_NUMBERS, _SGD_FLAGS, _sgd_state
    else:
        return False
    if _hooked(opt):
        return False
    for group in opt.param_groups:
        if not _plain_group(group, numbers, flags):
            return False
        for p in group["params"]:
            if p.grad is not None and not (_like(p.grad, p) and state_of(opt, group, p)):
                return False
    return True


def _hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether code of the caller's runs in the step: a step hook (the optimizer's own
    or a global one), a ``step`` set on the optimizer itself, a gradient scaler's."""
    return bool(
        "step" in vars(opt)
        or getattr(opt, "_optimizer_step_pre_hooks", None)
        or getattr(opt, "_optimizer_step_post_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
        or getattr(opt, "grad_scale", None) is not None
        or getattr(opt, "found_inf", None) is not None
    )


def _number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _plain_group(group: dict, numbers: tuple, flags: dict) -> bool:
    """Hyperparameters plain numbers, flags as torch steps host tensors with."""
    if not all(_number(group.get(k)) for k in numbers):
        return False
    betas = group.get("betas", (0.0, 0.0))
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_number, betas))):
        return False
    if any(group.get(k, allowed[0]) not in allowed for k, allowed in (flags | _MODES).items()):
        return False
    return all(group.get(k, False) in (False, True) for k in _SWITCHES)


def _like(t, p: torch.Tensor) -> bool:
    """``t`` is a dense host tensor of ``p``'s shape and dtype, needing no gradient."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.dtype == p.dtype
        and t.shape == p.shape
        and not t.requires_grad
    )


def _adam_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """``p`` is a real floating-point host tensor with an Adam state for it."""
    state = opt.state.get(p)
    if not (state and p.device.type == "cpu" and p.is_floating_point()):
        return False
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    step = state.get("step")
    return (
        all(_like(state.get(k), p) for k in moments)
        and isinstance(step, torch.Tensor)
        and step.numel() == 1
        and step.is_floating_point()
        and (step.dtype == torch.float32 or not group["fused"])  # the fused kernel's
        and step.device.type == "cpu"
        and not step.requires_grad
    )


def _sgd_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """``p`` is a real floating-point host tensor with, under momentum, its buffer."""
    if not (p.device.type == "cpu" and p.is_floating_point()):
        return False
    return group["momentum"] == 0 or _like(opt.state.get(p, {}).get("momentum_buffer"), p)
