"""Dequantization of fp8 and bitsandbytes weights as Triton kernels, for GPUs.

As for GGUF (:mod:`pagedllm.kernels.triton_gguf`), the weight stays packed on the GPU and
is decoded to float32 where it is used, then handed to the GEMM. Each kernel decodes with
the float32 operations of its torch reference (:mod:`pagedllm.kernels.fp8`,
:mod:`pagedllm.kernels.bnb`): the e4m3 bit move and one product with the scale; a
codebook look-up and one product with the block's absmax; an int8 widening and one
product with the row's scale. The tests check them bit for bit against those references
on CPU under ``TRITON_INTERPRET=1``.

Import this module freely; the kernels exist only when ``triton_available()``.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.quant_layouts import check_4bit, check_fp8
from pagedllm.kernels.triton_gguf import triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = [
    "triton_dequantize_4bit",
    "triton_dequantize_fp8",
    "triton_dequantize_int8",
]

# Each program decodes a tile of ROWS x COLS weights.
_ROWS = 16
_COLS = 64


if triton is not None:

    @triton.jit
    def _tile(n, k, ROWS: tl.constexpr, COLS: tl.constexpr):
        """This program's rows ``[ROWS, 1]``, columns ``[1, COLS]`` and in-bounds mask."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
        return rows, cols, (rows < n) & (cols < k)

    @triton.jit
    def _fp8_kernel(
        w_ptr, scale_ptr, out_ptr, n, k, groups, group_size,
        ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        rows, cols, mask = _tile(n, k, ROWS, COLS)
        b = tl.load(w_ptr + rows * k + cols, mask=mask, other=0).to(tl.int32)
        # e4m3fn -> float32 by moving bits (sign to 31, the rest to 20..26), then 2^120.
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        value = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
        scale = tl.load(scale_ptr + rows * groups + cols // group_size, mask=mask, other=0.0)
        tl.store(out_ptr + rows * k + cols, value * scale, mask=mask)

    @triton.jit
    def _4bit_kernel(
        w_ptr, absmax_ptr, code_ptr, out_ptr, n, k, groups, group_size,
        ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        rows, cols, mask = _tile(n, k, ROWS, COLS)
        b = tl.load(w_ptr + rows * (k // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
        index = tl.where(cols % 2 == 0, b >> 4, b & 0x0F)
        value = tl.load(code_ptr + index, mask=mask, other=0.0)
        absmax = tl.load(absmax_ptr + rows * groups + cols // group_size, mask=mask, other=0.0)
        tl.store(out_ptr + rows * k + cols, value * absmax, mask=mask)

    @triton.jit
    def _int8_kernel(w_ptr, scale_ptr, out_ptr, n, k, ROWS: tl.constexpr, COLS: tl.constexpr):
        rows, cols, mask = _tile(n, k, ROWS, COLS)
        q = tl.load(w_ptr + rows * k + cols, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=rows < n, other=0.0)
        tl.store(out_ptr + rows * k + cols, q * scale, mask=mask)


def _output(n: int, k: int, like: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    if not triton_available():
        raise RuntimeError("the Triton kernels need triton; install it with `pip install triton`")
    out = torch.empty(n, k, dtype=torch.float32, device=like.device)
    return out, (triton.cdiv(n, _ROWS), triton.cdiv(k, _COLS))


def triton_dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`pagedllm.kernels.fp8.dequantize_fp8_reference` by a Triton kernel (same
    float32 bits, then ``dtype``)."""
    check_fp8(weight, scale, group_size)
    n, k = weight.shape
    out, grid = _output(n, k, weight)
    if out.numel():
        _fp8_kernel[grid](
            weight.contiguous().view(torch.uint8), scale.float().contiguous(), out,
            n, k, scale.shape[1], group_size, ROWS=_ROWS, COLS=_COLS, enable_fp_fusion=False,
        )  # fmt: skip
    return out.to(dtype)


def triton_dequantize_4bit(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`pagedllm.kernels.bnb.dequantize_4bit_reference` by a Triton kernel (same
    float32 bits, then ``dtype``)."""
    k = check_4bit(packed, absmax, code)
    n, groups = absmax.shape
    out, grid = _output(n, k, packed)
    if out.numel():
        _4bit_kernel[grid](
            packed.contiguous(), absmax.float().contiguous(), code.float().contiguous(), out,
            n, k, groups, k // groups, ROWS=_ROWS, COLS=_COLS, enable_fp_fusion=False,
        )  # fmt: skip
    return out.to(dtype)


def triton_dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`pagedllm.kernels.bnb.dequantize_int8_reference` by a Triton kernel (same
    float32 bits, then ``dtype``)."""
    n, k = q.shape
    out, grid = _output(n, k, q)
    if out.numel():
        _int8_kernel[grid](
            q.contiguous(), scale.float().contiguous(), out, n, k,
            ROWS=_ROWS, COLS=_COLS, enable_fp_fusion=False,
        )  # fmt: skip
    return out.to(dtype)
