"""OPT (facebook/opt-*): learned positions, biased projections, pre- or post-LayerNorm.

Module names mirror Hugging Face's so checkpoints load by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention, AttentionMetadata
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear
from pagedllm.distributed.parallel_state import tp_size
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    activation,
    decoder_layers,
    held_part,
)

# OPT's learned position table has two extra rows in front (a fairseq padding relic):
# absolute position p is row p + 2.
_POSITION_OFFSET = 2


def _word_embed_dim(config: Any) -> int:
    return getattr(config, "word_embed_proj_dim", None) or config.hidden_size


def _layer_norm(config: Any) -> nn.LayerNorm:
    norm = nn.LayerNorm(
        config.hidden_size,
        elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True),
    )
    norm.requires_grad_(False)
    return norm


class OPTAttention(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        if self.head_dim * heads != hidden:
            raise ConfigError(
                f"OPT hidden_size {hidden} is not divisible by {heads} attention heads"
            )
        # This rank's heads (all of them on one rank).
        self.num_heads = heads // tp_size()
        # Hugging Face scales q right after its projection, then attends unscaled; doing
        # the same keeps the rounding identical for head sizes whose scale is inexact.
        self.scaling = self.head_dim**-0.5
        bias = getattr(config, "enable_bias", True)

        def column(name: str) -> Linear:
            return Linear(hidden, hidden, bias, quant, f"{prefix}.{name}", parallel="column")

        self.q_proj, self.k_proj, self.v_proj = column("q_proj"), column("k_proj"), column("v_proj")
        self.out_proj = Linear(hidden, hidden, bias, quant, f"{prefix}.out_proj", parallel="row")
        self.attn = Attention(self.num_heads, self.head_dim, 1.0, self.num_heads, layer)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q = self.q_proj(hidden) * self.scaling
        out = self.attn(q, self.k_proj(hidden), self.v_proj(hidden), metadata)
        return self.out_proj(out)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.do_layer_norm_before = config.do_layer_norm_before
        bias = getattr(config, "enable_bias", True)
        self.self_attn = OPTAttention(config, layer, quant, f"{prefix}.self_attn")
        self.self_attn_layer_norm = _layer_norm(config)
        hidden, inner = config.hidden_size, config.ffn_dim
        self.fc1 = Linear(hidden, inner, bias, quant, f"{prefix}.fc1", parallel="column")
        self.fc2 = Linear(inner, hidden, bias, quant, f"{prefix}.fc2", parallel="row")
        self.activation_fn = activation(config.activation_function)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # Most OPT sizes normalise before each block; opt-350m normalises after the residual.
        pre = self.do_layer_norm_before
        x = self.self_attn_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.self_attn(x, metadata)
        if not pre:
            hidden = self.self_attn_layer_norm(hidden)
        x = self.final_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.fc2(self.activation_fn(self.fc1(x)))
        if not pre:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(DecoderStack):
    def __init__(self, config: Any, quant: QuantizationConfig | None, max_positions: int) -> None:
        super().__init__()
        if max_positions > config.max_position_embeddings:
            raise ConfigError(
                f"OPT learns {config.max_position_embeddings} positions; "
                f"a context of {max_positions} cannot be served"
            )
        hidden, embed_dim = config.hidden_size, _word_embed_dim(config)
        stage = self.init_stage()
        self.embed_tokens = held_part(
            lambda: VocabEmbedding(config.vocab_size, embed_dim), stage.first
        )
        self.embed_positions = held_part(
            lambda: _embedding(config.max_position_embeddings + _POSITION_OFFSET, hidden),
            stage.first,
        )
        # Some sizes (opt-350m) embed words in a narrower space than the hidden size.
        self.project_in = self.project_out = None
        if embed_dim != hidden:
            self.project_in = held_part(
                lambda: Linear(embed_dim, hidden, False, quant, "model.decoder.project_in"),
                stage.first,
            )
            self.project_out = held_part(
                lambda: Linear(hidden, embed_dim, False, quant, "model.decoder.project_out"),
                stage.last,
            )
        # `_remove_final_layer_norm` exists for checkpoints fine-tuned before it was added.
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = held_part(lambda: _layer_norm(config), stage.last)
        self.layers, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: OPTDecoderLayer(config, i, quant, f"model.decoder.layers.{i}"),
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        return hidden + self.embed_positions(positions + _POSITION_OFFSET)

    def run_layer(self, layer, positions, hidden, metadata: AttentionMetadata) -> torch.Tensor:
        return layer(hidden, metadata)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


def _embedding(rows: int, width: int) -> nn.Embedding:
    embedding = nn.Embedding(rows, width)
    embedding.requires_grad_(False)
    return embedding


class OPTModel(nn.Module):
    """Only a name level, so parameter names read ``model.decoder.*`` as in checkpoints."""

    def __init__(self, config: Any, quant: QuantizationConfig | None, max_positions: int) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, quant, max_positions)

    def forward(self, input_ids, positions, metadata, intermediate=None) -> torch.Tensor:
        return self.decoder(input_ids, positions, metadata, intermediate)


class OPTForCausalLM(CausalLM):
    supports_tensor_parallel = True
    split_sizes = ("ffn_dim",)
    tie_by_default = True

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
        self.model = OPTModel(config, quant_config, max_positions)
        self.init_head(config, self.model.decoder.embed_tokens, _word_embed_dim(config))

    def checkpoint_name(self, name: str) -> str | None:
        # The facebook/opt-* checkpoints were saved from OPTModel: no "model." prefix.
        if name.startswith("decoder."):
            name = f"model.{name}"
        return super().checkpoint_name(name)
