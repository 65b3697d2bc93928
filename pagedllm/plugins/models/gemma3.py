"""Gemma 3 (text): interleaved sliding-window and global layers, each kind with its own
RoPE base, q/k norms, four norms per layer (all ``x * (1 + w)``), a scaled embedding and
an optional final logit soft-cap. Module names mirror Hugging Face's ``Gemma3ForCausalLM``.
Gemma 2 (``gemma2.py``) is the same model without q/k norms, with one RoPE table and
soft-capped attention scores: the differences are class attributes here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.attention import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear, LinearGroup
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    RMSNorm,
    decoder_layers,
    held_part,
    layer_sliding_windows,
)
from pagedllm.plugins.models.llama import LlamaMLP, native_forward, qkv_projections


def _norm(size: int, config: Any) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, offset=1.0)


class Gemma3Attention(nn.Module):
    # An RMSNorm over each Q and K head before the rotary embedding.
    qk_norm: ClassVar[bool] = True
    # Attention scores soft-capped at the config's attn_logit_softcapping.
    soft_cap: ClassVar[bool] = False

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = config.head_dim
        bias = config.attention_bias
        heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.num_heads, self.num_kv_heads = qkv_projections(
            config, heads, config.num_key_value_heads, self.head_dim, bias, quant, prefix
        )
        q_size = heads * self.head_dim
        self.o_proj = Linear(q_size, hidden, bias, quant, f"{prefix}.o_proj", parallel="row")
        self.qkv = LinearGroup([self.q_proj, self.k_proj, self.v_proj])
        self.q_norm = _norm(self.head_dim, config) if self.qk_norm else None
        self.k_norm = _norm(self.head_dim, config) if self.qk_norm else None
        # (as LlamaAttention tells its norms of each head to the native decoder layer)
        self.has_qk_norm = self.qk_norm
        self.qk_norm_names = ("q_norm", "k_norm")
        scale = config.query_pre_attn_scalar**-0.5
        cap = config.attn_logit_softcapping if self.soft_cap else None
        self.attn = Attention(
            self.num_heads, self.head_dim, scale, self.num_kv_heads, layer, window, cap
        )

    def forward(self, positions, hidden, rotary: RotaryEmbedding, metadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # (contiguous heads: the CPU norm kernel's rows at any number of tokens, as the
            # native layer norms them)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata)
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = Gemma3Attention

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.self_attn = self.attention_cls(config, layer, window, quant, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, quant, f"{prefix}.mlp")
        size = config.hidden_size
        self.input_layernorm = _norm(size, config)
        self.post_attention_layernorm = _norm(size, config)
        self.pre_feedforward_layernorm = _norm(size, config)
        self.post_feedforward_layernorm = _norm(size, config)

    # The layer as one native call where it qualifies (see LlamaDecoderLayer).
    _native: Any = None

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        out = native_forward(self, positions, hidden, rotary, metadata)
        if out is not None:
            return out
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(DecoderStack):
    layer_cls: type[nn.Module] = Gemma3DecoderLayer

    def __init__(self, config: Any, quant, max_positions: int, disable_sliding_window: bool):
        super().__init__()
        stage = self.init_stage()
        self.embed_tokens = held_part(
            lambda: VocabEmbedding(
                config.vocab_size, config.hidden_size, quant, "model.embed_tokens"
            ),
            stage.first,
        )
        # As Hugging Face: sqrt(hidden) rounded to the weight dtype, applied after lookup.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        windows = layer_sliding_windows(config, disable_sliding_window)
        self.layers, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: self.layer_cls(config, i, windows[i], quant, f"model.layers.{i}"),
        )
        self.norm = held_part(lambda: _norm(config.hidden_size, config), stage.last)
        self.rotary = self.rotary_tables(config, max_positions)

    def rotary_tables(self, config: Any, max_positions: int) -> nn.ModuleDict:
        """The RoPE table of each layer type, each from its own RoPE parameters."""
        return nn.ModuleDict(
            {
                kind: RotaryEmbedding(config, config.head_dim, max_positions, layer_type=kind)
                for kind in sorted(set(config.layer_types))
            }
        )

    def embed(self, input_ids, positions) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def run_layer(self, layer, positions, hidden, metadata) -> torch.Tensor:
        return layer(positions, hidden, self.rotary[layer.layer_type], metadata)

    def finish(self, hidden) -> torch.Tensor:
        return self.norm(hidden)


class Gemma3ForCausalLM(CausalLM):
    supports_tensor_parallel = True
    tie_by_default = True
    model_cls: type[nn.Module] = Gemma3Model

    def __init__(
        self,
        config: Any,
        quant_config: QuantizationConfig | None = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        attention = self.model_cls.layer_cls.attention_cls
        if not attention.soft_cap and getattr(config, "attn_logit_softcapping", None) is not None:
            # (transformers' Gemma 3 stores it and does not apply it.)
            raise ConfigError(f"{name} with attn_logit_softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ConfigError(
                f"{name} with bidirectional attention (embedding models) is not supported"
            )
        self.config = config
        max_positions = max_positions or config.max_position_embeddings
        self.model = self.model_cls(config, quant_config, max_positions, disable_sliding_window)
        self.init_head(config, self.model.embed_tokens, config.hidden_size, quant_config)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
