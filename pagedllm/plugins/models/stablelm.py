"""StableLM (StableLM 2, StableLM-3B-4E1T, StableCode): the Llama family's layers with
LayerNorms, partial rotary embeddings (``partial_rotary_factor``), Q/K/V biases where
``use_qkv_bias``, attention and MLP in parallel where ``use_parallel_residual``, and a
LayerNorm of its own for each Q and K head where ``qk_layernorm``. Module names mirror
Hugging Face's ``StableLmForCausalLM``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.plugins.models.common import LayerNorm
from pagedllm.plugins.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm without bias for each head of ``[T, heads, head_dim]``, each with its
    own weight (``norms.{head}.weight``)."""

    def __init__(self, head_dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(head_dim, eps, bias=False) for _ in range(num_heads))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([norm.weight for norm in self.norms])
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class StableLmAttention(LlamaAttention):
    qk_norm_names = ("q_layernorm", "k_layernorm")

    def biases(self, config: Any) -> tuple[bool, bool]:
        return bool(config.use_qkv_bias), False

    def qk_norms(self, config: Any) -> tuple[nn.Module, nn.Module] | None:
        if not config.qk_layernorm:
            return None
        eps = config.layer_norm_eps
        return (
            PerHeadLayerNorm(self.head_dim, self.num_heads, eps),
            PerHeadLayerNorm(self.head_dim, self.num_kv_heads, eps),
        )


class StableLmDecoderLayer(LlamaDecoderLayer):
    attention_cls = StableLmAttention
    _native = False

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)

    @classmethod
    def parallel_residual(cls, config: Any) -> bool:
        return bool(config.use_parallel_residual)


class StableLmModel(LlamaModel):
    layer_cls = StableLmDecoderLayer


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel
