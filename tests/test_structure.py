"""Layers of one structure are described once (harmony.engine.structure): the key
tells apart what changes a layer's memory, and a description that shares
measurements between equal layers equals one that measures every layer."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import harmony
import harmony.engine.describe as describe_module
from harmony.engine.describe import describe, layer_inputs
from harmony.engine.structure import structure
from harmony.testing import random_model


class Heads(nn.Module):
    """A number the forward uses, kept as a plain attribute (not in the repr)."""

    def __init__(self, heads: int, layer_idx: int = 0):
        super().__init__()
        self.heads, self.layer_idx = heads, layer_idx
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).view(*x.shape[:-1], self.heads, -1).sum(-1)


def key(layer, x=None, last=False):
    return structure(layer, [(torch.zeros(4, 8) if x is None else x,)], last)


def test_equal_layers_share_a_key_whatever_their_weights_and_position():
    a, b = Heads(2, layer_idx=0), Heads(2, layer_idx=7)
    with torch.no_grad():
        b.proj.weight.mul_(3)
    assert key(a) == key(b)


@pytest.mark.parametrize(
    "other, why",
    [
        (lambda: Heads(4), "a plain attribute differs"),
        (lambda: Heads(2).train(False), "a training flag differs"),
        (lambda: Heads(2).double(), "a dtype differs"),
    ],
)
def test_what_changes_a_layers_cost_changes_its_key(other, why):
    assert key(Heads(2)) != key(other()), why


def test_the_input_shape_aliasing_and_the_loss_are_part_of_the_key():
    layer = Heads(2)
    x = torch.zeros(4, 8)
    assert key(layer, torch.zeros(2, 8)) != key(layer)
    assert key(layer, last=True) != key(layer)
    assert structure(layer, [(x, x)], False) != structure(layer, [(x, x.clone())], False)


def _per_layer(monkeypatch):
    """describe with no measurement shared between layers."""
    monkeypatch.setattr(describe_module, "structure", lambda layer, inputs, last: id(layer))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
@example(seed=156)  # attention blocks alike but for their number of heads, a plain attribute
def test_a_description_shared_between_equal_layers_is_the_per_layer_one(seed):
    model, inputs, target, loss = random_model(seed, 8)
    layers = list(harmony.decompose(model))
    shared = describe(layers, inputs, target, loss_fn=loss)
    with pytest.MonkeyPatch.context() as mp:
        _per_layer(mp)
        assert describe(layers, inputs, target, loss_fn=loss) == shared


def _llama(blocks: int) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_transformers_models_blocks_are_described_once(monkeypatch):
    """Llama's blocks differ only in ``layer_idx``: they share one key, and the
    description that measures one block for all four equals the per-layer one."""
    layers = list(harmony.decompose(_llama(4)))
    x = torch.randint(0, 64, (4, 16))
    acts = layer_inputs(layers, (x,))
    keys = [structure(layer, [acts[i]], i == len(layers) - 1) for i, layer in enumerate(layers)]
    assert sum(k == keys[1] for k in keys) == 4

    def loss(out, y):
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    shared = describe(layers, (x,), x, loss_fn=loss)
    _per_layer(monkeypatch)
    assert describe(layers, (x,), x, loss_fn=loss) == shared
