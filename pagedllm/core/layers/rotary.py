"""Rotary embedding tables computed exactly as Hugging Face computes them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.kernels.rotary import apply_rotary

# RoPE types whose frequencies do not depend on the sequence being processed.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings; models with per-layer-type RoPE (Gemma 3) keep one dict per
    ``layer_type`` (``full_attention``/``sliding_attention``)."""
    params = getattr(config, "rope_parameters", None)
    if params is not None and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(
    config: Any, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` for the config's RoPE type."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"RoPE type {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); set --rope-scaling to change it"
        )
    if rope_type == "default":
        base = params["rope_theta"]
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if layer_type is not None:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table for positions ``[0, max_positions)``."""

    def __init__(
        self, config: Any, head_dim: int, max_positions: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self._gathered: tuple | None = None
        self._checked: torch.Tensor | None = None

    def check_positions(self, positions: torch.Tensor) -> None:
        """An IndexError unless every position has a row in the table. Compiled kernels
        read the rows by position unchecked; every layer of a step passes the same
        tensor, so it is checked once per step."""
        if positions is self._checked:
            return
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise IndexError(
                f"position {int(positions.max())} is past the rotary table "
                f"({self.cos.shape[0]} positions)"
            )
        self._checked = positions

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query``/``key`` ``[T, heads, head_dim]`` by their ``positions``.

        Float32 and bfloat16 CPU tensors whose heads are adjacent are rotated in place by
        the compiled kernel, GPU ones by the Triton kernel (both bit-exact with
        :func:`apply_rotary`); others by the torch reference."""
        if (
            query.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and _heads_dense(query)
            and _heads_dense(key)
            and key.dtype == query.dtype
            and positions.dtype == torch.long
            and positions.is_contiguous()
        ):
            ops = cpu_ops()
            if ops is not None and self.cos.dtype == torch.float32:
                self.check_positions(positions)
                ops.rotary_neox_(query, key, positions, self.cos, self.sin, self.rotary_dim)
                return query, key
        if (
            query.device.type == "cuda"
            and _heads_adjacent(query)
            and _heads_adjacent(key)
            and key.dtype == query.dtype
            and positions.dtype == torch.long
            and positions.is_contiguous()
            and self.cos.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and _triton_available()
        ):
            # In place, bit for bit apply_rotary's. Unchecked positions: the model runner
            # gives positions below --max-model-len, the table's length.
            from pagedllm.kernels.triton_attention import triton_rotary_neox_

            triton_rotary_neox_(query, key, positions, self.cos, self.sin, self.rotary_dim)
            return query, key
        # Every layer of a step passes the same positions tensor: gather once per step.
        cached = self._gathered
        if cached is not None and cached[0] is positions and cached[1] == query.dtype:
            cos, sin = cached[2], cached[3]
        else:
            cos = self.cos[positions].to(query.dtype)
            sin = self.sin[positions].to(query.dtype)
            self._gathered = (positions, query.dtype, cos, sin)
        return (
            apply_rotary(query, cos, sin, self.rotary_dim),
            apply_rotary(key, cos, sin, self.rotary_dim),
        )


def _heads_adjacent(x: torch.Tensor) -> bool:
    """``[T, heads, d]`` with each token's heads side by side and dense."""
    return x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def _heads_dense(x: torch.Tensor) -> bool:
    """``[T, heads, d]`` float32 or bfloat16 with each token's heads side by side."""
    return (
        x.dim() == 3
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.stride(2) == 1
        and (x.shape[1] == 1 or x.stride(1) == x.shape[2])
    )


def _triton_available() -> bool:
    # Imported on a GPU's first call only: triton costs a CPU server 70 MB and 70 ms.
    from pagedllm.kernels.triton_attention import triton_available

    return triton_available()
