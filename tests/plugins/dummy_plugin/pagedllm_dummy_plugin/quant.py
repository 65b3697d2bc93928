"""A quantization method that quantizes a float checkpoint while it loads."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.interfaces import LinearMethod, QuantizationConfig


# [docs:quantization]
class Int8RowLinearMethod(LinearMethod):
    """Symmetric int8 weights with one float scale per output row, made from the float
    checkpoint at load time: the loader fills ``weight`` by its checkpoint name, then
    :meth:`process_weights_after_loading` replaces it with ``qweight`` and ``scale``."""

    def create_weights(self, layer, input_size, output_size, params_dtype):
        layer.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False
        )

    def quantize_into(self, layer: torch.nn.Module, weight: torch.Tensor) -> None:
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        qweight = (weight.float() / scale).round().clamp(-127, 127).to(torch.int8)
        layer.qweight = torch.nn.Parameter(qweight, requires_grad=False)
        layer.scale = torch.nn.Parameter(scale.to(weight.dtype), requires_grad=False)

    def process_weights_after_loading(self, layer):
        self.quantize_into(layer, layer.weight.data)
        del layer.weight  # only the int8 copy stays in memory

    def apply(self, layer, x, bias=None):
        weight = layer.qweight.to(x.dtype) * layer.scale.to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)


class Int8RowConfig(QuantizationConfig):
    name = "dummyq"

    def __init__(self, skip_prefixes: tuple[str, ...] = ()) -> None:
        self.skip_prefixes = tuple(skip_prefixes)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8RowConfig:
        unknown = set(config) - {"skip_prefixes"}
        if unknown:
            raise ValueError(f"dummyq does not understand {sorted(unknown)}")
        return cls(config.get("skip_prefixes", ()))

    def get_linear_method(self, layer, prefix):
        if self.skip_prefixes and prefix.startswith(self.skip_prefixes):
            return None  # this layer stays in floats
        return Int8RowLinearMethod()


# [/docs:quantization]
