"""Gemma 2: Gemma 3's layers (``gemma3.py``) without q/k norms, with one RoPE table for
every layer and attention scores soft-capped at ``attn_logit_softcapping`` (50 in the
released models), which the attention backends compute. Module names mirror Hugging
Face's ``Gemma2ForCausalLM``."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.plugins.models.gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3Model,
)


class Gemma2Attention(Gemma3Attention):
    qk_norm = False
    soft_cap = True


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_cls = Gemma2Attention


class Gemma2Model(Gemma3Model):
    layer_cls = Gemma2DecoderLayer

    def rotary_tables(self, config: Any, max_positions: int) -> nn.ModuleDict:
        """One table (Gemma 2's RoPE parameters are not per layer type), shared."""
        rotary = RotaryEmbedding(config, config.head_dim, max_positions)
        return nn.ModuleDict({kind: rotary for kind in sorted(set(config.layer_types))})


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    model_cls = Gemma2Model
    supports_tensor_parallel = True
