"""The engine's training state as plain data, independent of the plan.

Optimizer state is kept per parameter *name* (its name in the host model), not
per optimizer: the engine has one optimizer per backward pack, so a state keyed
by pack would only fit the packing that wrote it. Keyed by name, a checkpoint
resumes under another plan, and :meth:`Engine.set_plan` keeps the optimizer
state when the packing changes.

State on a disk tier (:mod:`.disk_setup`) is read back into a whole state
(:meth:`Engine.state_dict`), or referred to by a checkpoint (:meth:`Engine.save`:
its ``"disk"`` entry names the tier, what it holds and the master weights left
out of ``"model"``; the tier keeps that step's state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..errors import HarmonyError
from .checkpoint import CheckpointError, read_checkpoint
from .journal import optimizer_params
from .refusals import make_optimizers
from .run_state import RunState

FORMAT = 1


@dataclass
class HeldState:
    """What a run's checkpoint is made of besides its :class:`RunState`: the host
    module (every host weight and buffer), the optimizers ((pack, shard) ->
    optimizer), the state on a disk tier (``disk``, once placed; ``resume``, the
    checkpoint's tier not yet opened) and the weights not yet made (``unmade``)."""

    host_module: nn.Module
    optimizers: dict
    disk: object = None
    resume: dict | None = None
    unmade: object = None


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in ``module`` (tied weights: the first name)."""
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_state(optimizers: dict, names: dict[int, str]) -> dict:
    """{"state": name -> per-parameter state, "groups": name -> its group's hyperparameters}."""
    state, groups = {}, {}
    for opt in optimizers.values():
        if opt is None:
            continue
        for group in opt.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                groups[names[id(p)]] = hyper
                if p in opt.state and opt.state[p]:
                    state[names[id(p)]] = opt.state[p]
    return {"state": state, "groups": groups}


def load_optimizer_state(optimizers: dict, saved: dict, names: dict[int, str]) -> None:
    """Give each optimizer the saved state and hyperparameters of its parameters
    (through ``load_state_dict``, which casts state to each parameter's device)."""
    for opt in optimizers.values():
        if opt is None:
            continue
        ordered = optimizer_params(opt)
        index = {id(p): i for i, p in enumerate(ordered)}
        groups = []
        for group in opt.param_groups:
            first = names[id(group["params"][0])] if group["params"] else None
            hyper = saved["groups"].get(first, {k: v for k, v in group.items() if k != "params"})
            groups.append({**hyper, "params": [index[id(p)] for p in group["params"]]})
        state = {
            i: saved["state"][names[id(p)]]
            for i, p in enumerate(ordered)
            if names[id(p)] in saved["state"]
        }
        opt.load_state_dict({"state": state, "param_groups": groups})


def carried_over(factory, units: dict, old: dict, module: nn.Module) -> dict:
    """New optimizers from ``factory`` for ``units`` ((pack, shard) -> parameters of
    ``module``) with the state of the ``old`` ones, per parameter name."""
    optimizers = make_optimizers(factory, units)
    names = param_names(module)
    load_optimizer_state(optimizers, optimizer_state(old, names), names)
    return optimizers


def run_state_dict(
    run: RunState, held: HeldState, task_overhead_s: float, referenced: bool = False
) -> dict:
    """The run's state: whole, or (``referenced``) referring to its disk tier;
    ``task_overhead_s`` is saved to inform (recalibrated on load)."""
    names = param_names(held.host_module)
    model = held.host_module.state_dict()
    optimizer = optimizer_state(held.optimizers, names)
    extra = {}
    disk, resume = held.disk, held.resume
    if resume is not None:  # resumed, and the tier not opened yet (at the first step)
        if not referenced:
            raise HarmonyError(
                "part of this run's state is on its disk tier, which the engine opens at its "
                "first step: step first, or save() (which refers to the tier)"
            )
        model = {k: v for k, v in model.items() if k not in set(resume["weights"])}
        extra["disk"] = {k: resume[k] for k in ("directory", "on_disk", "weights")}
    if disk is not None:
        every = held.host_module.named_parameters(remove_duplicate=False)
        on_disk = {n: names[id(p)] for n, p in every if id(p) in disk.on_disk}
        if referenced:
            model = {k: v for k, v in model.items() if k not in on_disk}
            extra["disk"] = {
                "directory": str(disk.tier.directory),
                "on_disk": [list(x) for x in disk.placement.on_disk],
                "weights": sorted(on_disk),
            }
        else:
            weights, state = disk.read_all(names)
            model.update({n: weights[first] for n, first in on_disk.items()})
            optimizer["state"].update(state)
    _check_made(held, model)
    return {
        "format": FORMAT,
        "step": run.step_count,
        "skipped_steps": run.skipped_steps,
        "seed": run.seed,
        "minibatch_size": run.minibatch_size,
        "plan": run.plan.to_dict() if run.plan is not None else None,
        "task_overhead_s": task_overhead_s,
        "precision": run.precision,
        "loss_scale": run.loss_scale,
        "good_steps": run.good_steps,
        "model": model,
        "optimizer": optimizer,
        "torch_rng": torch.get_rng_state(),
        **extra,
    }


def model_weights(held: HeldState) -> dict[str, torch.Tensor]:
    """Copies of the model's weights and buffers as its ``state_dict`` names them,
    master weights on the disk tier read back (the optimizer state stays there)."""
    own = held.host_module.state_dict()
    _check_made(held, own)
    disk = held.disk
    every = list(held.host_module.named_parameters(remove_duplicate=False))
    # a placeholder's copy would take a whole weight's memory for zeros: read, not copied
    there = {n for n, p in every if disk is not None and id(p) in disk.on_disk}
    model = {k: v.detach().clone() for k, v in own.items() if k not in there}
    if disk is None:
        if held.resume is not None:
            raise HarmonyError(
                "this engine resumed a run whose weights are partly on its disk tier, which "
                "opens at the first step: step first"
            )
        return model
    names = param_names(held.host_module)
    weights, _ = disk.read_all(names, kinds=("weights",))
    model.update({n: weights[names[id(p)]] for n, p in every if n in there})
    return {k: model[k] for k in own}  # in the state dict's order


def _check_made(held: HeldState, model: dict[str, torch.Tensor]) -> None:
    """The weights in ``model`` (a state dict of the host module) are made."""
    unmade = held.unmade
    if unmade is None or not unmade.pending:
        return
    every = held.host_module.named_parameters(remove_duplicate=False)
    missing = [n for n, p in every if n in model and unmade.holds(p)]
    if missing:
        raise HarmonyError(
            f"the model's weights ({missing[0]}, ...) were on the meta device: the engine "
            "makes them at its first step, where they live; step first"
        )


def check_state(run: RunState, held: HeldState, state: dict, source: str) -> None:
    """Raise a clear error, before anything changes, if ``state`` does not fit the run
    of ``run`` and ``held``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise HarmonyError(f"{source} is not an engine state of format {FORMAT}")
    _check_settings(run, state, source)
    if "disk" in state and held.resume is None:
        raise HarmonyError(
            f"{source} refers to a disk tier ({state['disk']['directory']}) for part of its "
            "state: continue it with Engine.load"
        )
    _check_model(held.host_module, state, source)


def _check_settings(run: RunState, state: dict, source: str) -> None:
    """The minibatch size, precision and seed ``state`` was written with are the run's."""
    if state["minibatch_size"] != run.minibatch_size:
        raise HarmonyError(
            f"{source} was written with minibatch {state['minibatch_size']}, the engine's is "
            f"{run.minibatch_size}; make the engine with "
            f"minibatch_size={state['minibatch_size']}"
        )
    if state["precision"] != run.precision:
        raise HarmonyError(
            f"{source} was written with precision {state['precision']!r}, the engine's is "
            f"{run.precision!r}; make the engine with precision={state['precision']!r}"
        )
    if state["seed"] != run.seed:
        raise HarmonyError(
            f"{source} was written with seed {state['seed']}, the engine's is {run.seed}: "
            f"dropout would draw other masks; make the engine with seed={state['seed']}"
        )


def _check_model(module: nn.Module, state: dict, source: str) -> None:
    """``state``'s weights and optimizer state are ``module``'s, name for name."""
    ours = module.state_dict()
    theirs = state["model"]
    on_disk = set(state.get("disk", {}).get("weights", ()))
    missing = sorted(set(ours) - set(theirs) - on_disk)
    unexpected = sorted(set(theirs) - set(ours))
    if missing or unexpected:
        raise HarmonyError(
            f"{source} is for another model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, t in ours.items():
        if name in on_disk:
            continue
        if theirs[name].shape != t.shape or theirs[name].dtype != t.dtype:
            raise HarmonyError(
                f"{source} is for another model: {name} is {tuple(theirs[name].shape)} "
                f"{theirs[name].dtype} there but {tuple(t.shape)} {t.dtype} here"
            )
    names = set(param_names(module).values())
    strangers = sorted(set(state["optimizer"]["state"]) - names)
    if strangers:
        raise HarmonyError(
            f"{source} has optimizer state for parameters this model lacks: {strangers[:5]}"
        )


def load_state(held: HeldState, state: dict) -> None:
    """Put ``state``'s weights, optimizer state and torch's random state into ``held``'s
    tensors and torch (checked first); unmade weights adopt the saved values."""
    unmade = held.unmade
    params = dict(held.host_module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        own = held.host_module.state_dict()
        for name, t in state["model"].items():
            if unmade is not None and unmade.holds(params.get(name)):
                unmade.adopt(params[name], t)  # the checkpoint's value: not made
            else:
                own[name].copy_(t)
    for p in held.host_module.parameters():
        p.grad = None
    load_optimizer_state(held.optimizers, state["optimizer"], param_names(held.host_module))
    torch.set_rng_state(state["torch_rng"])


def resumed(run: RunState, state: dict) -> RunState:
    """``run`` continued from ``state``: its step counters and loss scale."""
    return replace(
        run,
        step_count=state["step"],
        skipped_steps=state["skipped_steps"],
        loss_scale=state["loss_scale"],
        good_steps=state["good_steps"],
    )


def read_run_state(path) -> dict:
    """The run's state in the checkpoint ``path`` (:class:`CheckpointError` if it holds
    something else)."""
    state = read_checkpoint(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a checkpoint but not of an engine's state")
    return state


def run_arguments(state: dict) -> dict:
    """The engine's arguments ``state`` was written with, where the caller gives none:
    its precision and, for state on a disk tier, the tier's directory (as of the
    checkpoint)."""
    found = {"precision": state["precision"]}
    if "disk" in state:
        found["disk_dir"] = state["disk"]["directory"]
    return found
