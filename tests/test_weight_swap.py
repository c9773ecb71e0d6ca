"""WeightSlots runs a layer on other weights exactly as torch.func.functional_call
does: tied names share the one tensor given, buffers swap too, the module's own
tensors come back afterwards (also when the call raises), an unknown name is refused."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from harmony import HarmonyError
from harmony.engine.weight_swap import WeightSlots


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # one parameter under two names
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.b(self.a(x)))


def test_same_as_functional_call_with_ties_and_buffers():
    torch.manual_seed(0)
    layer = Tied()
    own = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    weights = {k: torch.randn_like(v) for k, v in layer.named_parameters()}
    weights |= {k: v.clone() for k, v in layer.named_buffers()}
    assert "b.weight" not in weights  # named once, under its first name
    x = torch.randn(8, 4)
    expected = functional_call(layer, {k: v.clone() for k, v in weights.items()}, (x,))
    got = WeightSlots(layer)(weights, (x,))
    assert torch.equal(got, expected)
    # the batch statistics went to the given buffers, and the module's own are back
    assert weights["norm.num_batches_tracked"].item() == 1
    assert all(torch.equal(own[k], v) for k, v in layer.state_dict().items())
    assert layer.b.weight is layer.a.weight


def test_own_tensors_come_back_when_the_call_raises_and_unknown_names_are_refused():
    layer = Tied()
    slots = WeightSlots(layer)
    params = dict(layer.named_parameters())
    with pytest.raises(RuntimeError):
        slots({"a.weight": torch.zeros(3, 3)}, (torch.randn(2, 4),))  # wrong shape
    assert dict(layer.named_parameters()) == params
    with pytest.raises(HarmonyError, match="no parameter or buffer 'c.weight'"):
        slots({"c.weight": torch.zeros(4, 4)}, (torch.randn(2, 4),))
    assert dict(layer.named_parameters()) == params
