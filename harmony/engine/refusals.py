"""What the engine refuses, said in words before anything runs or changes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..costs.hardware import Hardware
from ..costs.spec import ModelSpec
from ..errors import HarmonyError
from ..graph import OPT_IN, UPD, TaskGraph
from ..plan import Plan
from ..policies import POLICIES, get_policy, state_on_gpu
from .describe import microbatch_dependence
from .journal import optimizer_params

NONFINITE = ("raise", "skip")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_arguments(
    optimizer,
    loss_fn,
    minibatch_size,
    seed,
    nonfinite: str,
    precision: str,
    spec,
    hardware,
) -> None:
    """The engine's arguments, each of the kind it must be."""
    if nonfinite not in NONFINITE:
        raise HarmonyError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if precision not in PRECISIONS:
        raise HarmonyError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise HarmonyError(f"seed must be a non-negative integer, got {seed!r}")
    if not callable(optimizer):
        raise HarmonyError(
            f"optimizer must be a factory such as lambda params: torch.optim.AdamW(params, "
            f"lr=3e-4), got {type(optimizer).__name__}"
        )
    if not callable(loss_fn):
        raise HarmonyError(
            f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}"
        )
    if (
        not isinstance(minibatch_size, int)
        or isinstance(minibatch_size, bool)
        or minibatch_size < 1
    ):
        raise HarmonyError(f"minibatch_size must be a positive integer, got {minibatch_size!r}")
    if spec is not None and not isinstance(spec, ModelSpec):
        raise HarmonyError(
            "spec must be a harmony.ModelSpec (e.g. from harmony.profile), got "
            f"{type(spec).__name__}"
        )
    if hardware is not None and not isinstance(hardware, Hardware):
        raise HarmonyError(f"hardware must be a harmony.Hardware, got {type(hardware).__name__}")


def check_plan(
    plan: Plan,
    layers: list[nn.Module],
    devices: list[str],
    minibatch_size: int,
    precision: str,
    distributed: bool,
) -> None:
    """``plan`` is one the engine runs, for these ``layers`` on its ``devices`` (their
    names), minibatch size, precision and servers."""
    if not isinstance(plan, Plan):
        raise HarmonyError(f"plan must be a harmony.Plan, got {type(plan).__name__}")
    plan.validate(len(layers))
    get_policy(plan.policy)  # an unknown or renamed policy: a clear error
    if plan.policy not in POLICIES:
        raise HarmonyError(
            f"the engine runs the policies {', '.join(POLICIES)}; got {plan.policy!r}"
        )
    if plan.n_gpus != len(devices):
        raise HarmonyError(
            f"plan is for {plan.n_gpus} GPUs but the engine has {len(devices)} "
            f"({', '.join(devices)})"
        )
    if plan.minibatch != minibatch_size:
        raise HarmonyError(
            f"plan is for minibatch {plan.minibatch} but the engine's is {minibatch_size}"
        )
    if plan.option("precision") not in (None, precision):
        raise HarmonyError(
            f"plan is for precision {plan.option('precision')!r} but the engine's is "
            f"{precision!r}: make the engine with precision={plan.option('precision')!r}"
        )
    if plan.fwd_microbatch != plan.bwd_microbatch:
        why = microbatch_dependence(layers)
        if why is not None:
            raise HarmonyError(
                "forward and backward microbatch sizes must be equal (got "
                f"{plan.fwd_microbatch} and {plan.bwd_microbatch}) for a model with {why}"
            )
    if plan.option("gpu_optimizer") and (precision != "fp32" or distributed):
        raise HarmonyError(
            f"{plan.policy} with gpu_optimizer steps float32 parameters on each GPU of one "
            "server; the engine runs it in precision 'fp32' on one server (a mixed-precision or "
            "multi-server run keeps the optimizer on the host: gpu_optimizer=False)"
        )


def check_updates_run_where_state_is(graph: TaskGraph, plan: Plan) -> None:
    """The engine keeps weights and optimizer state on the host: an update on a GPU
    needs a graph that brings them there (OPT_IN) once all it steps with is in, unless
    the plan keeps them there (:mod:`~harmony.engine.step.resident`)."""
    if state_on_gpu(plan.policy):
        return
    for t in graph.tasks:
        if t.kind != UPD or t.device == "cpu":
            continue
        state = [graph.tasks[d] for d in t.deps if graph.tasks[d].kind == OPT_IN]
        if not state:
            raise HarmonyError(
                f"{plan.policy} with gpu_optimizer keeps weights and optimizer state resident on "
                "the GPUs, and the engine keeps them on the host: train it with "
                "gpu_optimizer=False"
            )
        if set(t.deps) - {state[0].id} - set(state[0].deps):
            raise HarmonyError(
                f"{plan.policy} with gpu_optimizer brings the state of layers {t.layers} to "
                f"{t.device} before every part of their tied weights' gradient is in: the engine "
                "would step with part of it; train a model with weights tied across packs with "
                "gpu_optimizer=False"
            )


