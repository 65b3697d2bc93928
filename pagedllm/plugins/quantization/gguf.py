"""``--quantization gguf``: GGUF weights kept packed in memory, dequantized on the fly.

The GGUF loader chooses it for every ``.gguf`` checkpoint (as vLLM does) and passes the
GGML type of each weight as ``quantization_config["tensor_types"]`` (parameter name ->
type). Linear layers and the vocabulary embedding whose weight is listed keep it as uint8
``[rows, bytes_per_row]``; everything else (norms, float32 tensors) stays in floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.core.interfaces import EmbeddingMethod, LinearMethod, QuantizationConfig
from pagedllm.core.layers.linear import share_rows
from pagedllm.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from pagedllm.kernels.gguf_dequant import SUPPORTED_TYPES, bytes_per_row
from pagedllm.kernels.gguf_matmul import activation_mode, gguf_embedding, gguf_linear


class GGUFLinearMethod(LinearMethod):
    """One packed GGML weight; ``x @ W.T`` through :func:`gguf_linear`."""

    # (gguf_linear takes the panel kernels at every row count in batch-invariant mode)
    batch_invariant = True

    def __init__(self, qtype: GGMLQuantizationType) -> None:
        self.qtype = qtype

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        row_bytes = bytes_per_row(self.qtype, input_size)
        layer.weight = nn.Parameter(
            torch.empty(output_size, row_bytes, dtype=torch.uint8), requires_grad=False
        )
        layer.gguf_shape = (output_size, input_size)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out_features, in_features = layer.gguf_shape
        return gguf_linear(x, layer.weight, self.qtype, out_features, in_features, bias)

    def shard_narrow(self, dim: int, start: int, length: int) -> tuple[int, int, int] | None:
        """Rows are independent; columns split at whole quantization blocks only (32
        values, 256 for the K-quants), as bytes of each packed row."""
        if dim == 0:
            return (0, start, length)
        block_size = GGML_QUANT_SIZES[self.qtype][0]
        if start % block_size or length % block_size:
            return None
        return (1, bytes_per_row(self.qtype, start), bytes_per_row(self.qtype, length))

    def fuse(self, layers: Sequence[nn.Module]) -> nn.Module | None:
        """One packed weight for layers that read the same input (Q/K/V, gate/up) when
        they share a GGML type and all or none have a bias: one matmul call instead of
        several. Rows of a GGML weight are independent, so the layers' own weights are
        row slices of the fused one."""
        methods = [layer.method for layer in layers]
        if any(m.qtype != self.qtype for m in methods):
            return None
        if len({layer.bias is not None for layer in layers}) != 1:
            return None
        if len({layer.gguf_shape[1] for layer in layers}) != 1:
            return None
        return PackedFusedLinear(layers, self.qtype)


class PackedFusedLinear(nn.Module):
    """Several packed layers of one GGML type computed as one: outputs split in order.
    (It has no ``gguf_shape``: the layers it computes still describe the weights.)"""

    def __init__(self, layers: Sequence[nn.Module], qtype: GGMLQuantizationType) -> None:
        super().__init__()
        self.qtype = qtype
        self.sizes = [layer.gguf_shape[0] for layer in layers]
        self.in_features = layers[0].gguf_shape[1]
        weight, bias = share_rows(layers, self.sizes)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = gguf_linear(x, self.weight, self.qtype, sum(self.sizes), self.in_features, self.bias)
        return list(out.split(self.sizes, dim=-1))


class GGUFEmbeddingMethod(GGUFLinearMethod, EmbeddingMethod):
    """A packed vocabulary table: looked-up rows are dequantized, a tied head multiplies
    with the packed table."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        super().create_weights(layer, input_size, output_size, params_dtype)
        # The model may run in a dtype set later than construction; remember it now.
        layer.gguf_dtype = params_dtype

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        _, dim = layer.gguf_shape
        return gguf_embedding(ids, layer.weight, self.qtype, dim, layer.gguf_dtype)


# Types kept packed. F32 weights are plain float parameters; F16/BF16 stay in their
# 2 bytes and are widened per use, as the quantized types are.
PACKED_TYPES = frozenset(SUPPORTED_TYPES - {GGMLQuantizationType.F32})


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, tensor_types: dict[str, GGMLQuantizationType]) -> None:
        self.tensor_types = tensor_types

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        unknown = set(config) - {"tensor_types"}
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)} (gguf takes none)")
        # PAGEDLLM_GGUF_ACTIVATIONS is read for every product; a bad value is refused
        # here, at start-up, rather than by the first step.
        activation_mode()
        if "tensor_types" not in config:
            raise ValueError(
                "gguf quantization needs a GGUF checkpoint: pass a .gguf file (or a "
                "directory holding one) as the model; its weights stay quantized"
            )
        types = {}
        for name, qtype in config["tensor_types"].items():
            try:
                types[name] = GGMLQuantizationType(int(qtype))
            except ValueError:
                raise ValueError(f"weight {name!r} has an unknown GGML type {qtype!r}") from None
        return cls(types)

    def _packed_type(self, prefix: str) -> GGMLQuantizationType | None:
        qtype = self.tensor_types.get(f"{prefix}.weight")
        return qtype if qtype in PACKED_TYPES else None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        qtype = self._packed_type(prefix)
        return GGUFLinearMethod(qtype) if qtype is not None else None

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethod | None:
        qtype = self._packed_type(prefix)
        return GGUFEmbeddingMethod(qtype) if qtype is not None else None
