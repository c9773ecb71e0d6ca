"""The layers a Hugging Face model becomes: wrappers that call the model's own
submodules as its ``forward`` (transformers 5) calls them. Embeddings, blocks
(which rebuild the masks, positions and rotary cos/sin the model's forward
computes once) and heads; see :mod:`harmony.engine.decompose_hf` for the
calling convention."""

from __future__ import annotations

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
