"""Describing a chain for a GPU: each layer's forward over the minibatch run by a
copy of it on the GPU (``layer_inputs(run_on=)``), not by the host, which takes a
minute for a large model. Exercised here with the host itself as ``run_on``: the
same inputs and outputs, the layers untouched, and a layer that cannot be copied
run where it is."""

from __future__ import annotations

import threading

import torch
from torch import nn

from harmony.engine.describe import _device_to_run_on, layer_inputs


class Locked(nn.Linear):
    """A layer that cannot be deep-copied (it holds a lock)."""

    def __init__(self):
        super().__init__(8, 8)
        self.lock = threading.Lock()


def chain() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.GELU(), Locked(), nn.LayerNorm(8)]


def test_copies_run_elsewhere_give_the_layers_inputs_and_leave_the_layers_as_they_were():
    layers, x = chain(), (torch.randn(4, 8),)
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    params = [id(p) for layer in layers for p in layer.parameters()]
    here = layer_inputs(layers, x)
    there = layer_inputs(layers, x, run_on=torch.device("cpu"))
    assert len(here) == len(there) == len(layers) + 1
    for a, b in zip(here, there):
        assert all(torch.equal(s, t) and t.device.type == "cpu" for s, t in zip(a, b))
    after = [p for layer in layers for p in layer.parameters()]
    assert [id(p) for p in after] == params
    assert all(torch.equal(p, q) for p, q in zip(after, before))


def test_only_a_gpu_with_made_weights_runs_the_copies():
    layers = chain()
    assert _device_to_run_on(layers, torch.device("cpu")) is None
    assert _device_to_run_on(layers, torch.device("cuda:0")) == torch.device("cuda:0")
    with torch.device("meta"):
        unmade = [nn.Linear(8, 8)]
    assert _device_to_run_on(unmade, torch.device("cuda:0")) is None
