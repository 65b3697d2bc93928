"""Phi-3 (and Phi-4-mini): Llama-like, with fused ``qkv_proj`` and ``gate_up_proj``
weights, an optional partial rotary dimension and sliding window. Module names mirror
Hugging Face's ``Phi3ForCausalLM``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention
from pagedllm.core.layers.linear import Linear, fused_rows
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.distributed.parallel_state import tp_rank, tp_size
from pagedllm.kernels.cpu_ops import GATED_ACTIVATIONS
from pagedllm.plugins.models.common import activation, kv_head_share
from pagedllm.plugins.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    gated_activation,
)


class Phi3Attention(nn.Module):
    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        # This rank's heads (all on one rank): its share of the query heads, and of the KV
        # heads or the one it shares.
        first_kv, self.num_kv_heads = kv_head_share(kv_heads)
        self.num_heads = heads // tp_size()
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, False, quant, f"{prefix}.qkv_proj"
        )
        full_q, full_kv = heads * self.head_dim, kv_heads * self.head_dim
        kv_start = first_kv * self.head_dim
        fused_rows(
            self.qkv_proj,
            [
                (tp_rank() * self.q_size, self.q_size),
                (full_q + kv_start, self.kv_size),
                (full_q + full_kv + kv_start, self.kv_size),
            ],
            full_q + 2 * full_kv,
        )
        self.o_proj = Linear(full_q, hidden, False, quant, f"{prefix}.o_proj", parallel="row")
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
        local = inter // tp_size()
        self.gate_up_proj = Linear(hidden, 2 * local, False, quant, f"{prefix}.gate_up_proj")
        start = tp_rank() * local
        fused_rows(self.gate_up_proj, [(start, local), (inter + start, local)], 2 * inter)
        self.down_proj = Linear(inter, hidden, False, quant, f"{prefix}.down_proj", parallel="row")
        self.act_fn = activation(config.hidden_act)
        self.gated_kernel = GATED_ACTIVATIONS.get(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(gated_activation(gate, up, self.gated_kernel, self.act_fn))


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention
    mlp_cls = Phi3MLP


class Phi3Model(LlamaModel):
    layer_cls = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    """Its checkpoints already fuse Q/K/V and gate/up (with several tensor-parallel ranks
    each rank takes its rows of each part)."""

    model_cls = Phi3Model
    supports_tensor_parallel = True
