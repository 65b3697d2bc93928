"""Falcon (7B, 40B, 180B, Falcon 2): LayerNorms, one fused ``query_key_value`` projection
(multi-query, one KV head per several query heads in the new decoder architecture, or
one per query head: each KV head's queries, key and value side by side, as GPT-NeoX's),
rotary embeddings, attention and MLP in parallel (``parallel_attn``; the new decoder
architecture with a norm for each where ``num_ln_in_parallel_attn`` is 2) or one after
the other, biases where ``bias``. ALiBi (``alibi``, falcon-rw) is refused by name. Module
names mirror Hugging Face's ``FalconForCausalLM``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    LayerNorm,
    decoder_layers,
    held_part,
)
from pagedllm.plugins.models.gpt_neox import GroupedQKVAttention, NeoXMLP


def falcon_kv_heads(config: Any) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        heads, kv_heads = config.num_attention_heads, falcon_kv_heads(config)
        self.self_attention = GroupedQKVAttention(
            hidden, heads, kv_heads, config.bias, layer, None, quant, f"{prefix}.self_attention"
        )
        inner, act = config.ffn_hidden_size, config.activation
        self.mlp = NeoXMLP(hidden, inner, config.bias, act, quant, f"{prefix}.mlp")
        self.parallel = bool(config.parallel_attn or config.new_decoder_architecture)
        num_norms = config.num_ln_in_parallel_attn or (2 if config.new_decoder_architecture else 1)
        self.two_norms = self.parallel and num_norms == 2
        if self.two_norms:
            self.ln_attn = LayerNorm(hidden, eps)
            self.ln_mlp = LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        if self.two_norms:
            attn = self.self_attention(positions, self.ln_attn(hidden), rotary, metadata)
            return self.mlp(self.ln_mlp(hidden)) + attn + hidden
        normed = self.input_layernorm(hidden)
        attn = self.self_attention(positions, normed, rotary, metadata)
        if self.parallel:
            return self.mlp(normed) + attn + hidden
        hidden, normed = self.post_attention_layernorm.add_forward(attn, hidden)
        return self.mlp(normed) + hidden


class FalconModel(DecoderStack):
    def __init__(self, config: Any, quant: QuantizationConfig | None, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        stage = self.init_stage()
        self.word_embeddings = held_part(
            lambda: VocabEmbedding(config.vocab_size, hidden, quant, "transformer.word_embeddings"),
            stage.first,
        )
        self.h, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: FalconDecoderLayer(config, i, quant, f"transformer.h.{i}"),
        )
        self.ln_f = held_part(lambda: LayerNorm(hidden, config.layer_norm_epsilon), stage.last)
        head_dim = hidden // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)

    def embed(self, input_ids, positions) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def run_layer(self, layer, positions, hidden, metadata) -> torch.Tensor:
        return layer(positions, hidden, self.rotary_emb, metadata)

    def finish(self, hidden) -> torch.Tensor:
        return self.ln_f(hidden)


class FalconForCausalLM(CausalLM):
    supports_tensor_parallel = True
    split_sizes = ("ffn_hidden_size",)
    tie_by_default = True
    decoder_attr = "transformer"

    @classmethod
    def num_kv_heads(cls, config: Any) -> int:
        return falcon_kv_heads(config)

    def __init__(
        self,
        config: Any,
        quant_config: QuantizationConfig | None = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        if config.alibi:
            raise ConfigError("Falcon with alibi=True (ALiBi position biases) is not supported")
        if config.new_decoder_architecture and not config.parallel_attn:
            raise ConfigError(
                "Falcon with new_decoder_architecture and parallel_attn=False is not supported"
            )
        # The KV cache is sized from the config (num_key_value_heads), which Falcon's
        # does not name: its KV heads follow multi_query / num_kv_heads.
        config.num_key_value_heads = falcon_kv_heads(config)
        self.config = config
        max_positions = max_positions or config.max_position_embeddings
        self.transformer = FalconModel(config, quant_config, max_positions)
        self.init_head(config, self.transformer.word_embeddings, config.hidden_size, quant_config)
