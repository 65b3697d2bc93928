"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2 and Qwen3.

One implementation; the members differ in biases and q/k norms (class attributes of
their attention) and sliding windows (read from the Hugging Face config). Module names
mirror Hugging Face's so checkpoints load by name; Q/K/V and gate/up are computed as
``LinearGroup``s built with the model.

Built after ``pagedllm.distributed.parallel_state.set_tensor_parallel`` with several
ranks, each rank holds its share of the attention heads (Q/K/V column-parallel, the
output projection row-parallel; fewer KV heads than ranks are replicated, one per rank)
and of the MLP (gate/up column-parallel, down row-parallel); the embedding and an untied
head are split by vocabulary rows. Llama, Mistral, Qwen2 and Qwen3 support it.
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
from pagedllm.distributed.parallel_state import tp_size
from pagedllm.kernels import triton_rows
from pagedllm.kernels.batch_invariant import batch_invariant
from pagedllm.kernels.cpu_ops import GATED_ACTIVATIONS, SILU_KERNEL_MAX_ROWS, cpu_ops_for
from pagedllm.plugins.models.common import (
    CausalLM,
    DecoderStack,
    RMSNorm,
    activation,
    decoder_layers,
    held_part,
    kv_head_share,
    layer_sliding_windows,
)


def qkv_projections(
    config: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
    bias: bool,
    quant: QuantizationConfig | None,
    prefix: str,
) -> tuple[Linear, Linear, Linear, int, int]:
    """``q_proj``, ``k_proj``, ``v_proj`` (column-parallel) and this rank's numbers of
    query and KV heads (all of them on one rank): its share of the query heads, and of
    the KV heads, or the one KV head its query heads share."""
    hidden = config.hidden_size
    first_kv, num_kv_heads = kv_head_share(kv_heads)
    kv_size = kv_heads * head_dim
    kv_shard = (first_kv * head_dim, num_kv_heads * head_dim)

    def column(size: int, name: str, shard: tuple[int, int] | None = None) -> Linear:
        return Linear(hidden, size, bias, quant, f"{prefix}.{name}", parallel="column", shard=shard)

    return (
        column(heads * head_dim, "q_proj"),
        column(kv_size, "k_proj", kv_shard),
        column(kv_size, "v_proj", kv_shard),
        heads // tp_size(),
        num_kv_heads,
    )


