"""Per-family recipes: where each transformers family keeps its embeddings,
blocks, final norm and head, and which wrapper of :mod:`.layers` calls each
part. :data:`RECIPES` maps a model class name to its recipe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...errors import HarmonyError
from ..decompose_shared import HOW_TO
from .alibi import HFBloomBlock, HFFalconBlock
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


TEXT_INPUTS = ("input_ids", "attention_mask")
WAY_OUT = (
    "e.g. [embeddings, *blocks, head] with small wrappers that call each part as the "
    "model's forward does"
)


class Parts:
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
                    f"its family keeps it; {HOW_TO}, {WAY_OUT}"
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
    m = Parts(model, "transformer" if lm else "")
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
        TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _lm_split(model, m: Parts, lm: bool, first: list[str], layers: tuple) -> Split:
    """A decoder's split: token embeddings and the modules after them (``first``),
    the blocks (``layers``: the wrappers and their names), the final norm ``ln_f``
    and, where ``lm``, the LM head."""
    blocks, names = layers
    head = HFHead(
        ln_f=m.get("ln_f", "the final norm"),
        lm_head=m.get("lm_head", "the LM head", False) if lm else None,
    )
    return Split(
        [HFTokenEmbeddings(*(m.get(n, n) for n in first)), *blocks, head],
        [m.name(first), *names, m.name(["ln_f"], ("lm_head",) * lm)],
        TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _bloom(model, kind: str) -> Split:
    lm = kind == "BloomForCausalLM"
    m = Parts(model, "transformer" if lm else "")
    layers = m.blocks("h", lambda i, b: HFBloomBlock(b, m.config, False))
    return _lm_split(model, m, lm, ["word_embeddings", "word_embeddings_layernorm"], layers)


def _falcon(model, kind: str) -> Split:
    lm = kind == "FalconForCausalLM"
    m = Parts(model, "transformer" if lm else "")
    rotary = m.get("rotary_emb", "the rotary position embedding")
    layers = m.blocks("h", lambda i, b: HFFalconBlock(b, m.config, rotary))
    return _lm_split(model, m, lm, ["word_embeddings"], layers)


def _opt(model, kind: str) -> Split:
    lm = kind == "OPTForCausalLM"
    m = Parts(model, "model.decoder" if lm else "decoder")
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
        TEXT_INPUTS,
        ("logits",) if lm else ("last_hidden_state",),
        cache=True,
    )


def _encoder_head(model, m: Parts, kind: str, family: str) -> tuple[list, list, tuple]:
    """The layers after the blocks of a BERT-like model, their names and the outputs."""
    pooler = getattr(m.body, "pooler", None)
    if m.body is model and pooler is None:
        return [], [], ("last_hidden_state",)  # the last block ends the chain
    if m.body is model:
        return [HFPooledHead(pooler)], ["pooler"], ("last_hidden_state", "pooler_output")
    if kind == "BertForSequenceClassification":
        head = HFHead(
            pooler=m.get("pooler", "the pooler"),
            dropout=model.dropout,
            classifier=model.classifier,
        )
        return [head], [m.name(["pooler"], ("dropout", "classifier"))], ("logits",)
    # the masked-LM head, or the classification head on the whole sequence
    parts = {"bert": ("cls",), "roberta": ("lm_head",)}.get(family)
    if "LM" not in kind:
        parts = ("classifier",)
    elif parts is None:  # ELECTRA's generator
        parts = ("generator_predictions", "generator_lm_head")
    head = HFHead(**{p: m.get(p, "the head", False) for p in parts})
    return [head], ["+".join(parts)], ("logits",)


def _encoder(model, kind: str) -> Split:
    """BERT, RoBERTa and ELECTRA: the bare model, masked LM and sequence classification."""
    family = next(f for f in ("bert", "roberta", "electra") if kind.lower().startswith(f))
    m = Parts(model, "" if kind.endswith("Model") and "LM" not in kind else family)
    if getattr(m.config, "add_cross_attention", False):
        raise HarmonyError(
            f"cannot split {kind}: its blocks attend to encoder states "
            "(add_cross_attention), which a chain does not carry; "
            "pass a list of blocks"
        )
    layers, names = m.blocks("encoder.layer", lambda i, b: HFEncoderBlock(b, m.config, False))
    head, head_names, outputs = _encoder_head(model, m, kind, family)
    if not head:
        layers[-1].last = True
    project = getattr(m.body, "embeddings_project", None)  # ELECTRA's, where sizes differ
    embeddings = HFEncoderEmbeddings(m.get("embeddings", "the embeddings"), project)
    return Split(
        [embeddings, *layers, *head],
        [m.name(["embeddings", "embeddings_project"][: 1 + (project is not None)]), *names]
        + head_names,
        (*TEXT_INPUTS, "token_type_ids"),
        outputs,
    )


def _distilbert(model, kind: str) -> Split:
    """DistilBERT: the bare model, masked LM and sequence classification."""
    bare = kind == "DistilBertModel"
    m = Parts(model, "" if bare else "distilbert")
    layers, names = m.blocks("transformer.layer", lambda i, b: HFEncoderBlock(b, m.config, False))
    layers[-1].last = bare  # the bare model's last block ends the chain
    if kind == "DistilBertForMaskedLM":
        parts = ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector")
        layers.append(HFHead(**{p: m.get(p, "the head", False) for p in parts}))
        names.append("+".join(parts))
    elif not bare:  # the classifier on the first token
        layers.append(
            HFHead(
                first_token=FirstToken(),
                pre_classifier=model.pre_classifier,
                relu=nn.ReLU(),
                dropout=model.dropout,
                classifier=model.classifier,
            )
        )
        names.append("pre_classifier+dropout+classifier")
    embeddings = HFEncoderEmbeddings(m.get("embeddings", "the embeddings"), token_types=False)
    return Split(
        [embeddings, *layers],
        [m.name(["embeddings"]), *names],
        TEXT_INPUTS,
        ("logits",) if not bare else ("last_hidden_state",),
    )


def _vit(model, kind: str) -> Split:
    """ViT and DeiT: the bare model and image classification (on the first token)."""
    bare = kind.endswith("Model")
    m = Parts(model, "" if bare else kind[: kind.index("For")].lower())
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


def _family(recipe, families: tuple[str, ...], suffixes: tuple[str, ...]) -> dict:
    return {f"{family}{suffix}": recipe for family in families for suffix in suffixes}


#: the families with a recipe, as people name them
FAMILIES = "GPT-2, OPT, Bloom, Falcon, BERT, RoBERTa, ELECTRA, DistilBERT, ViT, DeiT"

#: the families whose forward the Llama layout does not describe, by class name
#: (the rest of the decoders: :func:`.layout.decoder_layout`)
RECIPES: dict[str, Callable[[nn.Module, str], Split]] = {
    **_family(_gpt2, ("GPT2",), ("Model", "LMHeadModel")),
    **_family(_opt, ("OPT",), ("Model", "ForCausalLM")),
    **_family(_bloom, ("Bloom",), ("Model", "ForCausalLM")),
    **_family(_falcon, ("Falcon",), ("Model", "ForCausalLM")),
    **_family(
        _encoder,
        ("Bert", "Roberta", "Electra"),
        ("Model", "ForMaskedLM", "ForSequenceClassification"),
    ),
    "BertLMHeadModel": _encoder,
    **_family(_distilbert, ("DistilBert",), ("Model", "ForMaskedLM", "ForSequenceClassification")),
    **_family(_vit, ("ViT", "DeiT"), ("Model", "ForImageClassification")),
}
