"""StarCoder2: the Llama family's layers with LayerNorms (biases included), biases on
every projection where ``use_bias``, a GELU MLP (``c_fc`` / ``c_proj``) and a sliding
window over every layer where ``sliding_window`` is set. Module names mirror Hugging
Face's ``Starcoder2ForCausalLM``."""

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


class Starcoder2Attention(LlamaAttention):
    def biases(self, config: Any) -> tuple[bool, bool]:
        return bool(config.use_bias), bool(config.use_bias)


class Starcoder2MLP(TwoLayerMLP):
    names = ("c_fc", "c_proj")

    def __init__(self, config: Any, quant, prefix: str) -> None:
        hidden, inner = config.hidden_size, config.intermediate_size
        super().__init__(hidden, inner, bool(config.use_bias), config.hidden_act, quant, prefix)


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Starcoder2Attention
    mlp_cls = Starcoder2MLP
    _native = False

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.norm_epsilon)


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model
    supports_tensor_parallel = True
    tie_by_default = True
