"""The blocks of Bloom and Falcon, whose forwards hand every block more than a mask:
ALiBi's per-head position bias (Bloom; Falcon with ``config.alibi``), built from
the padding mask with the model's own functions and, for Falcon, folded into a
materialized causal mask (see :mod:`harmony.engine.decompose_hf` for the calling
convention)."""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from .layers import _Block, create_causal_mask, make_mask


def _own(block: nn.Module, name: str):
    """A function of the module that defines ``block``'s class (the model's own code)."""
    return getattr(sys.modules[type(block).__module__], name)


class HFBloomBlock(_Block):
    """One ``BloomBlock`` as ``BloomModel.forward`` calls it, without a cache: the
    ALiBi tensor (from the slopes alone without a padding mask, from the mask with
    one) and the causal mask."""

    def forward(self, hidden_states, attention_mask=None):
        batch, seq = hidden_states.shape[:2]
        heads, dtype = self._config.n_head, hidden_states.dtype
        if attention_mask is None:
            slopes = _own(self.block, "_get_alibi_slopes")(heads, hidden_states.device)
            alibi = slopes[:, None, None] * torch.arange(seq, device=hidden_states.device)
            alibi = alibi.repeat(batch, 1, 1).to(dtype)
        else:
            alibi = _own(self.block, "build_alibi_tensor")(attention_mask, heads, dtype)
        mask = make_mask(create_causal_mask, self._config, hidden_states, attention_mask)
        out = self.block(
            hidden_states,
            attention_mask=mask,
            use_cache=False,
            output_attentions=False,
            alibi=alibi,
        )
        return self._result(out[0], attention_mask)


class HFFalconBlock(_Block):
    """One ``FalconDecoderLayer`` as ``FalconModel.forward`` calls it, without a
    cache: a materialized causal mask, the rotary cos/sin of the model's ``rotary``
    module and, with ``config.alibi``, the ALiBi bias folded into the mask."""

    def __init__(self, block: nn.Module, config, rotary: nn.Module):
        super().__init__(block, config, last=False)
        object.__setattr__(self, "_rotary", rotary)  # constants only, as HFBlock's

    def _alibi_mask(self, hidden_states, attention_mask, mask):
        """The ALiBi tensor and the causal mask with it folded in, as the forward does."""
        batch, seq = hidden_states.shape[:2]
        padding = attention_mask
        if padding is None:
            padding = torch.ones((batch, seq), device=hidden_states.device, dtype=torch.long)
        build = _own(self.block, "build_alibi_tensor")
        alibi = build(padding, self._config.num_attention_heads, dtype=hidden_states.dtype)
        if mask is None or mask.ndim != 4:
            return alibi, mask
        lowest = torch.finfo(hidden_states.dtype).min
        if mask.dtype == torch.bool:
            zero = torch.full((), 0.0, device=mask.device, dtype=hidden_states.dtype)
            mask = torch.where(mask, zero, lowest)
        alibi = alibi.reshape(batch, -1, *alibi.shape[1:])
        head_dim = self._config.hidden_size // self._config.num_attention_heads
        return alibi, torch.masked_fill(alibi / math.sqrt(head_dim), mask < -1, lowest)

    def forward(self, hidden_states, attention_mask=None):
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        mask = make_mask(
            create_causal_mask,
            self._config,
            hidden_states,
            attention_mask,
            position_ids=positions,
            allow_is_causal_skip=False,
        )
        alibi = None
        if self._config.alibi:
            alibi, mask = self._alibi_mask(hidden_states, attention_mask, mask)
        out = self.block(
            hidden_states,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            output_attentions=False,
            alibi=alibi,
            position_embeddings=self._rotary(hidden_states, position_ids=positions),
        )
        return self._result(out[0], attention_mask)
