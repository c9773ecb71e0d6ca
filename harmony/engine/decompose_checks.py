"""What :func:`~harmony.engine.decompose.decompose` checks beyond the split itself:
a chain run beside its model's own forward (where they first differ, layer by
layer), raw transformers blocks in a hand-written list (the arguments the chain
would not give them), and a chain that split nothing.

The calling convention and a worked wrapper: the README, "Your own blocks"."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import HarmonyError
from .decompose_shared import GUIDE, reference_forward
from .describe import evaluating

#: block arguments a transformers model's forward computes once and hands every block
_BLOCK_ARGUMENTS = {
    "position_embeddings": "position_embeddings (the rotary cos/sin the model computes once)",
    "attention_mask": "attention_mask (the causal or padding mask the model builds)",
    "alibi": "alibi (the position bias the model builds)",
}


def refuse_raw_blocks(items: list, what: str) -> None:
    """Raise for a transformers block in ``items`` whose forward needs what its model
    computes once (a mask, rotary cos/sin): the chain calls it with the hidden states only."""
    for i, m in enumerate(items):
        if not type(m).__module__.startswith("transformers."):
            continue
        wants = [
            text
            for name, text in _BLOCK_ARGUMENTS.items()
            if name in inspect.signature(m.forward).parameters
        ]
        if wants:
            raise HarmonyError(
                f"element {i} of {what} is a {type(m).__name__} from transformers, which the "
                f"chain would call with the hidden states alone, without {' or '.join(wants)}. "
                "Pass the transformers model itself (decompose splits it, see its error if not), "
                f"or wrap each block in a module that computes them: {GUIDE}"
            )


def warn_if_unsplit(layers: list[nn.Module], names: list[str], model) -> None:
    """Warn where one layer holds most parameters and a list of blocks it did not split."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(sizes)
    big = max(range(len(layers)), key=sizes.__getitem__)
    if total == 0 or 2 * sizes[big] <= total:
        return
    lists = [
        (name, len(m))
        for name, m in layers[big].named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1
    ]
    if not lists:
        return
    where, count = lists[0]
    kind = type(model).__name__ if model is not None else "the list"
    warnings.warn(
        f"nothing was split in {kind}: layer {names[big]} holds "
        f"{100 * sizes[big] // total}% of the parameters, with {count} blocks in "
        f"{where or 'it'} that the chain runs as one layer, which the engine trains as one "
        "pack that must fit a GPU whole. Pass the model those blocks belong to (a "
        "transformers model itself, not a module around it), or a list of its blocks "
        f"wrapped to follow the calling convention: {GUIDE}",
        stacklevel=3,
    )


def _first(value) -> torch.Tensor | None:
    """The first tensor of a layer's or module's output (a tensor, tuple or ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (tuple, list)) and value:
        return _first(value[0])
    return None


def _differs(got, expected) -> str | None:
    """How ``got`` differs from ``expected`` (None: close, up to kernels' own rounding)."""
    try:
        torch.testing.assert_close(got, expected)
    except (AssertionError, TypeError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


class _Recorder:
    """Forward hooks on the model's modules that ``layers`` call: each module's first
    output tensor, and the order in which the modules finished."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]):
        inside = {id(m) for layer in layers for m in layer.modules()}
        self.outputs: dict[int, torch.Tensor | None] = {}
        self.finished: dict[int, int] = {}  # module -> when it last finished
        self.clock = 0
        self.names = {id(m): n for n, m in model.named_modules() if id(m) in inside}
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if id(m) in inside and m is not model
        ]

    def _hook(self, module, args, output):
        self.outputs[id(module)] = _first(output)
        self.clock += 1
        self.finished[id(module)] = self.clock

    def last_called(self, layer: nn.Module) -> int | None:
        """The model's module inside ``layer`` that its forward finished last."""
        called = [id(m) for m in layer.modules() if id(m) in self.finished]
        return max(called, key=self.finished.__getitem__, default=None)

    def close(self):
        for handle in self.handles:
            handle.remove()


def run_chain(layers: list[nn.Module], names: list[str], inputs: tuple, kind: str) -> list:
    """Each layer's output on ``inputs`` under the calling convention; a layer that
    fails is reported with its name."""
    outputs, x = [], inputs
    for layer, name in zip(layers, names):
        try:
            out = layer(*x)
        except Exception as e:  # reported with the layer's name
            raise HarmonyError(
                f"the chain of {kind}: layer {name} ({type(layer).__name__}) failed on the "
                f"example inputs ({type(e).__name__}: {e}); each layer must follow the "
                f"calling convention: {GUIDE}"
            ) from e
        outputs.append(out)
        x = out if isinstance(out, tuple) else (out,)
    return outputs


def check_chain(
    layers: list[nn.Module],
    names: list[str],
    model: nn.Module,
    inputs: tuple,
    forward: Callable[[], Any],
    kind: str,
) -> None:
    """Run the chain on ``inputs`` and the model (``forward()``: what the chain's last
    layer must return) under ``no_grad``; raise where they first differ."""
    with torch.no_grad():
        outputs = run_chain(layers, names, inputs, kind)
        recorder = _Recorder(model, layers)  # after the chain: it calls the same modules
        try:
            expected = forward()
        except Exception as e:  # reported as the model's own
            raise HarmonyError(
                f"{kind}'s own forward failed on the example inputs ({type(e).__name__}: {e}); "
                "pass inputs it accepts, as the chain takes them"
            ) from e
        finally:
            recorder.close()
    problem = _differs(outputs[-1], expected)
    if problem is None:
        return
    where = ""
    for i, (layer, out) in enumerate(zip(layers, outputs)):
        anchor = recorder.last_called(layer)
        own, got = recorder.outputs.get(anchor), _first(out)
        if own is not None and got is not None and got.shape == own.shape:
            if _differs(got, own) is not None:
                where = (
                    f"; the first layer whose output differs from the model's is {i} "
                    f"({names[i]}), against {recorder.names[anchor]}"
                )
                break
    raise HarmonyError(
        f"the chain of {kind} does not compute what its forward computes ({problem}){where}. "
        f"Each layer must call its part as the model's forward does: {GUIDE}"
    )


def check_reference(layers: list, names: list[str], reference: nn.Module, example_inputs) -> None:
    """Run the chain beside ``reference``'s own forward; raise where they part."""
    if example_inputs is None:
        raise HarmonyError(
            "decompose(..., reference=model) needs example_inputs: what the chain takes "
            "(e.g. (input_ids, attention_mask)), to run the chain and the model on"
        )
    kind = type(reference).__name__
    if type(reference).__module__.startswith("transformers."):
        forward = reference_forward(reference, example_inputs)
    else:

        def forward():
            return reference(*example_inputs)

    with evaluating([reference, *layers]):
        check_chain(layers, names, reference, example_inputs, forward, kind)
