"""Decoder-only models with Llama's layout, recognised by their modules and by
what their forward does, whatever their class: a token embedding, the modules the
forward applies to it (dropout), a list of decoder blocks run in a loop, a final
norm, the LM head (with Gemma 2's logit softcapping where the forward applies
it), and rotary embeddings computed once by the base model (or per block, inside
the attention). Llama, Mistral, Mixtral, Qwen2, Qwen3, Phi, Gemma, Gemma 2,
StableLM, GPT-NeoX and GPT-J have it.

The forward's source says which of the base model's children it calls, in which
order, and which mask each block gets; a model whose forward calls anything else
(a method of its own, a module of no known role) is not of this layout. What the
source cannot show (arithmetic between the calls) the check of
:func:`harmony.engine.decompose_hf.split` finds: the chain runs beside the
model's forward before it is used."""

from __future__ import annotations

import inspect
import re

from torch import nn

from .layers import HFBlock, HFHead, HFTokenEmbeddings, Softcap
from .recipes import TEXT_INPUTS, Parts, Split

_CALL = re.compile(r"self\.(\w+)\(")
_LOOP = re.compile(r"for [^\n]*? in [^\n]*?self\.(\w+)")
_NORMS = (nn.LayerNorm, nn.RMSNorm)


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORMS) or type(module).__name__.endswith(("Norm", "LayerNorm"))


def _is_rotary(module: nn.Module) -> bool:
    return "Rotary" in type(module).__name__ or hasattr(module, "inv_freq")


class _Roles:
    """The base model's children its forward calls, by role (None: not the layout)."""

    def __init__(self, body: nn.Module, source: str):
        loop = _LOOP.search(source)
        children = dict(body.named_children())
        self.ok = loop is not None and isinstance(children.get(loop.group(1)), nn.ModuleList)
        if not self.ok:
            return
        self.blocks, self.before, self.after = loop.group(1), [], []
        self.embed, self.rotary, self.missing = None, None, None
        embedding = body.get_input_embeddings()
        for match in _CALL.finditer(source):
            name = match.group(1)
            module = children.get(name)
            if module is None:  # a method of the model's own (another layout), or a lost part
                self.ok = False
                if not hasattr(body, name):
                    self.missing = self.missing or name
            elif module is embedding:
                self.embed = self.embed or name
            elif _is_rotary(module):
                self.rotary = name
            elif match.start() < loop.start() and isinstance(module, nn.Dropout):
                self.before.append(name)
            elif match.start() > loop.start() and _is_norm(module):
                self.after.append(name)
            else:
                self.ok = False
        self.ok = self.ok and self.embed is not None and len(self.after) == 1


def _masks(config, source: str, count: int) -> list[str] | None:
    """The mask kind the forward gives each block, None where one is of no known kind."""
    if "layer_types" in source:
        kinds = {"full_attention": "causal", "sliding_attention": "sliding"}
        found = [kinds.get(t) for t in config.layer_types[:count]]
        return None if None in found else found
    if "create_sliding_window_causal_mask" in source:
        return ["causal" if config.sliding_window is None else "sliding"] * count
    return ["causal"] * count if "create_causal_mask" in source else None


def _head(model: nn.Module, m: Parts) -> tuple[dict, tuple[str, ...]] | None:
    """The LM head's steps and their names, None where the model has another head."""
    if m.body is model:
        return {}, ()
    head = model.get_output_embeddings()
    names = [n for n, c in model.named_children() if c is head]
    rest = [c for c in model.children() if c is not head and c is not m.body]
    source = _source(type(model).forward)
    if not names or rest or f"self.{names[0]}(" not in source:
        return None
    steps = {names[0]: head}
    cap = getattr(m.config, "final_logit_softcapping", None)
    if cap is not None and "final_logit_softcapping" in source:
        steps["softcap"] = Softcap(cap)
    return steps, (names[0],)


def decoder_layout(model: nn.Module) -> Split | None:
    """The chain of ``model`` if it has Llama's layout (see the module docs), else None."""
    body = getattr(model, "base_model", None)
    if body is None or not hasattr(body, "get_input_embeddings"):
        return None
    source = _source(type(body).forward)
    roles = _Roles(body, source)
    prefix = "" if body is model else model.base_model_prefix
    m = Parts(model, prefix)
    if roles.missing:  # raises, naming it
        m.get(roles.missing, "a module its forward calls")
    if not roles.ok:
        return None
    head = _head(model, m)
    count = min(len(getattr(body, roles.blocks)), m.config.num_hidden_layers)
    masks = _masks(m.config, source, count)
    if head is None or masks is None:
        return None
    rotary = getattr(body, roles.rotary) if roles.rotary else None
    materialize = "allow_is_causal_skip=False" in source

    def block(i: int, b: nn.Module) -> nn.Module:
        return HFBlock(b, m.config, masks[i], rotary, materialize)

    blocks, names = m.blocks(roles.blocks, block)
    first = [roles.embed, *roles.before]
    steps, head_names = head
    norm = roles.after[0]
    return Split(
        [
            HFTokenEmbeddings(*(m.get(n, n) for n in first)),
            *blocks,
            HFHead(**{norm: m.get(norm, "the final norm")}, **steps),
        ],
        [m.name(first), *names, m.name([norm], head_names)],
        TEXT_INPUTS,
        ("logits",) if head_names else ("last_hidden_state",),
        cache="use_cache" in inspect.signature(model.forward).parameters,
    )
