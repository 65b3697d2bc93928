"""A linear layer whose storage and matmul a quantization method may take over."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedllm.core.interfaces import QuantizationConfig


class Linear(nn.Module):
    """``y = x @ W.T + b``. With a quantization config, the method it returns for this
    layer's ``prefix`` creates the parameters and computes the product."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.method = quant_config.get_linear_method(self, prefix) if quant_config else None
        dtype = torch.get_default_dtype()
        if self.method is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        else:
            self.method.create_weights(self, input_size, output_size, dtype)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            return F.linear(x, self.weight, self.bias)
        return self.method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class FusedLinear(nn.Module):
    """Several unquantized ``Linear`` layers reading the same input, computed as one GEMM
    (fewer, larger matmuls are much faster on CPUs). The original parameters become views
    into the fused weight, so no memory is duplicated and loading by name still works."""

    def __init__(self, linears: list[Linear]) -> None:
        super().__init__()
        self.sizes = [layer.output_size for layer in linears]
        weight = torch.cat([layer.weight.data for layer in linears])
        has_bias = [layer.bias is not None for layer in linears]
        bias = None
        if any(has_bias):
            bias = torch.cat(
                [
                    layer.bias.data if layer.bias is not None else weight.new_zeros(size)
                    for layer, size in zip(linears, self.sizes, strict=True)
                ]
            )
        offset = 0
        for layer, size in zip(linears, self.sizes, strict=True):
            layer.weight.data = weight[offset : offset + size]
            if layer.bias is not None:
                layer.bias.data = bias[offset : offset + size]
            offset += size
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def of(cls, linears: list[Linear]) -> nn.Module | None:
        """The fused layer, or None when they cannot be fused. Layers a quantization
        method owns are fused by that method (``fuse``), when it can."""
        methods = [layer.method for layer in linears]
        if all(method is None for method in methods):
            return cls(linears)
        fuse = getattr(methods[0], "fuse", None)
        if fuse is None or any(type(m) is not type(methods[0]) for m in methods):
            return None
        return fuse(linears)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