def check_optimizer_holds(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """The optimizer a factory made must step exactly the parameters it was given
    (one optimizer per pack): one built over ``model.parameters()`` would step
    every weight once per pack."""
    given = {id(p) for p in params}
    held = optimizer_params(opt)
    foreign = sum(1 for p in held if id(p) not in given)
    missing = len(given - {id(p) for p in held})
    if foreign or missing or len(held) != len({id(p) for p in held}):
        raise HarmonyError(
            f"the optimizer factory was given {len(given)} parameters but built an optimizer over "
            f"{len(held)} ({foreign} not among those given, {missing} of those given left out): "
            "build it over the parameters passed in, e.g. lambda params: "
            "torch.optim.AdamW(params, lr=3e-4), not over model.parameters()"
        )


def make_optimizers(factory: Callable, units: dict) -> dict:
    """One optimizer per update unit ((pack, shard) -> parameters; None without any)."""
    optimizers = {}
    for key, params in units.items():
        opt = factory(params) if params else None
        if params and not isinstance(opt, torch.optim.Optimizer):
            raise HarmonyError(
                f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer: "
                "pass e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)"
            )
        if params:
            check_optimizer_holds(opt, params)
        optimizers[key] = opt
    return optimizers


def check_same_sizes(given: ModelSpec, described: ModelSpec) -> None:
    """A cost model given to the engine must be of its chain, in its precision."""
    if len(given) != len(described):
        raise HarmonyError(
            f"the spec given has {len(given)} layers but the model has {len(described)}: "
            "give the spec harmony.profile made of this model's layers"
        )
    for i, (a, b) in enumerate(zip(given.layers, described.layers)):
        if (given.weight_bytes(i, i + 1), given.input_bytes(i, 1)) != (
            described.weight_bytes(i, i + 1),
            described.input_bytes(i, 1),
        ):
            raise HarmonyError(
                f"layer {i} of the spec given ({a.name}) has other sizes than the model's "
                f"({b.name}): {given.weight_bytes(i, i + 1)} vs "
                f"{described.weight_bytes(i, i + 1)} bytes of weights, {given.input_bytes(i, 1)} "
                f"vs {described.input_bytes(i, 1)} bytes of input per sample; give the spec "
                "harmony.profile made of this model, in the engine's precision"
            )


def batch_kinds(inputs: tuple, target: torch.Tensor) -> tuple:
    """Per-sample shapes and dtypes of a minibatch."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in (*inputs, target))


def check_batch(inputs: tuple, target, minibatch_size: int, first: tuple | None) -> None:
    """A minibatch of tensors of the engine's size that looks like the first (the
    plan and the graph were made for its shapes: ``first``, None before it)."""
    if not isinstance(target, torch.Tensor) or not all(
        isinstance(t, torch.Tensor) for t in inputs
    ):
        given = ", ".join(type(t).__name__ for t in (*inputs, target))
        raise HarmonyError(
            f"step(inputs, target) takes torch tensors (inputs: a tensor or a tuple of "
            f"tensors), got {given}; convert with torch.as_tensor"
        )
    if target.shape[0] != minibatch_size or any(t.shape[0] != minibatch_size for t in inputs):
        raise HarmonyError(
            f"expected a minibatch of {minibatch_size} samples (dimension 0), got inputs "
            f"{[tuple(t.shape) for t in inputs]} and target {tuple(target.shape)}"
        )
    kinds = batch_kinds(inputs, target)
    if first is not None and kinds != first:

        def show(ks):
            return ", ".join(f"[B, {', '.join(map(str, shape))}] {dtype}" for shape, dtype in ks)

        raise HarmonyError(
            f"this minibatch's inputs and target are {show(kinds)}, but the engine was set up "
            f"for {show(first)}; give every step minibatches of the same shapes and dtypes"
        )


def resolve_distributed(distributed: bool | None, disk_dir, unmade) -> bool:
    """Whether the engine trains across servers: as asked, else whether a process
    group of more than one process is initialized; refused with a disk tier
    (``disk_dir``) or weights not yet made (``unmade``)."""
    if distributed is None:
        distributed = (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        )
    if distributed and disk_dir is not None:
        raise HarmonyError("the disk tier runs on one server: disk_dir with distributed")
    if distributed and unmade is not None:
        raise HarmonyError(
            "a model with parameters on the meta device trains on one server: build it on "
            "the CPU to train it across servers"
        )
    return distributed


def check_microbatches(plan: Plan, spec: ModelSpec) -> None:
    """``plan``'s microbatches are as large as the chain of ``spec`` trains on."""
    smallest = min(
        b - a for mbs in (plan.fwd_microbatches(), plan.bwd_microbatches()) for a, b in mbs
    )
    if smallest < spec.min_microbatch:
        raise HarmonyError(
            f"plan {plan.describe()} runs microbatches of {smallest} sample(s), but "
            f"this model trains on {spec.min_microbatch} at least (a BatchNorm over "
            "features needs more than one value per channel): use larger microbatches (a "
            "divisor of the minibatch)"
        )
