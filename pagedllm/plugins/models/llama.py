"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2 and Qwen3.

One implementation; the members differ in biases and q/k norms (class attributes of
their attention) and sliding windows (read from the Hugging Face config). Module names
mirror Hugging Face's so checkpoints load by name; Q/K/V and gate/up are computed as
``LinearGroup``s built with the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.attention import Attention, AttentionMetadata
from pagedllm.core.interfaces import QuantizationConfig
from pagedllm.core.layers.embedding import VocabEmbedding
from pagedllm.core.layers.linear import Linear, LinearGroup
from pagedllm.core.layers.rotary import RotaryEmbedding
from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.plugins.models.common import (
    SILU_NAMES,
    CausalLM,
    RMSNorm,
    activation,
    layer_sliding_windows,
)


class LlamaAttention(nn.Module):
    # Biases of the Q/K/V and output projections; None: the config's attention_bias.
    qkv_bias: ClassVar[bool | None] = None
    o_bias: ClassVar[bool | None] = None
    # RMSNorm over each head of Q and K before the rotary embedding.
    qk_norm: ClassVar[bool] = False

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_size, qkv_bias, quant, f"{prefix}.q_proj")
        self.k_proj = Linear(hidden, kv_size, qkv_bias, quant, f"{prefix}.k_proj")
        self.v_proj = Linear(hidden, kv_size, qkv_bias, quant, f"{prefix}.v_proj")
        self.o_proj = Linear(q_size, hidden, o_bias, quant, f"{prefix}.o_proj")
        self.qkv = LinearGroup([self.q_proj, self.k_proj, self.v_proj])
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if self.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if self.qk_norm else None
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer, window
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata)
        return self.o_proj(out)


SILU_KERNEL_MAX_ROWS = 64


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, quant, prefix: str) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        # Gemma names it hidden_activation.
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.gate_proj = Linear(hidden, inter, bias, quant, f"{prefix}.gate_proj")
        self.up_proj = Linear(hidden, inter, bias, quant, f"{prefix}.up_proj")
        self.down_proj = Linear(inter, hidden, bias, quant, f"{prefix}.down_proj")
        self.gate_up = LinearGroup([self.gate_proj, self.up_proj])
        self.act_fn = activation(act)
        self.silu = act in SILU_NAMES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        # The kernel saves two torch calls on the few rows of a decode step; over many
        # float32 rows (prefill) torch's own vectorised SiLU is faster, over bfloat16 ones
        # (which torch widens and narrows op by op) the kernel.
        fits = gate.shape[0] <= SILU_KERNEL_MAX_ROWS or gate.dtype == torch.bfloat16
        use = gate.dim() == 2 and fits and self.silu and gate.device.type == "cpu"
        ops = cpu_ops() if use else None
        if ops is not None and ops.rows_ok(gate) and ops.rows_ok(up) and gate.dtype == up.dtype:
            return self.down_proj(ops.silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer, window, quant, f"{prefix}.self_attn")
        self.mlp = self.mlp_cls(config, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # The layer as one native call where it qualifies (pagedllm.kernels.cpu_layer); built
    # at the first step, once the weights are loaded. False: it does not qualify.
    _native: Any = None

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        if hidden.device.type == "cpu":
            if self._native is None:
                from pagedllm.kernels.cpu_layer import native_decoder_layer

                self._native = native_decoder_layer(self, rotary) or False
            if self._native:
                out = self._native(positions, hidden, metadata)
                if out is not None:
                    return out
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, metadata)
        hidden, normed = self.post_attention_layernorm.add_forward(attn, hidden)
        return hidden + self.mlp(normed)


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: Any, quant, max_positions: int, disable_sliding_window: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant, "model.embed_tokens"
        )
        windows = layer_sliding_windows(config, disable_sliding_window)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, windows[i], quant, f"model.layers.{i}")
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


class LlamaForCausalLM(CausalLM):
    model_cls: type[nn.Module] = LlamaModel

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
        self.model = self.model_cls(config, quant_config, max_positions, disable_sliding_window)
        self.init_head(config, self.model.embed_tokens, config.hidden_size, quant_config)

    def forward(self, input_ids, positions, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def checkpoint_name(self, name: str) -> str | None:
        if "rotary_emb.inv_freq" in name:
            return None  # older checkpoints saved the rotary buffer
        return super().checkpoint_name(name)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2Attention(LlamaAttention):
    """Qwen2: biases on Q/K/V always, never on the output projection."""

    qkv_bias = True
    o_bias = False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model


class Qwen3Attention(LlamaAttention):
    """Qwen3: no Q/K/V biases (unless attention_bias), an RMSNorm on each Q and K head."""

    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
