"""Phi-3 (and Phi-4-mini): Llama-like, with fused ``qkv_proj`` and ``gate_up_proj``
weights, an optional partial rotary dimension and sliding window. Module names mirror
Hugging Face's ``Phi3ForCausalLM``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention, AttentionMetadata
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.plugins.models.common import CausalLM, RMSNorm, activation, layer_sliding_windows


class Phi3Attention(nn.Module):
    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, False, quant, f"{prefix}.qkv_proj"
        )
        self.o_proj = Linear(self.q_size, hidden, False, quant, f"{prefix}.o_proj")
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer, window
        )

    def forward(self, positions, hidden, rotary: RotaryEmbedding, metadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata)
        return self.o_proj(out)


class Phi3MLP(nn.Module):
    def __init__(self, config: Any, quant, prefix: str) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * inter, False, quant, f"{prefix}.gate_up_proj")
        self.down_proj = Linear(inter, hidden, False, quant, f"{prefix}.down_proj")
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act_fn(gate))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        self.self_attn = Phi3Attention(config, layer, window, quant, f"{prefix}.self_attn")
        self.mlp = Phi3MLP(config, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), rotary, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Phi3Model(nn.Module):
    def __init__(self, config: Any, quant, max_positions: int, disable_sliding_window: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant, "model.embed_tokens"
        )
        windows = layer_sliding_windows(config, disable_sliding_window)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(config, i, windows[i], quant, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)

    def forward(self, input_ids, positions, metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary_emb, metadata)
        return self.norm(hidden)


class Phi3ForCausalLM(CausalLM):
    def __init__(
        self,
        config: Any,
        quant_config: QuantizationConfig | None = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        max_positions = max_positions or config.max_position_embeddings
        self.model = Phi3Model(config, quant_config, max_positions, disable_sliding_window)
        self.init_head(config, self.model.embed_tokens, config.hidden_size, quant_config)

    def forward(self, input_ids, positions, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)
