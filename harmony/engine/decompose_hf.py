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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from ..errors import HarmonyError
from .decompose import _HOW_TO, _evaluating

# The wrappers follow the calling conventions of transformers 5 (masking_utils,
# blocks that return a tensor); older releases call their blocks differently.
_FOLLOWED = int(transformers.__version__.split(".")[0]) >= 5
if _FOLLOWED:
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

__all__ = ["split"]


def _carry(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None):
    """What a layer hands the next one: the hidden states, with the mask if there is one."""
    return hidden_states if attention_mask is None else (hidden_states, attention_mask)


def _dropout_in(config) -> bool:
    """Whether any dropout probability in ``config`` is positive. Deliberately broad
    (a classifier's dropout counts too): marking a block that draws nothing costs the
    engine only a lock, missing one that draws would break exactness on several GPUs."""
    return any(
        isinstance(v, float) and v > 0
        for k, v in config.to_dict().items()
        if "dropout" in k or "pdrop" in k
    )


# ---- embeddings ---------------------------------------------------------------
class HFTokenEmbeddings(nn.Module):
    """``embed(input_ids)``, then ``dropout`` where the model has one (GPT-NeoX):
    the start of the Llama, Mistral, Qwen2 and GPT-NeoX forwards."""

    def __init__(self, embed: nn.Embedding, dropout: nn.Module | None = None):
        super().__init__()
        self.embed, self.dropout = embed, dropout

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embed(input_ids)
        if self.dropout is not None:
            hidden_states = self.dropout(hidden_states)
        return _carry(hidden_states, attention_mask)


