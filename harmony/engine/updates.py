"""What an update task does to a pack's optimizer, shared by the engine and the
profiler (so the planner is told what an update really costs): refuse a
non-finite gradient, journal what the step changes so a failure later in the
training step can undo it, step."""

from __future__ import annotations

import torch

from ..errors import NonFiniteError


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def check_finite_gradients(opt: torch.optim.Optimizer, layers: tuple[int, int]) -> None:
    """Refuse to apply a gradient with a NaN or an infinity."""
    grads = [p.grad for p in optimizer_params(opt) if p.grad is not None]
    if not grads:
        return
    # The 2-norm is one vectorized pass (the max-norm is ~20x slower on CPU) and is
    # NaN or infinite whenever an element is; a finite gradient so large that its
    # norm overflows is told apart by the exact test on that tensor alone.
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    if torch.isfinite(norms).all():
        return
    for g, norm in zip(grads, norms):
        if not torch.isfinite(norm) and not torch.isfinite(g).all():
            raise NonFiniteError(f"the gradient of layers {layers[0]}..{layers[1] - 1} is not finite "
                                 f"(a tensor of shape {tuple(g.shape)} holds NaN or infinity)", "gradient")


def clone_state(state: dict) -> dict:
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clone(x) for x in v]
        return v

    return clone(state)


def apply_update(opt: torch.optim.Optimizer, layers: tuple[int, int], key, journal: list | None) -> None:
    """Step ``opt`` (the update of ``layers``) after checking its gradients; with a
    ``journal``, first record (key, parameters, state) to undo it."""
    check_finite_gradients(opt, layers)
    if journal is not None:
        journal.append((key, [p.detach().clone() for p in optimizer_params(opt)], clone_state(opt.state_dict())))
    opt.step()
