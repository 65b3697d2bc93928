"""The attention layer models use. The computation belongs to the step's attention
backend (``metadata.backend``), chosen by the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_index: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads cannot share {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        # Scores become cap * tanh(score / cap) before the softmax (Gemma 2); backends
        # that honour it say so (AttentionBackend.logits_soft_cap), the engine refuses
        # the others.
        self.logits_soft_cap = logits_soft_cap
        # An fp8 KV cache stores keys / k_scale and values / v_scale; with
        # --calculate-kv-scales the engine sets calculate_kv_scales and the backend
        # replaces both from the layer's first batch.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calculate_kv_scales = False

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """``query`` ``[T, heads*d]``, ``key``/``value`` ``[T, kv_heads*d]`` -> ``[T, heads*d]``."""
        if torch.compiler.is_compiling():
            # Under -O: the backend's own kernels, between the compiled pieces.
            assert _uncompiled is not None, "prepare_compile() runs before torch.compile"
            return _uncompiled(self, query, key, value, metadata)
        return metadata.backend.forward(self, query, key, value, metadata)


def _attend_uncompiled(
    layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any
) -> torch.Tensor:
    return metadata.backend.forward(layer, query, key, value, metadata)


# _attend_uncompiled under torch.compiler.disable, made by prepare_compile(): the decorator
# imports torch._dynamo (over 1 s of every start), which only a compiled model needs.
_uncompiled: Callable[..., torch.Tensor] | None = None


def prepare_compile() -> None:
    """Make the attention layers' escape from torch.compile; call before compiling."""
    global _uncompiled
    if _uncompiled is None:
        _uncompiled = torch.compiler.disable(_attend_uncompiled)


def set_kv_scales(model: torch.nn.Module, cache_config: Any, kv_dtype: torch.dtype) -> None:
    """The scales an fp8 KV cache stores keys and values with, on every attention layer
    of ``model`` (each tensor-parallel rank's): computed from the first batch with
    ``--calculate-kv-scales``, else the checkpoint's own where it was quantized for an
    fp8 cache (1.0 otherwise)."""
    for module in model.modules():
        if not isinstance(module, Attention):
            continue
        if cache_config.calculate_kv_scales:
            module.calculate_kv_scales = True
        elif kv_dtype == torch.float8_e4m3fn:
            module.k_scale = getattr(module, "checkpoint_k_scale", 1.0)
            module.v_scale = getattr(module, "checkpoint_v_scale", 1.0)
