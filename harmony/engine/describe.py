"""The sizes of a real chain of layers, as a ModelSpec without times.

The engine needs a spec to build its task graph even when it is handed a plan:
the graph's structure and byte counts come from parameter and activation
sizes, which a forward pass over a few samples tells, and its memory from what
the engine holds running each layer, which :func:`~.working_memory.working_memory` measures
the way the engine's meters count it (:mod:`harmony.engine.meters`): so the
simulated peak of a plan is the peak the engine reaches. The profiler
(:mod:`harmony.engine.profiler`) adds measured times.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn

from ..costs.layer import Kept
from ..costs.spec import Curve, LayerCost, ModelSpec, Tie
from ..errors import HarmonyError
from .reference_loop import as_args
from .structure import structure
from .working_memory import Held, norm_tensor_names, working_memory

_FLOAT_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def split_bytes(tensors) -> tuple[float, float]:
    """(floating-point elements, bytes of everything else) of a tuple of tensors."""
    floats, fixed = 0.0, 0.0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_floating_point():
            floats += t.numel()
        else:
            fixed += t.numel() * t.element_size()
    return floats, fixed


def layer_inputs(
    layers: Sequence[nn.Module],
    inputs: tuple,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    run_on: torch.device | None = None,
) -> list[tuple]:
    """The input of every layer (and, last, the chain's output) for ``inputs``;
    with ``dtype``, under ``torch.autocast`` on ``device`` (the layers' own).
    ``run_on``: a GPU each host layer runs on instead, a copy of it at a time, its
    input and output in host memory (over a large model's minibatch a 16-core host
    takes a minute: GPT-2 1.4 B, 8 x 1024 tokens); where a copy cannot run there,
    the layer runs on the host."""
    out = [inputs]
    h = inputs
    kind = (run_on or device or torch.device("cpu")).type
    with torch.no_grad(), torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
        for layer in layers:
            h = as_args(layer(*h) if run_on is None else _run_copy(layer, h, run_on))
            out.append(h)
    return out


def _run_copy(layer: nn.Module, args: tuple, device: torch.device):
    """``layer(*args)`` computed by a copy of it on ``device``, in host memory (the
    layer itself where the copy fails: a tensor it holds outside its parameters and
    buffers stays behind, say)."""
    try:
        copied = copy.deepcopy(layer).to(device)
        moved = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in args)
        result = as_args(copied(*moved))
    except Exception:
        return layer(*args)
    return tuple(t.to("cpu") if isinstance(t, torch.Tensor) else t for t in result)


def _device_to_run_on(layers: Sequence[nn.Module], device: torch.device) -> torch.device | None:
    """``device`` where it is a GPU and the layers' weights are made (not meta)."""
    if device.type != "cuda":
        return None
    made = all(t.device.type == "cpu" for layer in layers for t in layer.state_dict().values())
    return device if made else None


class evaluating:
    """Eval mode for the duration of a block, restoring every module's own flag
    (``layer.train(mode)`` would overwrite the flags of its submodules)."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.modules = [m for layer in layers for m in layer.modules()]

    def __enter__(self):
        self.flags = [m.training for m in self.modules]
        for m in self.modules:
            m.training = False

    def __exit__(self, *exc):
        for m, flag in zip(self.modules, self.flags):
            m.training = flag


def microbatch_dependence(layers) -> str | None:
    """Why the layers' results depend on how a minibatch is cut into microbatches
    (so forward and backward must use one microbatch size), or None. A layer may
    say why itself, in words, as its ``batch_dependent`` attribute."""
    for layer in layers:  # a layer that says so (a block of experts: tokens meet in routing)
        if getattr(layer, "batch_dependent", None):
            return layer.batch_dependent
    if any(getattr(layer, "draws_random", False) for layer in layers):  # functional dropout
        return (
            "dropout: recompute must draw the forward pass's masks, "
            "which are seeded per microbatch"
        )
    for m in (m for layer in layers for m in layer.modules()):
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return (
                "dropout: recompute must draw the forward pass's masks, "
                "which are seeded per microbatch"
            )
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            return "BatchNorm: its batch statistics depend on the microbatch"
    return None


def act_dtype(layers: Sequence[nn.Module]) -> str:
    for p in (p for layer in layers for p in layer.parameters()):
        return _FLOAT_NAMES.get(p.dtype, "float32")
    return "float32"


def describe(
    layers: Sequence[nn.Module],
    inputs: tuple,
    target: torch.Tensor,
    name: str = "model",
    optimizer: str = "adamw",
    loss_fn: Callable | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    sizes: Sequence[int] = (),
) -> ModelSpec:
    """Sizes per layer, and the device memory the engine holds running each layer,
    measured on ``inputs`` on ``device`` at each microbatch size a plan may use
    (powers of two up to the minibatch, the minibatch, and ``sizes``: what
    autograd keeps is not always proportional to the samples, e.g. attention
    kernels chosen by batch size), and the FLOPs per sample (times are derived
    from them until the profiler measures them). With ``loss_fn`` the loss is
    checked on the first samples and the last layer's working memory includes
    it, as in the fused last pack. ``dtype``: mixed precision, as the engine
    runs it: weights and activations cross in ``dtype`` and layers run under
    ``torch.autocast``."""
    device = torch.device(device)
    B = target.shape[0]
    few = tuple(t[:4] for t in inputs)
    run_on = _device_to_run_on(layers, device)
    acts, outs = _first_samples_through(layers, few, inputs, device, dtype, run_on)
    if loss_fn is not None:
        check_loss(loss_fn, acts[-1], target)
    smallest = min_microbatch(layers, acts, device, dtype)
    if smallest > target.shape[0]:
        raise HarmonyError(
            f"the model trains on {smallest} samples at least (a BatchNorm over features needs "
            f"more than one value per channel), but the minibatch has {target.shape[0]}"
        )
    sizes = sorted(
        {u for u in [*(1 << k for k in range(B.bit_length())), B, *sizes] if smallest <= u <= B}
    )
    with evaluating(layers):
        # the whole minibatch: every size is a slice of it
        acts = layer_inputs(layers, inputs, run_on=run_on)
    costs = []
    made = [(-1, k) for k in range(len(acts[0]))]  # which layer made each input element, as which
    measured: dict[tuple, list[Held]] = {}  # layers of one structure are measured once
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        key = structure(layer, [acts[i]], last)
        if key not in measured:
            measured[key] = _held_at_sizes(
                i, layer, acts[i], sizes, loss_fn if last else None, target, device, dtype
            )
        held = measured[key]
        costs.append(_layer_cost(i, layer, acts[i], outs[i], held, sizes, made))
        made = [tensor_of(i, ref, made) for ref in held[-1].handed_on]
    per_sample = target[:1]
    master = act_dtype(layers)
    spec = ModelSpec(
        name=name,
        layers=tuple(costs),
        optimizer=optimizer,
        param_dtype=master,
        act_dtype=master,
        master_dtype=master,
        ties=ties(layers),
        min_microbatch=smallest,
        target_bytes_per_sample=float(per_sample.numel() * per_sample.element_size()),
        source="described from the real modules (sizes and working memory)",
    )
    return spec if dtype is None else _crossing_in(spec, dtype)


def _first_samples_through(
    layers: Sequence[nn.Module],
    few: tuple,
    inputs: tuple,
    device: torch.device,
    dtype: torch.dtype | None,
    run_on: torch.device | None,
) -> tuple[list[tuple], list[tuple]]:
    """Each layer's input on the ``few`` first samples, and each layer's output as
    the engine holds it between layers (as autocast makes it under ``dtype``); the
    model's own error on them said about the user's ``inputs``. ``run_on``: see
    :func:`layer_inputs`."""
    try:
        with evaluating(layers):  # a forward for sizes must not touch BatchNorm statistics
            acts = layer_inputs(layers, few, run_on=run_on)
            # what the engine holds between layers: their outputs as autocast makes them
            outs = (
                acts[1:]
                if dtype is None
                else layer_inputs(layers, few, device, dtype, run_on=run_on)[1:]
            )
    except Exception as e:  # the model's own error, about the user's inputs
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
        raise HarmonyError(
            f"the model cannot run on the given inputs ({shapes}): {type(e).__name__}: {e}. "
            "Pass inputs of the shape and dtype its first layer expects."
        ) from None
    return acts, outs


def _held_at_sizes(
    i: int,
    layer: nn.Module,
    act: tuple,
    sizes: list[int],
    loss_fn: Callable | None,
    target: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype | None,
) -> list[Held]:
    """:func:`working_memory` of layer ``i`` on its input ``act`` at each of ``sizes``."""
    try:
        return [
            working_memory(layer, tuple(t[:u] for t in act), loss_fn, target[:u], device, dtype)
            for u in sizes
        ]
    except Exception as e:  # the layer's own error with autograd on, in training mode
        raise HarmonyError(
            f"layer {i} ({type(layer).__name__}) fails in training mode on {sizes[0]} "
            f"samples: {type(e).__name__}: {e}"
        ) from None


def _layer_cost(
    i: int,
    layer: nn.Module,
    act: tuple,
    out: tuple,
    held: list[Held],
    sizes: list[int],
    made: list,
) -> LayerCost:
    """Layer ``i``'s sizes, and what it holds (``held``) at each of ``sizes``; ``act``
    and ``out``: its input and output; ``made``: which layer made each input element."""
    floats, fixed = split_bytes(tuple(t[:1] for t in act))
    norms = norm_tensor_names(layer)
    out_bytes = sum(t[:1].numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
    return LayerCost(
        name=f"{i}:{type(layer).__name__}",
        param_numel=sum(p.numel() for p in layer.parameters()),
        buffer_numel=sum(b.numel() for b in layer.buffers() if b.is_floating_point()),
        norm_param_numel=sum(p.numel() for name, p in layer.named_parameters() if name in norms),
        norm_buffer_numel=sum(
            b.numel()
            for name, b in layer.named_buffers()
            if name in norms and b.is_floating_point()
        ),
        fixed_buffer_bytes=sum(
            b.numel() * b.element_size() for b in layer.buffers() if not b.is_floating_point()
        ),
        input_numel_per_sample=floats,
        input_fixed_bytes_per_sample=fixed,
        # times from the FLOP rate until measured: backward recomputes, then costs twice
        # the forward
        fwd_flops_per_sample=held[-1].flops / sizes[-1],
        bwd_flops_per_sample=3 * held[-1].flops / sizes[-1],
        fwd_extra=Curve.linear(float(out_bytes)),
        bwd_extra=Curve.table(sizes, [h.saved for h in held]),
        saved_input=Curve.table(sizes, [h.saved_input for h in held]),
        saved_output=Curve.table(sizes, [h.saved_output for h in held]),
        kept=kept_tensors(i, held, sizes, made),
    )


def _crossing_in(spec: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    """``spec`` with weights and activations crossing the links in ``dtype`` (mixed
    precision); its working memory was measured as it is under autocast."""
    low = spec.with_dtypes(param_dtype=_FLOAT_NAMES[dtype], act_dtype=_FLOAT_NAMES[dtype])
    return replace(
        low,
        layers=tuple(
            replace(
                c,
                fwd_extra=m.fwd_extra,
                bwd_extra=m.bwd_extra,
                saved_input=m.saved_input,
                saved_output=m.saved_output,
                kept=m.kept,
            )
            for c, m in zip(low.layers, spec.layers)
        ),
    )


def tensor_of(i: int, ref: tuple, made: list) -> tuple[int, int]:
    """(the layer that made it, its element there) of layer ``i``'s input or output
    element ``ref`` (:func:`handed_on`); ``made``: the same for layer ``i``'s inputs."""
    role, k = ref
    return made[k] if role == "in" else (i, k)


def kept_tensors(i: int, held: list[Held], sizes: list[int], made: list) -> tuple[Kept, ...]:
    """The tensors of the chain that layer ``i`` keeps for backward, at each size."""
    refs = sorted({ref for h in held for ref in h.kept})
    kept = []
    for ref in refs:
        layer, element = tensor_of(i, ref, made)
        nbytes = Curve.table(sizes, [h.kept.get(ref, 0.0) for h in held])
        kept.append(Kept(i - layer, element, nbytes))
    return tuple(kept)


def min_microbatch(
    layers: Sequence[nn.Module], acts: list[tuple], device: torch.device, dtype: torch.dtype | None
) -> int:
    """1 if every layer trains on one sample of its input ``acts[i]``, else 2
    (BatchNorm over features needs more than one value per channel;
    :func:`describe` reports a layer that fails on two as well)."""
    for i, layer in enumerate(layers):
        try:
            working_memory(
                layer, tuple(t[:1] for t in acts[i]), None, torch.empty(0), device, dtype
            )
        except Exception:  # noqa: BLE001 - the layer's own error on one sample
            return 2
    return 1


def ties(layers: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """The parameters that several layers share, as the spec counts them."""
    uses: dict[int, list[int]] = {}
    numel: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            uses.setdefault(id(p), []).append(i)
            numel[id(p)] = p.numel()
    return tuple(Tie(tuple(v), numel[k]) for k, v in uses.items() if len(v) > 1)


def check_loss(loss_fn: Callable, output: tuple, target: torch.Tensor) -> None:
    """The loss of the model's output on the first samples must be a scalar tensor
    that autograd can differentiate: say what is wrong before anything runs."""
    out = tuple(
        t.detach().requires_grad_(True)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
        else t
        for t in output
    )
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in out)
    how = (
        "loss_fn(output, target) must return the mean loss of the microbatch as a scalar tensor, "
        "e.g. torch.nn.functional.cross_entropy(output, target)"
    )
    try:
        with torch.enable_grad():
            loss = loss_fn(*out, target[: len(out[0])])
    except Exception as e:  # the user's loss function on the user's data
        tuple_note = (
            "The last layer returns a tuple, whose elements are passed as separate arguments. "
            if len(out) > 1
            else ""
        )
        raise HarmonyError(
            f"the loss function fails on the model's output ({shapes}) and the target (per sample "
            f"{tuple(target.shape[1:])} {target.dtype}): {type(e).__name__}: {e}. "
            f"{tuple_note}{how}"
        ) from None
    if not isinstance(loss, torch.Tensor):
        raise HarmonyError(
            f"the loss function returned a {type(loss).__name__}, not a tensor: {how} "
            "(without .item() or float())"
        )
    if loss.numel() != 1:
        raise HarmonyError(
            f"the loss function returned a tensor of shape {tuple(loss.shape)}, not a scalar "
            f"(reduction='none'?): {how}"
        )
    if not loss.is_floating_point() or not loss.requires_grad:
        raise HarmonyError(
            f"the loss function returned a {loss.dtype} tensor that does not depend on the "
            f"model's output through autograd (detached?): {how}"
        )


def describe_chain(
    layers: Sequence[nn.Module],
    inputs: tuple,
    target: torch.Tensor,
    name: str,
    optimizer: str,
    loss_fn: Callable,
    device: torch.device,
    dtype: torch.dtype | None,
    plan=None,
) -> ModelSpec:
    """:func:`describe` of a chain an engine trains, at the microbatch sizes of
    ``plan`` (a :class:`~harmony.plan.Plan`, or None: none yet)."""
    planned = (
        []
        if plan is None
        else [b - a for mbs in (plan.fwd_microbatches(), plan.bwd_microbatches()) for a, b in mbs]
    )
    return describe(
        layers,
        inputs,
        target,
        name=name,
        optimizer=optimizer,
        loss_fn=loss_fn,
        device=device,
        dtype=dtype,
        sizes=planned,
    )
