"""The layers a Hugging Face model becomes: wrappers that call the model's own
submodules as its ``forward`` (transformers 5) calls them. Embeddings, blocks
(which rebuild the masks, positions and rotary cos/sin the model's forward
computes once) and heads; see :mod:`harmony.engine.decompose_hf` for the
calling convention."""

from __future__ import annotations

import inspect

import torch
import transformers
from torch import nn

# The wrappers follow the calling conventions of transformers 5 (masking_utils,
# blocks that return a tensor); older releases call their blocks differently.
FOLLOWED = int(transformers.__version__.split(".")[0]) >= 5
if FOLLOWED:
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    # the cache argument of the mask functions: ``cache`` since 5.24 (``past_key_values``
    # before, which 5.40 no longer takes)
    _CACHE = (
        "cache"
        if "cache" in inspect.signature(create_causal_mask).parameters
        else ("past_key_values")
    )


def make_mask(make, config, hidden_states, attention_mask, **options):
    """The 4D mask ``make`` (a ``masking_utils`` function) builds from a padding mask,
    without a cache, as a model's forward builds it."""
    return make(
        config=config,
        inputs_embeds=hidden_states,
        attention_mask=attention_mask,
        **{_CACHE: None},
        **options,
    )


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
    """``embed(input_ids)``, then the modules the model's forward applies to it
    before the blocks, in order (a dropout, Bloom's LayerNorm): the start of
    every forward of the Llama layout."""

    def __init__(self, embed: nn.Module, *after: nn.Module):
        super().__init__()
        self.embed, self.after = embed, nn.ModuleList(after)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embed(input_ids)
        for module in self.after:
            hidden_states = module(hidden_states)
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
    position ids; token types all zero unless given as the third input, for a
    model that has them), then ``project`` where the model projects (ELECTRA)."""

    def __init__(
        self, embeddings: nn.Module, project: nn.Module | None = None, token_types: bool = True
    ):
        super().__init__()
        self.embeddings, self.project, self.token_types = embeddings, project, token_types

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if self.token_types:
            hidden_states = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        else:
            hidden_states = self.embeddings(input_ids)
        if self.project is not None:
            hidden_states = self.project(hidden_states)
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
    """One decoder block (GPT-2, and every block of the Llama layout) called as its
    model's forward calls it, without a cache: position ids ``0..seq-1``, the
    causal (``mask="causal"``) or sliding-window (``"sliding"``) mask from the
    padding mask (materialized where ``materialize``, as Falcon's forward asks),
    and, given the model's ``rotary`` module, its cos/sin. A block that returns a
    tuple hands on its first element. A block of experts (mixture of experts)
    says ``batch_dependent``: which tokens an expert computes together depends on
    how the minibatch is cut."""

    def __init__(
        self,
        block: nn.Module,
        config,
        mask: str = "causal",
        rotary: nn.Module | None = None,
        materialize: bool = False,
    ):
        super().__init__(block, config, last=False)
        self.mask, self.materialize = mask, materialize
        object.__setattr__(self, "_rotary", rotary)  # the model's own (see the module docs)
        if any(isinstance(getattr(m, "experts", None), nn.Module) for m in block.modules()):
            self.batch_dependent = (
                "mixture-of-experts routing: tokens meet in each expert's matmul"
            )

    def _arguments(self, hidden_states, attention_mask) -> dict:
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        make = create_sliding_window_causal_mask if self.mask == "sliding" else create_causal_mask
        options = {"allow_is_causal_skip": False} if self.materialize else {}
        mask = make_mask(
            make, self._config, hidden_states, attention_mask, position_ids=positions, **options
        )
        arguments = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
        if self._rotary is not None:
            arguments["position_embeddings"] = self._rotary(hidden_states, position_ids=positions)
        return arguments

    def forward(self, hidden_states, attention_mask=None):
        out = self.block(hidden_states, **self._arguments(hidden_states, attention_mask))
        return self._result(out[0] if isinstance(out, tuple) else out, attention_mask)


class HFOPTBlock(HFBlock):
    """One ``OPTDecoderLayer``: the causal mask is built without position ids, and
    the layer gets OPT's positions (counted over the non-padding tokens)."""

    def _arguments(self, hidden_states, attention_mask) -> dict:
        mask = make_mask(create_causal_mask, self._config, hidden_states, attention_mask)
        position_ids, _ = _opt_positions(hidden_states, attention_mask)
        return {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}


class HFEncoderBlock(_Block):
    """One encoder block (BERT, RoBERTa, ELECTRA, DistilBERT, ViT, DeiT) called as the
    encoder calls it, with the bidirectional padding mask (causal where
    ``config.is_decoder``)."""

    def forward(self, hidden_states, attention_mask=None):
        if getattr(self._config, "is_decoder", False):
            mask = make_mask(create_causal_mask, self._config, hidden_states, attention_mask)
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


class Softcap(nn.Module):
    """``cap * tanh(logits / cap)``: Gemma 2's final logit softcapping, as its forward
    computes it."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, logits):
        return torch.tanh(logits / self.cap) * self.cap


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