class LlamaAttention(nn.Module):
    # Biases of the Q/K/V and output projections; None: the config's attention_bias.
    qkv_bias: ClassVar[bool | None] = None
    o_bias: ClassVar[bool | None] = None
    # RMSNorm over each head of Q and K before the rotary embedding.
    qk_norm: ClassVar[bool] = False
    # Checkpoint names of the output projection and of the Q and K norms (Phi's are
    # dense, q_layernorm and k_layernorm).
    o_proj_name: ClassVar[str] = "o_proj"
    qk_norm_names: ClassVar[tuple[str, str]] = ("q_norm", "k_norm")

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        qkv_bias, o_bias = self.biases(config)
        q_size = heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.num_heads, self.num_kv_heads = qkv_projections(
            config, heads, kv_heads, self.head_dim, qkv_bias, quant, prefix
        )
        o_name = self.o_proj_name
        o_proj = Linear(q_size, hidden, o_bias, quant, f"{prefix}.{o_name}", parallel="row")
        setattr(self, o_name, o_proj)
        self.qkv = LinearGroup([self.q_proj, self.k_proj, self.v_proj])
        norms = self.qk_norms(config)
        self.has_qk_norm = norms is not None
        for name, norm in zip(self.qk_norm_names, norms or (None, None), strict=True):
            setattr(self, name, norm)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer, window
        )

    def biases(self, config: Any) -> tuple[bool, bool]:
        """Whether the Q/K/V projections and the output projection have biases."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        return qkv_bias, attention_bias if self.o_bias is None else self.o_bias

    def qk_norms(self, config: Any) -> tuple[nn.Module, nn.Module] | None:
        """The norms of each Q and of each K head (``[T, heads, head_dim]``), or None."""
        if not self.qk_norm:
            return None
        return RMSNorm(self.head_dim, config.rms_norm_eps), RMSNorm(
            self.head_dim, config.rms_norm_eps
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
        if self.has_qk_norm:
            # (contiguous heads: the CPU norm kernel's rows at any number of tokens, as the
            # native layer norms them, pagedllm.kernels.cpu_layer)
            q_name, k_name = self.qk_norm_names
            q = getattr(self, q_name)(q.contiguous())
            k = getattr(self, k_name)(k.contiguous())
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata)
        return getattr(self, self.o_proj_name)(out)


class LlamaMLP(nn.Module):
    def __init__(
        self, config: Any, quant, prefix: str, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        # Gemma names it hidden_activation.
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.gate_proj = Linear(
            hidden, inter, bias, quant, f"{prefix}.gate_proj", parallel="column"
        )
        self.up_proj = Linear(hidden, inter, bias, quant, f"{prefix}.up_proj", parallel="column")
        self.down_proj = Linear(inter, hidden, bias, quant, f"{prefix}.down_proj", parallel="row")
        self.gate_up = LinearGroup([self.gate_proj, self.up_proj])
        self.act_fn = activation(act)
        # (the CPU kernel of act(gate) * up, where there is one)
        self.gated_kernel = GATED_ACTIVATIONS.get(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(gated_activation(gate, up, self.gated_kernel, self.act_fn))


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, kernel: str | None, act_fn: nn.Module
) -> torch.Tensor:
    """``act_fn(gate) * up``, on the CPU kernel of the activation (``kernel``, one of
    pagedllm.kernels.cpu_ops' GATED_KERNELS; None: there is none) or the Triton one (SiLU)
    where they take the rows (the native decoder layer, which calls the CPU kernel, relies
    on the modules taking it for the rows it takes)."""
    ops = cpu_ops_for(gate) if gate.dim() == 2 and kernel else None
    # The kernel saves torch calls on the few rows of a decode step; over many float32
    # rows (prefill) torch's own vectorised activation is faster unless the kernel's is
    # vectorised too, over bfloat16 ones (which torch widens and narrows op by op) the
    # kernel. (Batch-invariant mode: one activation whatever the row count.)
    fits = ops is not None and (
        gate.shape[0] <= SILU_KERNEL_MAX_ROWS
        or gate.dtype == torch.bfloat16
        or ops.silu_vector
        or batch_invariant()
    )
    if fits and ops.rows_ok(gate) and ops.rows_ok(up) and gate.dtype == up.dtype:
        return ops.gated_mul(kernel, gate, up)
    silu = kernel == "silu_mul"
    if silu and triton_rows(gate) and triton_rows(up) and gate.dtype == up.dtype:
        from pagedllm.kernels.triton_attention import triton_silu_mul  # (GPUs only)

        return triton_silu_mul(gate, up)
    return act_fn(gate) * up


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: Any, layer: int, window: int | None, quant, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer, window, quant, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer, quant, f"{prefix}.mlp")
        self.input_layernorm = self.make_norm(config)
        # Attention and MLP both read the normed input and add to the residual together
        # (Phi; StableLM's use_parallel_residual): no second norm.
        self.parallel = self.parallel_residual(config)
        self.post_attention_layernorm = None if self.parallel else self.make_norm(config)

    def make_mlp(self, config: Any, layer: int, quant, prefix: str) -> nn.Module:
        """The layer's MLP (``mlp_cls``; mixture-of-experts layers choose per layer)."""
        return self.mlp_cls(config, quant, prefix)

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        """A norm over the hidden size (the layer's and the model's final one)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def parallel_residual(cls, config: Any) -> bool:
        return False

    # The layer as one native call where it qualifies (pagedllm.kernels.cpu_layer); built
    # at the first step, once the weights are loaded. False: it does not qualify.
    _native: Any = None

    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        out = native_forward(self, positions, hidden, rotary, metadata)
        if out is not None:
            return out
        if self.parallel:
            normed = self.input_layernorm(hidden)
            attn = self.self_attn(positions, normed, rotary, metadata)
            return hidden + attn + self.mlp(normed)
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, metadata)
        hidden, normed = self.post_attention_layernorm.add_forward(attn, hidden)
        return hidden + self.mlp(normed)


def native_forward(layer: Any, positions, hidden, rotary, metadata) -> torch.Tensor | None:
    """A decoder layer's step as one native call on the CPU (the layer's ``_native``,
    pagedllm.kernels.cpu_layer's, built at its first step, once the weights are loaded;
    False where the layer does not qualify), or None: the modules compute the step."""
    if hidden.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    if layer._native is None:
        from pagedllm.kernels.cpu_layer import native_decoder_layer

        layer._native = native_decoder_layer(layer, rotary) or False
    return layer._native(positions, hidden, metadata) if layer._native else None


class LlamaModel(DecoderStack):
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    # The final norm's checkpoint name (Phi's is final_layernorm).
    norm_name: ClassVar[str] = "norm"

    def __init__(self, config: Any, quant, max_positions: int, disable_sliding_window: bool):
        super().__init__()
        stage = self.init_stage()
        self.embed_tokens = held_part(
            lambda: VocabEmbedding(
                config.vocab_size, config.hidden_size, quant, "model.embed_tokens"
            ),
            stage.first,
        )
        windows = layer_sliding_windows(config, disable_sliding_window)
        self.layers, self.stage_layers = decoder_layers(
            config.num_hidden_layers,
            lambda i: self.layer_cls(config, i, windows[i], quant, f"model.layers.{i}"),
        )
        setattr(
            self, self.norm_name, held_part(lambda: self.layer_cls.make_norm(config), stage.last)
        )
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)

    def embed(self, input_ids, positions) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layer(self, layer, positions, hidden, metadata) -> torch.Tensor:
        return layer(positions, hidden, self.rotary_emb, metadata)

    def finish(self, hidden) -> torch.Tensor:
        return getattr(self, self.norm_name)(hidden)


class LlamaForCausalLM(CausalLM):
    model_cls: type[nn.Module] = LlamaModel
    supports_tensor_parallel = True
    supports_batch_invariance = True

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

    def checkpoint_name(self, name: str) -> str | None:
        if "rotary_emb.inv_freq" in name:
            return None  # older checkpoints saved the rotary buffer
        return super().checkpoint_name(name)


class MistralForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True
    supports_batch_invariance = True


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
    supports_tensor_parallel = True
    supports_batch_invariance = True


class Qwen3Attention(LlamaAttention):
    """Qwen3: no Q/K/V biases (unless attention_bias), an RMSNorm on each Q and K head."""

    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
    supports_tensor_parallel = True
    supports_batch_invariance = True
