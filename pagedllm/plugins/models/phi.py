"""Phi (phi-1, phi-1.5, phi-2): the Llama family's layers with one LayerNorm per layer
feeding attention and MLP in parallel (``x + attn(ln(x)) + mlp(ln(x))``), biases
everywhere (the head's too), partial rotary embeddings (``partial_rotary_factor``), an
optional LayerNorm over each Q and K head (``qk_layernorm``) and a GELU MLP (``fc1`` /
``fc2``). Module names mirror Hugging Face's ``PhiForCausalLM``."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.plugins.models.common import LayerNorm, TwoLayerMLP
from pagedllm.plugins.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class PhiAttention(LlamaAttention):
    qkv_bias = True
    o_bias = True
    o_proj_name = "dense"
    qk_norm_names = ("q_layernorm", "k_layernorm")

    def qk_norms(self, config: Any) -> tuple[nn.Module, nn.Module] | None:
        if not config.qk_layernorm:
            return None
        eps = config.layer_norm_eps
        return LayerNorm(self.head_dim, eps), LayerNorm(self.head_dim, eps)


class PhiMLP(TwoLayerMLP):
    names = ("fc1", "fc2")

    def __init__(self, config: Any, quant, prefix: str) -> None:
        hidden, inner = config.hidden_size, config.intermediate_size
        super().__init__(hidden, inner, True, config.hidden_act, quant, prefix)


class PhiDecoderLayer(LlamaDecoderLayer):
    attention_cls = PhiAttention
    mlp_cls = PhiMLP
    _native = False

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)

    @classmethod
    def parallel_residual(cls, config: Any) -> bool:
        return True


class PhiModel(LlamaModel):
    layer_cls = PhiDecoderLayer
    norm_name = "final_layernorm"


class PhiForCausalLM(LlamaForCausalLM):
    model_cls = PhiModel
    supports_tensor_parallel = True
    head_bias = True
