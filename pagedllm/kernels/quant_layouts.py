"""The layouts of fp8 and bitsandbytes 4-bit weights, checked: shared by the torch
references and CPU kernels (:mod:`pagedllm.kernels.fp8`, :mod:`pagedllm.kernels.bnb`) and
the Triton kernels (:mod:`pagedllm.kernels.triton_quant`), which the former call on GPUs."""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "check_4bit", "check_fp8"]

FP8_DTYPE = torch.float8_e4m3fn


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
