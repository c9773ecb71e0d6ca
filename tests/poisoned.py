"""A layer whose gradient turns NaN on demand, for the tests of failed steps."""

from __future__ import annotations

import torch
from torch import nn


class Poison(torch.autograd.Function):
    """Identity whose gradient is NaN while ``Poison.on``."""

    on = False

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan") if Poison.on else g


class Scale(nn.Module):
    """``x * w``, ``w`` a parameter of ones whose gradient is NaN while ``Poison.on``."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * Poison.apply(self.w)
