"""GPT-NeoX (Pythia, GPT-NeoX-20B, Dolly v2, RedPajama-INCITE, ...): LayerNorms, one fused
``query_key_value`` projection holding each head's query, key and value side by side,
partial rotary embeddings (``partial_rotary_factor``, once ``rotary_pct``), attention and
MLP in parallel where ``use_parallel_residual`` (each with its own norm), a GELU MLP.
Module names mirror Hugging Face's ``GPTNeoXForCausalLM``; the head, saved as
``embed_out``, is ``lm_head`` here (the name quantization methods keep in floats).

:class:`GroupedQKVAttention` is Falcon's attention too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention, AttentionMetadata
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear, fused_rows
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.distributed.parallel_state import tp_rank, tp_size
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    LayerNorm,
    TwoLayerMLP,
    decoder_layers,
    held_part,
    kv_head_share,
)


class GroupedQKVAttention(nn.Module):
    """Attention over one fused ``query_key_value`` projection whose rows hold, for each
    KV head, the query heads sharing it, then its key, then its value (GPT-NeoX: one query
    per KV head; Falcon's new decoder architecture: several), with an output projection
    ``dense``. Q, K and V are split from the checkpoint's layout at run time, so a
    quantization method sees the layer as saved."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        layer: int,
        window: int | None,
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.head_dim = d = hidden // num_heads
        # This rank's heads (all of them on one rank): its share of the query heads and
        # of the KV heads, or the one KV head its query heads share (replicated).
        first_kv, self.num_kv_heads = kv_head_share(num_kv_heads)
        self.num_heads = num_heads // tp_size()
        self.query_key_value = Linear(
            hidden, (self.num_heads + 2 * self.num_kv_heads) * d, bias, quant,
            f"{prefix}.query_key_value",
        )  # fmt: skip
        # Each KV head's block of rows: its group of query heads, its key, its value.
        # A rank holds, of each of its KV heads' blocks, its query heads' rows and the
        # key's and value's.
        group, first_q = num_heads // num_kv_heads, tp_rank() * self.num_heads
        local_group = self.num_heads // self.num_kv_heads
        rows = []
        for kv in range(first_kv, first_kv + self.num_kv_heads):
            block, q_in_block = kv * (group + 2) * d, max(first_q - kv * group, 0)
            rows += [(block + q_in_block * d, local_group * d), (block + group * d, 2 * d)]
        fused_rows(self.query_key_value, rows, (num_heads + 2 * num_kv_heads) * d)
        self.dense = Linear(hidden, hidden, bias, quant, f"{prefix}.dense", parallel="row")
        scale = d**-0.5
        self.attn = Attention(self.num_heads, d, scale, self.num_kv_heads, layer, window)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[T, heads, d]``, K and V ``[T, kv_heads, d]``, each dense."""
        tokens, group = qkv.shape[0], self.num_heads // self.num_kv_heads
        grouped = qkv.view(tokens, self.num_kv_heads, group + 2, self.head_dim)
        q = grouped[:, :, :group].reshape(tokens, self.num_heads, self.head_dim)
        return q, grouped[:, :, group].contiguous(), grouped[:, :, group + 1].contiguous()

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.split(self.query_key_value(hidden))
        if rotary is not None:
            q, k = rotary(positions, q, k)
        out = self.attn(
            q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1), metadata
        )
        return self.dense(out)


class NeoXMLP(TwoLayerMLP):
    """GPT-NeoX's and Falcon's MLP."""

    names = ("dense_h_to_4h", "dense_4h_to_h")


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        heads = config.num_attention_heads
        self.attention = GroupedQKVAttention(
            hidden, heads, heads, config.attention_bias, layer, None, quant, f"{prefix}.attention"
        )
        inter, act = config.intermediate_size, config.hidden_act
        self.mlp = NeoXMLP(hidden, inter, True, act, quant, f"{prefix}.mlp")
        self.parallel = bool(config.use_parallel_residual)

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(hidden), rotary, metadata)
        # (Sums in transformers' order.)
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(hidden)) + attn + hidden
        hidden, normed = self.post_attention_layernorm.add_forward(attn, hidden)
        return self.mlp(normed) + hidden


class GPTNeoXModel(DecoderStack):
    def __init__(self, config: Any, quant: QuantizationConfig | None, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        stage = self.init_stage()
        self.embed_in = held_part(
            lambda: VocabEmbedding(config.vocab_size, hidden, quant, "gpt_neox.embed_in"),
            stage.first,
        )
        self.layers, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: GPTNeoXLayer(config, i, quant, f"gpt_neox.layers.{i}"),
        )
        self.final_layer_norm = held_part(
            lambda: LayerNorm(hidden, config.layer_norm_eps), stage.last
        )
        head_dim = hidden // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)

    def embed(self, input_ids, positions) -> torch.Tensor:
        return self.embed_in(input_ids)

    def run_layer(self, layer, positions, hidden, metadata) -> torch.Tensor:
        return layer(positions, hidden, self.rotary_emb, metadata)

    def finish(self, hidden) -> torch.Tensor:
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(CausalLM):
    supports_tensor_parallel = True
    decoder_attr = "gpt_neox"

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
        self.gpt_neox = GPTNeoXModel(config, quant_config, max_positions)
        self.init_head(config, self.gpt_neox.embed_in, config.hidden_size, quant_config)

    def checkpoint_name(self, name: str) -> str | None:
        if name.endswith((".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")):
            return None  # (buffers older checkpoints saved)
        if name.startswith("embed_out."):
            name = f"lm_head.{name.removeprefix('embed_out.')}"
        return super().checkpoint_name(name)
