"""A layer run on weights other than its own, as ``torch.func.functional_call``
runs it, with the module's parameter and buffer slots looked up once.

``functional_call`` walks the module's names and checks them on every call:
about 0.3 ms for a transformer block on a CPU, several percent of a step that
runs every layer once per microbatch. :class:`WeightSlots` finds, once, the
dictionary entry (``_parameters`` or ``_buffers`` of the submodule that owns
it) behind every name, and a call swaps the given tensors into those entries
and puts the module's own back afterwards, as ``functional_call`` does. A
tensor a module holds under several names (tied weights) is given once, under
its first name, and lands under all of them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HarmonyError


class WeightSlots:
    """Where each parameter and buffer of ``module`` lives, by its first name."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.slots: dict[str, list[tuple[dict, str]]] = {}
        first: dict[int, str] = {}
        for kind, named in (
            ("_parameters", module.named_parameters(remove_duplicate=False)),
            ("_buffers", module.named_buffers(remove_duplicate=False)),
        ):
            for name, t in named:
                owner_name, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                key = first.setdefault(id(t), name)
                self.slots.setdefault(key, []).append((getattr(owner, kind), attr))

    def __call__(self, weights: dict[str, torch.Tensor], args: tuple):
        """``module(*args)`` with ``weights`` (name -> tensor) in place of its own."""
        swapped: list[tuple[dict, str, object]] = []
        try:
            for name, t in weights.items():
                slots = self.slots.get(name)
                if slots is None:
                    raise HarmonyError(
                        f"{type(self.module).__name__} has no parameter or buffer {name!r}"
                    )
                for entries, attr in slots:
                    swapped.append((entries, attr, entries[attr]))
                    entries[attr] = t
            return self.module(*args)
        finally:
            for entries, attr, own in reversed(swapped):
                entries[attr] = own
