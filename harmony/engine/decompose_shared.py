"""What the decompose modules (:mod:`.decompose`, :mod:`.decompose_checks`,
:mod:`.decompose_hf`, :mod:`.hf`) share, below all of them: where the chain's
calling convention is written down, and the call of a transformers model's own
forward that a chain is checked against. It imports none of them."""

from __future__ import annotations

import inspect

from torch import nn

#: where the README defines the calling convention and shows a wrapper end to end
GUIDE = "README.md, section 'Your own blocks: the calling convention'"

#: what to pass instead of a model that cannot be split, for the errors that say so
HOW_TO = (
    "pass an nn.Sequential or a list of modules (blocks) "
    f"that follow the chain's calling convention ({GUIDE})"
)


def reference_forward(model: nn.Module, inputs: tuple, outputs: tuple[str, ...] | None = None):
    """A call of transformers ``model``'s own forward on what a chain takes (by name,
    without a cache) returning what the chain's last layer returns: the ``outputs``
    fields, else the logits or the last hidden state."""
    parameters = inspect.signature(model.forward).parameters
    names = (
        ("pixel_values",)
        if "pixel_values" in parameters
        else ("input_ids", "attention_mask", "token_type_ids")
    )
    extra = {"use_cache": False} if "use_cache" in parameters else {}

    def forward():
        out = model(**dict(zip(names, inputs)), **extra)
        fields = outputs or (("logits",) if "logits" in out else ("last_hidden_state",))
        found = tuple(getattr(out, name) for name in fields)
        return found if len(found) > 1 else found[0]

    return forward
