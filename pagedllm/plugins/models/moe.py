"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE (with a gated shared
expert) and Qwen3-MoE. Their MLP is a :class:`SparseMoeBlock`: a router (a linear layer
kept in floats) picks each token's top-k experts by softmax probability (renormalised as
each model says), computed by a ``FusedMoE`` layer (``pagedllm.core.layers.moe``), which
a quantization method may take over.

Module names are transformers' (``mlp.gate``, ``mlp.experts.gate_up_proj`` ``[E, 2 *
inter, hidden]``, ``mlp.experts.down_proj``); checkpoints with one tensor per expert
(``experts.{e}.w1`` / ``w3`` / ``w2`` in Mixtral's ``block_sparse_moe``, ``experts.{e}
.gate_proj`` / ``up_proj`` / ``down_proj`` in Qwen's) load into them too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.core.layers.linear import Linear
from pagedllm.core.layers.moe import FusedMoE
from pagedllm.core.layers.weights import copy_weights
from pagedllm.kernels.moe import select_experts
from pagedllm.plugins.models.common import activation, take_kv_scales
from pagedllm.plugins.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    Qwen3Attention,
)

_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
_EXPERT_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        config: Any,
        quant,
        prefix: str,
        *,
        num_experts: int,
        inter: int,
        renormalize: bool,
        weights_in_input_dtype: bool,
        shared_inter: int | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        # Qwen's routers round the weights to the activations' dtype, Mixtral's keep float32.
        self.weights_in_input_dtype = weights_in_input_dtype
        self.gate = Linear(hidden, num_experts, False, None, f"{prefix}.gate")
        act = activation(config.hidden_act)
        self.experts = FusedMoE(num_experts, hidden, inter, act, quant, f"{prefix}.experts")
        if shared_inter:
            self.shared_expert = LlamaMLP(config, quant, f"{prefix}.shared_expert", shared_inter)
            self.shared_expert_gate = Linear(hidden, 1, False, None, f"{prefix}.shared_expert_gate")
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if self.weights_in_input_dtype else None
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def take_expert_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the per-expert tensors of ``model``'s ``FusedMoE`` layers,
    each copied into its expert's slice of the fused parameters."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    for name, tensor in weights:
        target = rename(name)
        match = _EXPERT_TENSOR.match(target) if target is not None else None
        layer = layers.get(match["layer"]) if match else None
        if layer is None or match["part"] not in _EXPERT_PARTS:
            yield name, tensor
            continue
        layer.load_expert(int(match["expert"]), _EXPERT_PARTS[match["part"]], tensor)


class MoEForCausalLM(LlamaForCausalLM):
    # (each rank holds its rows of every expert, and of a shared expert; with
    # --enable-expert-parallel its share of the experts instead)
    split_sizes = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    expert_count, expert_size = "num_experts", "moe_intermediate_size"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = take_kv_scales(self, self.prepare_weights(weights), self.checkpoint_name)
        weights = take_expert_weights(self, weights, self.checkpoint_name)
        loaded = copy_weights(self, weights, rename=self.checkpoint_name)
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                loaded |= {f"{name}.{param}" for param in module.filled_by_experts()}
        return loaded


# ---------------------------------------------------------------------------- Mixtral


class MixtralDecoderLayer(LlamaDecoderLayer):
    _native = False

    def make_mlp(self, config: Any, layer: int, quant, prefix: str) -> nn.Module:
        return SparseMoeBlock(
            config,
            quant,
            prefix,
            num_experts=config.num_local_experts,
            inter=config.intermediate_size,
            renormalize=True,
            weights_in_input_dtype=False,
        )


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    model_cls = MixtralModel
    supports_tensor_parallel = True
    expert_count, expert_size = "num_local_experts", "intermediate_size"

    def checkpoint_name(self, name: str) -> str | None:
        # (Mixtral's checkpoints name the block block_sparse_moe; transformers, mlp.)
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))


# -------------------------------------------------------------------- Qwen2/3-MoE


def _qwen_moe_mlp(layer: LlamaDecoderLayer, config: Any, index: int, quant, prefix: str):
    """A sparse block where the config puts one (every decoder_sparse_step-th layer not
    in mlp_only_layers), else a dense MLP of intermediate_size."""
    sparse = (
        index not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (index + 1) % config.decoder_sparse_step == 0
    )
    if not sparse:
        return LlamaMLP(config, quant, prefix)
    return SparseMoeBlock(
        config,
        quant,
        prefix,
        num_experts=config.num_experts,
        inter=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_input_dtype=True,
        shared_inter=getattr(config, "shared_expert_intermediate_size", None),
    )


class Qwen2MoeAttention(LlamaAttention):
    def biases(self, config: Any) -> tuple[bool, bool]:
        return bool(config.qkv_bias), False


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention
    _native = False
    make_mlp = _qwen_moe_mlp


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    model_cls = Qwen2MoeModel
    supports_tensor_parallel = True


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    _native = False
    make_mlp = _qwen_moe_mlp


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    model_cls = Qwen3MoeModel
    supports_tensor_parallel = True
