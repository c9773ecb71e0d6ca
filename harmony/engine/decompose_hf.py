"""Hugging Face transformers models as chains (see :mod:`harmony.engine.decompose`).

Each model becomes: its embeddings (layer 0), one layer per block, and a last
layer with the final norm and the head, by its family's recipe
(:mod:`.hf.recipes`) or, for a decoder laid out as Llama, by its layout
(:mod:`.hf.layout`). Every layer is a small wrapper
that calls the model's own submodules (the same ``Parameter`` objects) exactly
as the model's ``forward`` (transformers 5) calls them, so the chain computes
what the model computes, with the same operations in the same order.

Calling convention: layer 0 takes the model's main inputs positionally,
``(input_ids[, attention_mask[, token_type_ids]])`` for text models and
``(pixel_values,)`` for ViT and DeiT. An ``attention_mask`` ([batch, seq], 1 for tokens
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
from .decompose_checks import check_chain
from .decompose_shared import GUIDE, reference_forward
from .describe import evaluating
from .hf.layers import FOLLOWED
from .hf.layout import decoder_layout
from .hf.recipes import FAMILIES, RECIPES, Split

__all__ = ["split", "reference_forward"]

#: tokens per sample of the example the chain is checked on when none is given
EXAMPLE_TOKENS = 8


def split(
    model: nn.Module, example_inputs: tuple | None = None
) -> tuple[list[nn.Module], list[str]]:
    """The layers of a transformers ``model`` and their names: by its family's recipe,
    or by its layout (:mod:`.hf.layout`). Unless the model is on the meta device, the
    chain then runs once beside the model's own forward, in eval mode without
    autograd, on ``example_inputs`` (what the chain takes: see the module
    documentation) or on a small example of padded token ids or images; a layer
    that fails or an output that differs is an error."""
    kind = type(model).__name__
    if not FOLLOWED:
        raise HarmonyError(
            f"cannot split {kind}: the split follows the calling conventions "
            "of transformers 5, not those of the installed "
            f"{transformers.__version__}; upgrade it, or pass a list of blocks"
        )
    recipe = RECIPES.get(kind)
    chain = recipe(model, kind) if recipe is not None else decoder_layout(model)
    if chain is None:
        raise HarmonyError(
            f"{kind} from transformers cannot be split automatically: it is of none of the "
            f"families with a recipe ({FAMILIES}) and is not a decoder-only model "
            "with Llama's layout (a token embedding, a list of blocks its forward loops over, "
            "a final norm, an LM head). Pass a list of its blocks wrapped to follow the chain's "
            f"calling convention: {GUIDE}; decompose(blocks, reference=model, "
            "example_inputs=...) checks them against the model"
        )
    if not any(p.is_meta for p in model.parameters()):
        inputs = example_inputs if example_inputs is not None else _example(model, chain)
        _check(model, chain, inputs)
    return chain.layers, chain.names


def _example(model: nn.Module, chain: Split) -> tuple:
    """Two samples of what the chain takes: images, or token ids with the second
    sample's last tokens padded (drawn from a generator of their own)."""
    config = model.config
    weight = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    if chain.inputs == ("pixel_values",):
        size = config.image_size
        pixels = torch.randn(2, config.num_channels, size, size, generator=g)
        return (pixels.to(weight.device),)
    ids = torch.randint(2, config.vocab_size, (2, EXAMPLE_TOKENS), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return ids.to(weight.device), mask.to(weight.device)


def _check(model: nn.Module, chain: Split, inputs: tuple) -> None:
    """Run the chain and the model on the same inputs; raise where they part."""
    kind = type(model).__name__
    if len(inputs) > len(chain.inputs):
        raise HarmonyError(
            f"example_inputs has {len(inputs)} tensors but the chain of "
            f"{kind} takes at most {len(chain.inputs)}: {', '.join(chain.inputs)}"
        )
    with evaluating([model]):
        forward = reference_forward(model, inputs, chain.outputs)
        check_chain(chain.layers, chain.names, model, inputs, forward, kind)
