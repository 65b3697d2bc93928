"""``--quantization fp8`` and ``--quantization fbgemm_fp8``: float8_e4m3fn weights with
float32 scales.

- ``fp8`` on a float checkpoint quantizes every linear weight at load with one scale per
  tensor (vLLM's online fp8); on a checkpoint whose ``quantization_config`` says fp8 it
  reads ``weight`` (float8_e4m3fn) with ``weight_scale`` (one per tensor) or, with
  ``weight_block_size``, ``weight_scale_inv`` (one per block of the weight, the layout
  of transformers' fine-grained fp8 and of DeepSeek's checkpoints).
- ``fbgemm_fp8`` is the same with one scale per output row (``weight_scale`` ``[out, 1]``),
  read from a checkpoint or computed at load.

The CPU has no fp8 arithmetic, so activations stay in the model's dtype and the weights
are widened per use (:mod:`pagedllm.kernels.fp8`): weight-only fp8, as vLLM runs fp8
checkpoints on GPUs without fp8 support. A checkpoint's activation settings
(``activation_scheme``, static ``input_scale`` tensors, ``activation_scale_ub``) are
therefore read and not used, which the log says once. Vocabulary embeddings and the
``lm_head`` stay in floats, as in vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.core.interfaces import LinearMethod, QuantizationConfig
from pagedllm.core.layers.linear import restack_rows, share_rows
from pagedllm.kernels.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8
from pagedllm.plugins.quantization.common import checkpoint_param, left_in_floats

logger = logging.getLogger("pagedllm.quantization")

_ACTIVATION_SCHEMES = ("dynamic", "static")


class Fp8Config(QuantizationConfig):
    name = "fp8"
    # Scales computed at load: one per tensor (fp8) or per output row (fbgemm_fp8).
    per_channel = False
    # What a checkpoint with weight_block_size calls its block scales.
    block_scale_name = "weight_scale_inv"

    def __init__(
        self,
        *,
        serialized: bool,
        activation_scheme: str = "dynamic",
        block: tuple[int, int] | None = None,
        ignored: Sequence[str] = (),
    ) -> None:
        self.serialized = serialized
        self.activation_scheme = activation_scheme
        self.block = block
        self.ignored = tuple(ignored)
        self._told = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        """An empty ``config`` (``--quantization fp8`` on a float checkpoint) quantizes
        at load; a checkpoint's fp8 ``quantization_config`` is read as it is written."""
        if not config:
            return cls(serialized=False)
        config = dict(config)
        known = {
            "activation_scheme",
            "weight_block_size",
            "ignored_layers",
            "modules_to_not_convert",
            "fmt",
            # (says the checkpoint holds k_scale / v_scale for an fp8 KV cache: read with
            # the weights, used with --kv-cache-dtype fp8)
            "kv_cache_scheme",
        }
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown fp8 settings {unknown} (known: {sorted(known)})")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 weights in {fmt!r}: only e4m3 (float8_e4m3fn) is read")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in _ACTIVATION_SCHEMES:
            raise ValueError(
                f"activation_scheme {scheme!r} is not one of {list(_ACTIVATION_SCHEMES)}"
            )
        block = config.get("weight_block_size")
        if block is not None:
            if (
                not isinstance(block, list | tuple)
                or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)
            ):
                raise ValueError(f"weight_block_size must be two positive ints, not {block!r}")
            if scheme == "static":
                raise ValueError("block-wise fp8 weights come with dynamic activations only")
            block = (block[0], block[1])
        ignored = [
            *(config.get("ignored_layers") or []),
            *(config.get("modules_to_not_convert") or []),
        ]
        return cls(serialized=True, activation_scheme=scheme, block=block, ignored=ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if left_in_floats(prefix, self.ignored):
            return None
        if not self._told:
            self._told = True
            logger.info(
                "%s weights: activations stay in the model's dtype (the cpu has no fp8 "
                "arithmetic)%s",
                self.name,
                "; the checkpoint's activation scales are not used" if self.serialized else "",
            )
        return Fp8LinearMethod(self)


class FbgemmFp8Config(Fp8Config):
    name = "fbgemm_fp8"
    per_channel = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FbgemmFp8Config:
        if not config:
            return cls(serialized=False)
        known = {"activation_scale_ub", "modules_to_not_convert"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown fbgemm_fp8 settings {unknown} (known: {sorted(known)})")
        return cls(serialized=True, ignored=config.get("modules_to_not_convert") or [])


class Fp8LinearMethod(LinearMethod):
    """One fp8 weight. After loading, every layer holds ``weight`` (float8_e4m3fn
    ``[out, in]``) and ``fp8_scale`` (float32 ``[out, groups]``, groups of
    ``fp8_group`` columns) whatever the checkpoint's scale layout."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: Any
    ) -> None:
        config = self.config

        layer.fp8_fused = None  # the Fp8FusedLinear computing this layer, if any
        if not config.serialized:
            layer.weight = checkpoint_param(output_size, input_size, dtype=params_dtype)
            return
        layer.weight = checkpoint_param(output_size, input_size, dtype=FP8_DTYPE)
        if config.block is not None:
            rows, cols = config.block
            blocks = checkpoint_param(-(-output_size // rows), -(-input_size // cols))
            setattr(layer, config.block_scale_name, blocks)
        elif config.per_channel:
            layer.weight_scale = checkpoint_param(output_size, 1)
        else:
            layer.weight_scale = checkpoint_param()
        if config.activation_scheme == "static":
            layer.input_scale = checkpoint_param()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        config = self.config
        weight = layer.weight.data
        out_features, in_features = weight.shape
        if not config.serialized:
            quantized, scale = quantize_fp8(weight, per_channel=config.per_channel)
            layer.weight = nn.Parameter(quantized, requires_grad=False)
            group = in_features
        elif config.block is not None:
            rows, cols = config.block
            blocks = getattr(layer, config.block_scale_name).data.float()
            scale = blocks.repeat_interleave(rows, dim=0)[:out_features].contiguous()
            group = cols
            delattr(layer, config.block_scale_name)
        else:
            scale = layer.weight_scale.data.float().reshape(-1, 1).expand(out_features, 1)
            group = in_features
            del layer.weight_scale
        if hasattr(layer, "input_scale"):
            del layer.input_scale  # (weight-only: see the module's docstring)
        layer.fp8_scale = scale.contiguous()
        layer.fp8_group = group
        if layer.fp8_fused is not None:
            layer.fp8_fused.layer_ready()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.fp8_scale, layer.fp8_group, bias)

    def fuse(self, layers: Sequence[nn.Module]) -> nn.Module | None:
        """One fp8 product for layers that read the same input (Q/K/V, gate/up), all or
        none with a bias. Their rows are independent, each with its own scales, so the
        fused weight is theirs stacked (and their weights become its row slices)."""
        if len({layer.bias is not None for layer in layers}) != 1:
            return None
        if any(layer.method.config is not self.config for layer in layers):
            return None
        return Fp8FusedLinear(layers)


class Fp8FusedLinear(nn.Module):
    """Layers of one fp8 config reading the same input, as one product; outputs split in
    order. A checkpoint's fp8 weights load straight into the stacked weight (the layers'
    weights are its row slices); weights quantized at load are stacked once the last
    layer is quantized, and the float copy is dropped."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = tuple(layers)  # (not registered: they live where the model put them)
        self.sizes = [layer.weight.shape[0] for layer in layers]
        self._waiting = len(layers)
        weight, bias = share_rows(layers, self.sizes)
        for layer in layers:
            layer.fp8_fused = self
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.group = 0

    def layer_ready(self) -> None:
        """One of the layers has its fp8 weight and scales; after the last, stack them."""
        self._waiting -= 1
        if self._waiting:
            return
        groups = {layer.fp8_group for layer in self.layers}
        if len(groups) != 1:
            raise ValueError(f"fused fp8 layers with different column groups: {groups}")
        self.group = groups.pop()
        self.scale = restack_rows(self.layers, self.sizes, "fp8_scale")
        if self.weight.dtype != FP8_DTYPE:
            # Quantized at load: each layer's weight is a new tensor; stack them in place
            # of the float one.
            self.weight = restack_rows(self.layers, self.sizes, "weight")

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = fp8_linear(x, self.weight, self.scale, self.group, self.bias)
        return list(out.split(self.sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"
