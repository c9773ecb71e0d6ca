"""Per-family recipes: where each transformers family keeps its embeddings,
blocks, final norm and head, and which wrapper of :mod:`.layers` calls each
part. :data:`RECIPES` maps a model class name to its recipe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...errors import HarmonyError
from ..decompose import _HOW_TO
from .layers import (
    FirstToken,
    HFBlock,
    HFEncoderBlock,
    HFEncoderEmbeddings,
    HFGPT2Embeddings,
    HFHead,
    HFOPTBlock,
    HFOPTEmbeddings,
    HFPooledHead,
    HFTokenEmbeddings,
    HFViTEmbeddings,
)


@dataclass
class Split:
    """A model's chain, the names of the model's forward arguments that the chain's
    inputs are, and the fields of the model's output that the chain returns."""

    layers: list[nn.Module]
    names: list[str]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache: bool = False  # the forward takes use_cache (decoders: the chain runs without a cache)


_TEXT_INPUTS = ("input_ids", "attention_mask")
WAY_OUT = (
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
                    f"its family keeps it; {_HOW_TO}, {WAY_OUT}"
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


def _gpt2(model, kind: str) -> Split:
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
    return Split(
        [embeddings, *blocks, head],
        [m.name(["wte", "wpe", "drop"]), *names, m.name(["ln_f"], ("lm_head",) * lm)],
        _TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _rotary_decoder(model, kind: str) -> Split:
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
    return Split(
        [embeddings, *blocks, head],
        [m.name(first), *names, m.name([norm_name], ("lm_head",) * lm)],
        _TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _opt(model, kind: str) -> Split:
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

    return Split(
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


def _encoder(model, kind: str) -> Split:
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
    return Split(
        [HFEncoderEmbeddings(m.get("embeddings", "the embeddings")), *layers],
        [m.name(["embeddings"]), *names],
        (*_TEXT_INPUTS, "token_type_ids"),
        outputs,
    )


def _vit(model, kind: str) -> Split:
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
    return Split(
        [HFViTEmbeddings(m.get("embeddings", "the embeddings")), *blocks, head],
        [m.name(["embeddings"]), *names, name],
        ("pixel_values",),
        outputs,
    )


RECIPES: dict[str, Callable[[nn.Module, str], Split]] = {
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
