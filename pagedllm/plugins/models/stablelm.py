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

from pagedllm.distributed.parallel_state import tp_rank
from pagedllm.plugins.models.common import LayerNorm, held_part, kv_head_share
from pagedllm.plugins.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm without bias for each head of ``[T, heads, head_dim]``, each with its
    own weight (``norms.{head}.weight``): of ``heads = (first, count)`` of ``num_heads``,
    a tensor-parallel rank's share (the others' norms are held elsewhere)."""

    def __init__(self, head_dim: int, num_heads: int, heads: tuple[int, int], eps: float):
        super().__init__()
        first, count = heads
        self.norms = nn.ModuleList(
            held_part(lambda: LayerNorm(head_dim, eps, bias=False), first <= h < first + count)
            for h in range(num_heads)
        )
        self.held = tuple(self.norms[first : first + count])
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([norm.weight for norm in self.held])
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class StableLmAttention(LlamaAttention):
    qk_norm_names = ("q_layernorm", "k_layernorm")

    def biases(self, config: Any) -> tuple[bool, bool]:
        return bool(config.use_qkv_bias), False

    def qk_norms(self, config: Any) -> tuple[nn.Module, nn.Module] | None:
        if not config.qk_layernorm:
            return None
        eps = config.layer_norm_eps
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return (
            PerHeadLayerNorm(
                self.head_dim, heads, (tp_rank() * self.num_heads, self.num_heads), eps
            ),
            PerHeadLayerNorm(self.head_dim, kv_heads, kv_head_share(kv_heads), eps),
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
    supports_tensor_parallel = True