class HFGPT2Embeddings(nn.Module):
    """Token plus position embeddings, then dropout, as ``GPT2Model.forward``
    computes them (no cache, no position ids, no token types)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids, attention_mask=None):
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        inputs_embeds = self.wte(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        position_ids = position_ids.unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(input_ids.shape[0], -1)
        return _carry(self.drop(hidden_states), attention_mask)


def _opt_positions(hidden_states, attention_mask):
    """OPT's position ids and the mask they come from: positions count the tokens
    that are not padding (the decoder's forward, without a cache)."""
    mask = attention_mask
    if mask is None:
        mask = torch.ones(*hidden_states.shape[:2], device=hidden_states.device)
    positions = torch.cumsum(mask, dim=1)
    return (positions * mask - 1).long(), mask


class HFOPTEmbeddings(nn.Module):
    """Token embeddings (projected in where the model projects) plus learned
    positions counted over the non-padding tokens, as ``OPTDecoder.forward``."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.embed_tokens, self.embed_positions = decoder.embed_tokens, decoder.embed_positions
        self.project_in = decoder.project_in

    def forward(self, input_ids, attention_mask=None):
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        inputs_embeds = self.embed_tokens(input_ids)
        position_ids, position_mask = _opt_positions(inputs_embeds, attention_mask)
        pos_embeds = self.embed_positions(position_mask, 0, position_ids=position_ids)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        return _carry(inputs_embeds + pos_embeds.to(inputs_embeds.device), attention_mask)


class HFEncoderEmbeddings(nn.Module):
    """A BERT-style embeddings module called as the model calls it (its own
    position ids; token types all zero unless given as the third input)."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        hidden_states = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return _carry(hidden_states, attention_mask)


class HFViTEmbeddings(nn.Module):
    """Patch embeddings, class token, positions and dropout, as ``ViTModel.forward``."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, pixel_values):
        dtype = self.embeddings.patch_embeddings.projection.weight.dtype
        if pixel_values.dtype != dtype:
            pixel_values = pixel_values.to(dtype)
        return self.embeddings(pixel_values, bool_masked_pos=None, interpolate_pos_encoding=None)


# ---- blocks -------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, block: nn.Module, config, last: bool):
        super().__init__()
        self.block = block
        object.__setattr__(self, "_config", config)  # not a module, not saved
        self.last = last  # the chain's last layer: the mask ends here
        self.draws_random = _dropout_in(config)

    def _result(self, hidden_states, attention_mask):
        return hidden_states if self.last else _carry(hidden_states, attention_mask)


class HFBlock(_Block):
    """One decoder block (GPT-2, Llama, Mistral, Qwen2, GPT-NeoX) called as its
    model's forward calls it, without a cache: position ids ``0..seq-1``, the
    causal (``mask="causal"``) or sliding-window (``"sliding"``) mask from the
    padding mask, and, given the model's ``rotary`` module, its cos/sin."""

    def __init__(
        self, block: nn.Module, config, mask: str = "causal", rotary: nn.Module | None = None
    ):
        super().__init__(block, config, last=False)
        self.mask = mask
        object.__setattr__(self, "_rotary", rotary)  # the model's own (see the module docs)

    def _arguments(self, hidden_states, attention_mask) -> dict:
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        make = create_sliding_window_causal_mask if self.mask == "sliding" else create_causal_mask
        mask = make(
            config=self._config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        arguments = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
        if self._rotary is not None:
            arguments["position_embeddings"] = self._rotary(hidden_states, position_ids=positions)
        return arguments

    def forward(self, hidden_states, attention_mask=None):
        out = self.block(hidden_states, **self._arguments(hidden_states, attention_mask))
        return self._result(out, attention_mask)


class HFOPTBlock(HFBlock):
    """One ``OPTDecoderLayer``: the causal mask is built without position ids, and
    the layer gets OPT's positions (counted over the non-padding tokens)."""

    def _arguments(self, hidden_states, attention_mask) -> dict:
        mask = create_causal_mask(
            config=self._config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            past_key_values=None,
        )
        position_ids, _ = _opt_positions(hidden_states, attention_mask)
        return {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}


class HFEncoderBlock(_Block):
    """One encoder block (BERT, RoBERTa, ViT) called as the encoder calls it, with
    the bidirectional padding mask (causal where ``config.is_decoder``)."""

    def forward(self, hidden_states, attention_mask=None):
        if getattr(self._config, "is_decoder", False):
            mask = create_causal_mask(
                config=self._config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                past_key_values=None,
            )
        else:
            mask = create_bidirectional_mask(
                config=self._config, inputs_embeds=hidden_states, attention_mask=attention_mask
            )
        return self._result(self.block(hidden_states, mask), attention_mask)


# ---- heads --------------------------------------------------------------------
class FirstToken(nn.Module):
    """The hidden state of the first token (``[:, 0, :]``), as classification heads take it."""

    def forward(self, hidden_states):
        return hidden_states[:, 0, :]


class HFHead(nn.Module):
    """The modules after the last block, applied in the order given (``None`` ones
    skipped), under the names given; the attention mask ends here."""

    def __init__(self, **steps: nn.Module | None):
        super().__init__()
        for name, module in steps.items():
            if module is not None:
                self.add_module(name, module)

    def forward(self, hidden_states, attention_mask=None):
        for module in self.children():
            hidden_states = module(hidden_states)
        return hidden_states


class HFPooledHead(nn.Module):
    """A bare model's end with a pooler: ``(last_hidden_state, pooler_output)``,
    after the final ``norm`` where the model has one (ViT)."""

    def __init__(self, pooler: nn.Module, norm: nn.Module | None = None):
        super().__init__()
        self.norm, self.pooler = norm, pooler

    def forward(self, hidden_states, attention_mask=None):
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        return hidden_states, self.pooler(hidden_states)


# ---- recipes ------------------------------------------------------------------
@dataclass
class _Split:
    """A model's chain, the names of the model's forward arguments that the chain's
    inputs are, and the fields of the model's output that the chain returns."""

    layers: list[nn.Module]
    names: list[str]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache: bool = False  # the forward takes use_cache (decoders: the chain runs without a cache)


_TEXT_INPUTS = ("input_ids", "attention_mask")
_WAY_OUT = (
    "e.g. [embeddings, *blocks, head] with small wrappers that call each part as the "
    "model's forward does"
)


class _Parts:
    """A model and its base model (``body``: where the blocks are, at ``path``),
    with lookups that fail naming the model and the part it lacks."""

    def __init__(self, model: nn.Module, path: str = ""):
        self.model, self.kind = model, type(model).__name__
        self.body = self.get(path, "the base model", in_body=False)
        self.prefix = f"{path}." if path else ""
        self.config = self.body.config

    def get(self, path: str, what: str, in_body: bool = True) -> nn.Module:
        """The submodule at ``path`` in the body (or in the model)."""
        found = self.body if in_body else self.model
        for attr in path.split(".") if path else ():
            found = getattr(found, attr, None)
            if found is None:
                shown = self.prefix + path if in_body else path
                raise HarmonyError(
                    f"cannot split {self.kind}: it has no {shown} ({what}) where "
                    f"its family keeps it; {_HOW_TO}, {_WAY_OUT}"
                )
        return found

    def blocks(self, path: str, make: Callable[[int, nn.Module], nn.Module]):
        """A layer per block the forward runs (the first num_hidden_layers), and their names."""
        blocks = list(self.get(path, "the list of blocks"))[: self.config.num_hidden_layers]
        if not blocks:
            raise HarmonyError(f"cannot split {self.kind}: {self.prefix}{path} holds no blocks")
        names = [f"{self.prefix}{path}.{i}" for i in range(len(blocks))]
        return [make(i, b) for i, b in enumerate(blocks)], names

    def name(self, parts: list[str], model_parts: tuple[str, ...] = ()) -> str:
        """A layer's name: the body's parts it calls (prefix written once), then the model's."""
        return "+".join([self.prefix + "+".join(parts)] * bool(parts) + list(model_parts))


def _gpt2(model, kind: str) -> _Split:
    lm = kind == "GPT2LMHeadModel"
    m = _Parts(model, "transformer" if lm else "")
    blocks, names = m.blocks("h", lambda i, b: HFBlock(b, m.config))
    embeddings = HFGPT2Embeddings(
        m.get("wte", "the token embedding"),
        m.get("wpe", "the positions"),
        m.get("drop", "the dropout"),
    )
    head = HFHead(
        ln_f=m.get("ln_f", "the final norm"),
        lm_head=m.get("lm_head", "the LM head", False) if lm else None,
    )
    return _Split(
        [embeddings, *blocks, head],
        [m.name(["wte", "wpe", "drop"]), *names, m.name(["ln_f"], ("lm_head",) * lm)],
        _TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _rotary_decoder(model, kind: str) -> _Split:
    """Llama, Mistral, Qwen2 (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)
    and GPT-NeoX (``embed_in``, ``emb_dropout``, ``layers``, ``final_layer_norm``)."""
    lm, neox = kind.endswith("ForCausalLM"), kind.startswith("GPTNeoX")
    m = _Parts(model, ("gpt_neox" if neox else "model") if lm else "")
    config, rotary = m.config, m.get("rotary_emb", "the rotary position embedding")

    def mask(i: int) -> str:  # the mask the model's forward gives block i
        if kind.startswith("Mistral"):
            return "causal" if config.sliding_window is None else "sliding"
        if kind.startswith("Qwen2"):
            return "sliding" if config.layer_types[i] == "sliding_attention" else "causal"
        return "causal"

    blocks, names = m.blocks("layers", lambda i, b: HFBlock(b, config, mask(i), rotary))
    if neox:
        embeddings = HFTokenEmbeddings(
            m.get("embed_in", "the token embedding"), m.get("emb_dropout", "the embedding dropout")
        )
        first, norm_name = ["embed_in", "emb_dropout"], "final_layer_norm"
    else:
        embeddings = HFTokenEmbeddings(m.get("embed_tokens", "the token embedding"))
        first, norm_name = ["embed_tokens"], "norm"
    head = HFHead(
        norm=m.get(norm_name, "the final norm"),
        lm_head=m.get("lm_head", "the LM head", False) if lm else None,
    )
    return _Split(
        [embeddings, *blocks, head],
        [m.name(first), *names, m.name([norm_name], ("lm_head",) * lm)],
        _TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _opt(model, kind: str) -> _Split:
    lm = kind == "OPTForCausalLM"
    m = _Parts(model, "model.decoder" if lm else "decoder")
    decoder = m.body
    if decoder.layerdrop > 0:
        raise HarmonyError(
            f"cannot split {kind}: {m.prefix}forward skips blocks at random while training "
            f"(config.layerdrop={decoder.layerdrop}), which no chain of layers can do; "
            "set config.layerdrop = 0, or pass a list of blocks"
        )
    blocks, names = m.blocks("layers", lambda i, b: HFOPTBlock(b, m.config))
    head = HFHead(
        final_layer_norm=decoder.final_layer_norm,
        project_out=decoder.project_out,
        lm_head=m.get("lm_head", "the LM head", False) if lm else None,
    )

    def present(*parts: str) -> list[str]:
        return [p for p in parts if getattr(decoder, p) is not None]

    return _Split(
        [HFOPTEmbeddings(decoder), *blocks, head],
        [
            m.name(present("embed_tokens", "embed_positions", "project_in")),
            *names,
            m.name(present("final_layer_norm", "project_out"), ("lm_head",) * lm),
        ],
        _TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _encoder(model, kind: str) -> _Split:
    """BERT and RoBERTa: the bare model, masked LM and sequence classification."""
    family = "bert" if kind.startswith("Bert") else "roberta"
    bare = kind in ("BertModel", "RobertaModel")
    m = _Parts(model, "" if bare else family)
    if getattr(m.config, "add_cross_attention", False):
        raise HarmonyError(
            f"cannot split {kind}: its blocks attend to encoder states "
            "(add_cross_attention), which a chain does not carry; "
            "pass a list of blocks"
        )
    layers, names = m.blocks("encoder.layer", lambda i, b: HFEncoderBlock(b, m.config, False))
    outputs: tuple[str, ...] = ("logits",)
    if bare and m.body.pooler is None:
        layers[-1].last = True  # the last block ends the chain
        outputs = ("last_hidden_state",)
    elif bare:
        layers.append(HFPooledHead(m.body.pooler))
        names.append("pooler")
        outputs = ("last_hidden_state", "pooler_output")
    elif kind == "BertForSequenceClassification":
        layers.append(
            HFHead(
                pooler=m.get("pooler", "the pooler"),
                dropout=model.dropout,
                classifier=model.classifier,
            )
        )
        names.append(m.name(["pooler"], ("dropout", "classifier")))
    else:  # the masked-LM head, or RoBERTa's classification head (on the whole sequence)
        head = ("cls" if family == "bert" else "lm_head") if "LM" in kind else "classifier"
        layers.append(HFHead(**{head: m.get(head, "the head", False)}))
        names.append(head)
    return _Split(
        [HFEncoderEmbeddings(m.get("embeddings", "the embeddings")), *layers],
        [m.name(["embeddings"]), *names],
        (*_TEXT_INPUTS, "token_type_ids"),
        outputs,
    )


def _vit(model, kind: str) -> _Split:
    bare = kind == "ViTModel"
    m = _Parts(model, "" if bare else "vit")
    blocks, names = m.blocks("layers", lambda i, b: HFEncoderBlock(b, m.config, False))
    norm = m.get("layernorm", "the final norm")
    if not bare:
        head = HFHead(
            layernorm=norm,
            first_token=FirstToken(),
            classifier=m.get("classifier", "the classifier", False),
        )
        name, outputs = m.name(["layernorm"], ("classifier",)), ("logits",)
    elif m.body.pooler is not None:
        head, name = HFPooledHead(m.body.pooler, norm), "layernorm+pooler"
        outputs = ("last_hidden_state", "pooler_output")
    else:
        head, name, outputs = HFHead(layernorm=norm), "layernorm", ("last_hidden_state",)
    return _Split(
        [HFViTEmbeddings(m.get("embeddings", "the embeddings")), *blocks, head],
        [m.name(["embeddings"]), *names, name],
        ("pixel_values",),
        outputs,
    )


_RECIPES: dict[str, Callable[[nn.Module, str], _Split]] = {
    "GPT2Model": _gpt2,
    "GPT2LMHeadModel": _gpt2,
    **{
        f"{family}{suffix}": _rotary_decoder
        for family in ("Llama", "Mistral", "Qwen2", "GPTNeoX")
        for suffix in ("Model", "ForCausalLM")
    },
    "OPTModel": _opt,
    "OPTForCausalLM": _opt,
    **{
        f"{family}{suffix}": _encoder
        for family in ("Bert", "Roberta")
        for suffix in ("Model", "ForMaskedLM", "ForSequenceClassification")
    },
    "BertLMHeadModel": _encoder,
    "ViTModel": _vit,
    "ViTForImageClassification": _vit,
}


def split(
    model: nn.Module, example_inputs: tuple | None = None
) -> tuple[list[nn.Module], list[str]]:
    """The layers of a supported transformers ``model`` and their names. With
    ``example_inputs`` (what the chain takes: see the module documentation), the
    chain runs once beside the model's own forward, in eval mode without autograd,
    and a layer that fails or an output that differs is reported."""
    kind = type(model).__name__
    recipe = _RECIPES.get(kind)
    if recipe is None:
        raise HarmonyError(
            f"{kind} from transformers cannot be split automatically (supported: "
            f"{', '.join(_RECIPES)}); {_HOW_TO}, {_WAY_OUT}"
        )
    if not _FOLLOWED:
        raise HarmonyError(
            f"cannot split {kind}: the split follows the calling conventions "
            "of transformers 5, not those of the installed "
            f"{transformers.__version__}; upgrade it, or pass a list of blocks"
        )
    chain = recipe(model, kind)
    if example_inputs is not None and not any(p.is_meta for p in model.parameters()):
        _check(model, chain, example_inputs)
    return chain.layers, chain.names


def _check(model: nn.Module, chain: _Split, example_inputs: tuple) -> None:
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
