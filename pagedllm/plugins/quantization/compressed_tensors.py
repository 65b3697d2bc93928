"""``--quantization compressed-tensors``: checkpoints saved by the compressed-tensors
library (llm-compressor's output), read by their ``quantization_config``:

- ``pack-quantized`` integer weights of 4 or 8 bits (W4A16, W8A16): ``weight_packed``
  int32 ``[out, in * bits / 32]`` (values offset to unsigned, lowest bits first),
  ``weight_scale`` ``[out, groups]``, ``weight_zero_point`` packed along the output rows
  when asymmetric, ``weight_g_idx`` with group activation ordering, ``weight_shape``;
- ``int-quantized`` 8-bit integer weights (W8A8-int8): ``weight`` int8 and
  ``weight_scale``;
- ``float-quantized`` fp8 weights (W8A8-fp8, FP8_DYNAMIC, FP8_BLOCK): ``weight``
  float8_e4m3fn with a per-tensor, per-channel or per-block ``weight_scale``.

Integer weights are repacked exactly into GGML blocks (:mod:`.int4`), fp8 ones kept as fp8
(:mod:`.fp8`). Schemes with activation quantization run weight-only on the CPU (their
activation settings are read and not used, which the log says once). Targets and
``ignore`` entries are module names, ``re:`` regular expressions or the class name
``Linear``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from pagedllm.core.interfaces import LinearMethod, QuantizationConfig
from pagedllm.plugins.quantization.common import checkpoint_param
from pagedllm.plugins.quantization.fp8 import Fp8Config, Fp8LinearMethod
from pagedllm.plugins.quantization.int4 import Int4LinearMethod, unpack_int32

logger = logging.getLogger("pagedllm.quantization")

_TOP_KEYS = {
    "config_groups",
    "format",
    "ignore",
    "kv_cache_scheme",
    "quantization_status",
    "sparsity_config",
    "transform_config",
    "global_compression_ratio",
    "version",
    "moe_sparsity_config",
}
_INT_FORMATS = ("pack-quantized", "int-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")


def _matches(pattern: str, prefix: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return pattern in ("Linear", prefix)


class CTIntMethod(Int4LinearMethod):
    """Integer weights of one scheme, repacked as :class:`Int4LinearMethod` does."""

    def __init__(self, config: CompressedTensorsConfig, args: dict[str, Any], fmt: str) -> None:
        super().__init__(config)
        self.bits = int(args["num_bits"])
        self.fmt = fmt
        self.symmetric = bool(args.get("symmetric", True))
        self.strategy = args.get("strategy") or "tensor"
        self.group_size = args.get("group_size") or 0
        self.g_idx = args.get("actorder") == "group"

    def _groups(self, in_features: int) -> int:
        return -(-in_features // self.group_size) if self.strategy == "group" else 1

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        groups = self._groups(input_size)
        scale_rows = 1 if self.strategy == "tensor" else output_size
        if self.fmt == "pack-quantized":
            per = 32 // self.bits
            layer.weight_packed = checkpoint_param(
                output_size, -(-input_size // per), dtype=torch.int32
            )
            layer.weight_shape = checkpoint_param(2, dtype=torch.int64)
            if not self.symmetric:
                layer.weight_zero_point = checkpoint_param(
                    -(-output_size // per), groups, dtype=torch.int32
                )
        else:
            layer.weight = checkpoint_param(output_size, input_size, dtype=torch.int8)
            if not self.symmetric:
                layer.weight_zero_point = checkpoint_param(scale_rows, groups, dtype=torch.int8)
        layer.weight_scale = checkpoint_param(scale_rows, groups, dtype=torch.float32)
        if self.g_idx:
            layer.weight_g_idx = checkpoint_param(input_size, dtype=torch.int32)
        layer.int4_dtype = params_dtype
        layer.ct_shape = (output_size, input_size)

    def _unpack(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        out_features, in_features = layer.ct_shape
        offset = 1 << (self.bits - 1)  # (values are stored offset to unsigned)
        if self.fmt == "pack-quantized":
            shape = tuple(int(v) for v in layer.weight_shape.data.tolist())
            if shape != (out_features, in_features):
                raise ValueError(f"weight_shape {shape} is not the layer's {layer.ct_shape}")
            q = unpack_int32(layer.weight_packed.data, 1, self.bits, in_features)
        else:
            q = layer.weight.data.to(torch.int32) + offset
        scales = layer.weight_scale.data.float().expand(out_features, -1)
        groups_n = scales.shape[1]
        if self.symmetric:
            zeros = torch.full((groups_n, out_features), offset, dtype=torch.int16)
        else:
            zp = layer.weight_zero_point.data
            if self.fmt == "pack-quantized":
                zp = unpack_int32(zp, 0, self.bits, out_features)
            else:
                zp = zp.to(torch.int32).expand(out_features, -1) + offset
            zeros = zp.T.to(torch.int16)
        if self.g_idx:
            groups = layer.weight_g_idx.data.long()
        elif self.strategy == "group":
            groups = torch.arange(in_features) // self.group_size
        else:
            groups = torch.zeros(in_features, dtype=torch.long)
        return q.T.to(torch.int16), zeros, scales.T.contiguous(), groups


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(
        self, schemes: list[tuple[list[str], dict, dict | None, str]], ignore: list[str]
    ) -> None:
        self.schemes = schemes
        self.ignore = ignore
        self._warned = False  # (Int4LinearMethod's warning: layers run dequantized)
        self._told_activations = False
        # One fp8 config per float-quantized scheme, so that its layers can fuse.
        self._fp8: dict[int, Fp8Config] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        if not config:
            raise ValueError(
                "compressed-tensors needs a checkpoint saved by compressed-tensors (its "
                "config.json's quantization_config); it does not quantize float weights"
            )
        unknown = sorted(set(config) - _TOP_KEYS)
        if unknown:
            raise ValueError(f"unknown compressed-tensors settings {unknown}")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_status {status!r}: only compressed checkpoints")
        for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
            if config.get(key):
                raise ValueError(f"{key}: sparse or transformed checkpoints are not read")
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or config.get("format")
            weights = group.get("weights")
            if not weights:
                raise ValueError(f"config group {name!r} quantizes no weights")
            kind, bits = weights.get("type"), weights.get("num_bits")
            strategy = weights.get("strategy") or "tensor"
            if strategy not in _STRATEGIES or weights.get("dynamic"):
                raise ValueError(f"config group {name!r}: weight strategy {strategy!r}")
            if kind == "int" and fmt in _INT_FORMATS and bits in (4, 8):
                if (fmt == "int-quantized" and bits != 8) or strategy == "block":
                    raise ValueError(f"config group {name!r}: {bits}-bit {strategy} {fmt}")
                if strategy == "group" and not weights.get("group_size"):
                    raise ValueError(f"config group {name!r}: group strategy without a size")
                if weights.get("actorder") not in (None, "group", "weight"):
                    raise ValueError(f"config group {name!r}: actorder {weights['actorder']}")
            elif kind == "float" and fmt == "float-quantized" and bits == 8:
                if strategy == "group":
                    raise ValueError(f"config group {name!r}: fp8 weights in groups")
            else:
                raise ValueError(
                    f"config group {name!r}: {bits}-bit {kind} weights in format {fmt!r} "
                    "(read: pack-quantized int 4/8, int-quantized int 8, float-quantized fp8)"
                )
            schemes.append(
                (list(group.get("targets") or []), weights, group.get("input_activations"), fmt)
            )
        if not schemes:
            raise ValueError("the checkpoint's quantization_config has no config_groups")
        return cls(schemes, list(config.get("ignore") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if any(_matches(pattern, prefix) for pattern in self.ignore):
            return None
        for index, (targets, weights, activations, fmt) in enumerate(self.schemes):
            if not any(_matches(target, prefix) for target in targets):
                continue
            if activations and not self._told_activations:
                self._told_activations = True
                logger.info(
                    "compressed-tensors: activations stay in the model's dtype on the cpu "
                    "(the checkpoint's activation quantization is not used)"
                )
            if weights["type"] == "float":
                if index not in self._fp8:
                    self._fp8[index] = _fp8_config(weights, activations)
                return Fp8LinearMethod(self._fp8[index])
            return CTIntMethod(self, weights, fmt)
        return None


def _fp8_config(weights: dict[str, Any], activations: dict[str, Any] | None) -> Fp8Config:
    """The fp8 method's settings for a float-quantized scheme (its tensor names)."""
    strategy = weights.get("strategy") or "tensor"
    static = bool(activations) and not activations.get("dynamic", True)
    block = weights.get("block_structure") if strategy == "block" else None
    config = Fp8Config(
        serialized=True,
        activation_scheme="static" if static else "dynamic",
        block=tuple(block) if block else None,
    )
    config.per_channel = strategy == "channel"
    config.block_scale_name = "weight_scale"
    config._told = True  # (the compressed-tensors config says it)
    return config
