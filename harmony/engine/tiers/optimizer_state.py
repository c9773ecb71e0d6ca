"""An optimizer's per-parameter state as named tensors, so that it can live in
a tier between updates: :func:`export_state` after a step, :func:`adopt_state`
before the next one, :func:`drop_state` in between, so the optimizer holds
none of it. Names are ``"<parameter index>.<state name>"`` (``"0.exp_avg"``),
the index counting the optimizer's parameters over its param groups."""

from __future__ import annotations

from typing import Mapping

import torch

from ...errors import HarmonyError


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """``opt``'s parameters over its param groups, in order."""
    return [p for group in opt.param_groups for p in group["params"]]


def export_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The state tensors of ``opt``, by name (the tensors themselves, not copies)."""
    out = {}
    for i, p in enumerate(optimizer_params(opt)):
        for name, value in sorted(opt.state.get(p, {}).items()):
            if not isinstance(value, torch.Tensor):
                raise HarmonyError(
                    f"{type(opt).__name__} keeps {name}={value!r}, not a tensor: "
                    "only tensor state can live in a tier"
                )
            out[f"{i}.{name}"] = value
    return out


def adopt_state(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make ``tensors`` (from :func:`export_state`, e.g. read back from a tier)
    the state of ``opt``; they are used in place, not copied."""
    params = optimizer_params(opt)
    for key, t in tensors.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(params) or not name:
            raise HarmonyError(
                f"state tensor {key!r} names no parameter of this "
                f"{type(opt).__name__} ({len(params)} parameters): it is another "
                "optimizer's state"
            )
        opt.state[params[int(index)]][name] = t


def drop_state(opt: torch.optim.Optimizer) -> None:
    """Forget ``opt``'s state (after it has been written to a tier)."""
    opt.state.clear()
