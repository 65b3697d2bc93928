"""The layouts of fp8 and bitsandbytes 4-bit weights, checked: shared by the torch
references and CPU kernels (:mod:`pagedllm.kernels.fp8`, :mod:`pagedllm.kernels.bnb`) and
the Triton kernels (:mod:`pagedllm.kernels.triton_quant`), which the former call on GPUs;
and :func:`read_4bit`, bitsandbytes' serialized 4-bit layers in that layout (shared by the
bitsandbytes load format and quantization method)."""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = [
    "ABSMAX_GROUP",
    "FP8_DTYPE",
    "QUANT_STATE",
    "check_4bit",
    "check_fp8",
    "needed_parts",
    "read_4bit",
    "state_meta",
]

FP8_DTYPE = torch.float8_e4m3fn
# Columns per absmax in pagedllm's layout: bitsandbytes' blocks (64 by default, or any
# multiple of 64) are expanded to it.
ABSMAX_GROUP = 64
QUANT_STATE = "quant_state.bitsandbytes__"


def check_fp8(weight: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    n, k = weight.shape
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"fp8 weights are {FP8_DTYPE}, not {weight.dtype}")
    if group_size < 1 or scale.dim() != 2 or tuple(scale.shape) != (n, -(-k // group_size)):
        raise ValueError(
            f"scales of shape {tuple(scale.shape)} do not fit a [{n}, {k}] weight in "
            f"groups of {group_size} columns"
        )


def check_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> int:
    """The weight's column count; a ValueError when the pieces do not fit together."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"4-bit weights are uint8 [n, k / 2], not {packed.dtype} {packed.dim()}-d")
    n, half = packed.shape
    k = 2 * half
    if absmax.dim() != 2 or absmax.shape[0] != n or not absmax.shape[1] or k % absmax.shape[1]:
        raise ValueError(
            f"absmax of shape {tuple(absmax.shape)} does not fit a [{n}, {k}] weight in "
            f"whole blocks of each row"
        )
    if code.numel() != 16:
        raise ValueError(f"a 4-bit codebook has 16 entries, not {code.numel()}")
    return k


def state_meta(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON description of a 4-bit layer (its ``quant_state.bitsandbytes__*`` tensor)."""
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode("utf-8"))


def needed_parts(state: torch.Tensor) -> set[str]:
    """The pieces of a 4-bit layer whose description is ``state``: with double
    quantization, the nested statistics too."""
    parts = {"weight", "absmax", "quant_map"}
    if "nested_blocksize" in state_meta(state):
        parts |= {"nested_absmax", "nested_quant_map"}
    return parts


def read_4bit(prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One 4-bit layer's tensors in pagedllm's layout, from bitsandbytes' serialized form:
    ``parts`` maps ``weight`` and the ``weight.<state>`` suffixes (``absmax``,
    ``quant_map``, ``nested_absmax``, ``nested_quant_map``,
    ``quant_state.bitsandbytes__nf4``) to their tensors. ``prefix`` names the layer in
    errors."""
    states = [name for name in parts if name.startswith(QUANT_STATE)]
    if len(states) != 1:
        raise ValueError(f"{prefix}: expected one {QUANT_STATE}* tensor, found {states}")
    meta = state_meta(parts[states[0]])
    out_features, in_features = meta["shape"]
    block = int(meta["blocksize"])
    if block % ABSMAX_GROUP or in_features % ABSMAX_GROUP:
        raise ValueError(
            f"{prefix}: 4-bit blocks of {block} weights over rows of {in_features}: pagedllm "
            f"reads blocks and rows that are multiples of {ABSMAX_GROUP} weights"
        )
    absmax = parts["absmax"]
    if "nested_absmax" in parts:  # double quantization: 8-bit absmax, blockwise again
        nested = int(meta["nested_blocksize"])
        index = torch.arange(absmax.numel()) // nested
        absmax = parts["nested_quant_map"].float()[absmax.long()] * parts["nested_absmax"].float()[
            index
        ] + float(meta["nested_offset"])
    absmax = absmax.float().reshape(-1)
    subblocks = out_features * in_features // ABSMAX_GROUP
    expanded = absmax[torch.arange(subblocks) * ABSMAX_GROUP // block]
    weight = parts["weight"]
    if weight.dtype != torch.uint8:
        raise ValueError(f"{prefix}: 4-bit weights stored as {weight.dtype}: pagedllm reads uint8")
    return {
        "weight": weight.reshape(out_features, in_features // 2),
        "weight_absmax": expanded.reshape(out_features, in_features // ABSMAX_GROUP),
        "weight_code": parts["quant_map"].float().reshape(16),
    }
