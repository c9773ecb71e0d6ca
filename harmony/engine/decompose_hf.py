"""Hugging Face transformers models as chains (see :mod:`harmony.engine.decompose`).

Each supported model becomes: its embeddings (layer 0), one layer per block, and
a last layer with the final norm and the head. Every layer is a small wrapper
that calls the model's own submodules (the same ``Parameter`` objects) exactly
as the model's ``forward`` (transformers 5) calls them, so the chain computes
what the model computes, with the same operations in the same order.

Calling convention: layer 0 takes the model's main inputs positionally,
``(input_ids[, attention_mask[, token_type_ids]])`` for text models and
``(pixel_values,)`` for ViT. An ``attention_mask`` ([batch, seq], 1 for tokens
and 0 for padding) travels along the chain with the hidden states, as
``(hidden_states, attention_mask)``; without one, layers pass the hidden states
alone. Each block rebuilds from them what the model's forward computes once and
hands every block: position ids, the causal / sliding-window / padding mask
(with the model's own ``masking_utils`` functions, for its attention
implementation), and rotary cos/sin (with the model's own rotary module, which
stays out of the layer's parameters and buffers: it holds constants only, which
the engine would otherwise ship with every block, in half precision under mixed
precision). The last layer returns the model's main output: logits, or the last
hidden state; for a bare encoder with a pooler, ``(last_hidden_state, pooler_output)``.

Dropout draws come from the global generator, which the engine and
:func:`harmony.reference_step` seed per (step, microbatch, layer); a block whose
forward may call ``torch.nn.functional.dropout`` (no ``nn.Dropout`` module the
engine could find) says so with ``draws_random = True``.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from ..errors import HarmonyError
from .decompose import _HOW_TO, _evaluating
from .hf.layers import FOLLOWED
from .hf.recipes import RECIPES, WAY_OUT, Split

__all__ = ["split"]


def split(
    model: nn.Module, example_inputs: tuple | None = None
) -> tuple[list[nn.Module], list[str]]:
    """The layers of a supported transformers ``model`` and their names. With
    ``example_inputs`` (what the chain takes: see the module documentation), the
    chain runs once beside the model's own forward, in eval mode without autograd,
    and a layer that fails or an output that differs is reported."""
    kind = type(model).__name__
    recipe = RECIPES.get(kind)
    if recipe is None:
        raise HarmonyError(
            f"{kind} from transformers cannot be split automatically (supported: "
            f"{', '.join(RECIPES)}); {_HOW_TO}, {WAY_OUT}"
        )
    if not FOLLOWED:
        raise HarmonyError(
            f"cannot split {kind}: the split follows the calling conventions "
            "of transformers 5, not those of the installed "
            f"{transformers.__version__}; upgrade it, or pass a list of blocks"
        )
    chain = recipe(model, kind)
    if example_inputs is not None and not any(p.is_meta for p in model.parameters()):
        _check(model, chain, example_inputs)
    return chain.layers, chain.names


def _check(model: nn.Module, chain: Split, example_inputs: tuple) -> None:
    """Run the chain and the model on the same inputs; raise where they part."""
    kind = type(model).__name__
    if len(example_inputs) > len(chain.inputs):
        raise HarmonyError(
            f"example_inputs has {len(example_inputs)} tensors but the chain of "
            f"{kind} takes at most {len(chain.inputs)}: {', '.join(chain.inputs)}"
        )
    with _evaluating([model]), torch.no_grad():
        x = example_inputs
        for layer, name in zip(chain.layers, chain.names):
            try:
                x = layer(*x)
            except Exception as e:  # reported with the layer's name
                raise HarmonyError(
                    f"cannot split {kind}: layer {name} ({type(layer).__name__}) failed on "
                    f"example_inputs ({type(e).__name__}: {e}); the installed transformers may "
                    f"call its blocks differently. {_HOW_TO}"
                ) from e
            x = x if isinstance(x, tuple) else (x,)
        extra = {"use_cache": False} if chain.cache else {}
        out = model(**dict(zip(chain.inputs, example_inputs)), **extra)
        expected = tuple(getattr(out, name) for name in chain.outputs)
    try:  # the same operations on the same device: equal up to kernels' own nondeterminism
        torch.testing.assert_close(x, expected)
    except AssertionError as e:
        raise HarmonyError(
            f"the chain of {kind} does not compute what its forward computes "
            f"({', '.join(chain.outputs)}): {e}. {_HOW_TO}"
        ) from None
