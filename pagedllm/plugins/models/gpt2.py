"""GPT-2: learned positions, fused qkv, pre-LayerNorm blocks.

Module names mirror Hugging Face's so checkpoints load by name. Hugging Face stores the
projections as ``Conv1D`` (weight ``[in, out]``); they are plain ``Linear`` layers here,
so quantization methods can take them over, and their weights are transposed on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention, AttentionMetadata
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear, fused_rows
from pagedllm.distributed.parallel_state import tp_rank, tp_size
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    TwoLayerMLP,
    decoder_layers,
    held_part,
)

_CONV1D_WEIGHTS = (
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
)
# Causal-mask buffers some checkpoints carry; the attention layer masks by itself.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _layer_norm(config: Any) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    norm.requires_grad_(False)
    return norm


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        if self.head_dim * heads != hidden:
            raise ConfigError(f"GPT-2 n_embd {hidden} is not divisible by {heads} attention heads")
        # This rank's heads (all of them on one rank).
        self.num_heads = heads // tp_size()
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        # Hugging Face's eager path then computes attention in float32; with a float32
        # model that changes nothing, with half precision it avoids overflow in q.k.
        self.upcast = bool(getattr(config, "reorder_and_upcast_attn", False))
        # c_attn stacks Q, K and V; with several tensor-parallel ranks each rank holds
        # its heads' rows of each, and c_proj the matching input columns.
        local = self.num_heads * self.head_dim
        self.c_attn = Linear(hidden, 3 * local, True, quant, f"{prefix}.c_attn")
        start = tp_rank() * local
        fused_rows(self.c_attn, [(part * hidden + start, local) for part in range(3)], 3 * hidden)
        self.c_proj = Linear(hidden, hidden, True, quant, f"{prefix}.c_proj", parallel="row")
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads, layer)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)
        if self.upcast:
            out = self.attn(q.float(), k.float(), v.float(), metadata).to(hidden.dtype)
        else:
            out = self.attn(q, k, v, metadata)
        return self.c_proj(out)


class GPT2MLP(TwoLayerMLP):
    names = ("c_fc", "c_proj")

    def __init__(self, config: Any, quant: QuantizationConfig | None, prefix: str) -> None:
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        super().__init__(hidden, inner, True, config.activation_function, quant, prefix)


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.ln_1 = _layer_norm(config)
        self.attn = GPT2Attention(config, layer, quant, f"{prefix}.attn")
        self.ln_2 = _layer_norm(config)
        self.mlp = GPT2MLP(config, quant, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), metadata)
        return hidden + self.mlp(self.ln_2(hidden))


def _embedding(rows: int, config: Any) -> nn.Embedding:
    embedding = nn.Embedding(rows, config.hidden_size)
    embedding.requires_grad_(False)
    return embedding


class GPT2Model(DecoderStack):
    def __init__(self, config: Any, quant: QuantizationConfig | None, max_positions: int) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ConfigError(
                "GPT-2 with add_cross_attention (an encoder-decoder) is not supported"
            )
        if max_positions > config.max_position_embeddings:
            raise ConfigError(
                f"GPT-2 learns {config.max_position_embeddings} positions; "
                f"a context of {max_positions} cannot be served"
            )
        stage = self.init_stage()
        self.wte = held_part(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size), stage.first
        )
        self.wpe = held_part(
            lambda: _embedding(config.max_position_embeddings, config), stage.first
        )
        self.h, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: GPT2Block(config, i, quant, f"transformer.h.{i}"),
        )
        self.ln_f = held_part(lambda: _layer_norm(config), stage.last)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)

    def run_layer(self, layer, positions, hidden, metadata: AttentionMetadata) -> torch.Tensor:
        return layer(hidden, metadata)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    supports_tensor_parallel = True
    split_sizes = ("n_inner",)
    tie_by_default = True
    decoder_attr = "transformer"

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
        self.transformer = GPT2Model(config, quant_config, max_positions)
        self.init_head(config, self.transformer.wte, config.hidden_size)

    def checkpoint_name(self, name: str) -> str | None:
        if name.endswith(_MASK_BUFFERS):
            return None
        # The openai-community/gpt2* checkpoints were saved from GPT2Model: no prefix.
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        return super().checkpoint_name(name)

    def prepare_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_CONV1D_WEIGHTS) and tensor.dim() == 2:
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            yield name, tensor
