"""bitsandbytes weights: the torch reference of their products and the CPU kernels
(``csrc/bnb_cpu.c``) tested against it.

- **4-bit** (NF4, FP4): uint8 ``[n, k // 2]``, two weights a byte (the first in the high
  nibble), each an index into a 16-entry float32 codebook (``quant_map``); column ``kk``
  of row ``j`` is ``code[index] * absmax[j, kk // group_size]``. This is bitsandbytes'
  flat layout of blocks of ``group_size`` weights, kept inside rows (``k`` a multiple of
  the block size), with a double-quantized ``absmax`` already decoded (as bitsandbytes
  decodes it before each product).
- **8-bit** (LLM.int8 checkpoints): int8 ``[n, k]`` with one float32 ``SCB`` a row (the
  row's largest magnitude): the weight is ``q * (SCB / 127)``.

Decoding is a look-up and one float32 product, exactly bitsandbytes' dequantization. A
product with at most :data:`GEMV_MAX_ROWS` activation rows (decode) reads the packed
bytes directly; a larger one decodes the weight into the activations' dtype for torch's
GEMM.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pagedllm.kernels import decoded_by_triton
from pagedllm.kernels.native import load_kernel_library
from pagedllm.kernels.quant_layouts import check_4bit

__all__ = [
    "GEMV_MAX_ROWS",
    "check_4bit",
    "dequantize_4bit",
    "dequantize_4bit_reference",
    "dequantize_int8",
    "dequantize_int8_reference",
    "int8_row_scale",
    "linear_4bit",
    "linear_4bit_reference",
    "linear_int8",
    "linear_int8_reference",
]

GEMV_MAX_ROWS = 8


def dequantize_4bit_reference(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``code[index] * absmax`` in float32, then ``dtype``: bitsandbytes'
    ``dequantize_4bit``."""
    k = check_4bit(packed, absmax, code)
    n, groups = absmax.shape
    index = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(n, k).long()
    values = code.float()[index].view(n, groups, k // groups) * absmax.float()[..., None]
    return values.view(n, k).to(dtype)


def linear_4bit_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return F.linear(x, dequantize_4bit_reference(packed, absmax, code, x.dtype), bias)


def int8_row_scale(scb: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row of an LLM.int8 weight: ``SCB * (1 / 127)``, as
    bitsandbytes computes it."""
    return (scb.float() * (1.0 / 127.0)).contiguous()


def dequantize_int8_reference(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``q * scale`` (a row's scale, :func:`int8_row_scale`) in float32, then ``dtype``:
    bitsandbytes' dequantization of row-wise int8 weights."""
    return (q.float() * scale[:, None]).to(dtype)


def linear_int8_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, dequantize_int8_reference(q, scale, x.dtype), bias)


class _BnbKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pagedllm_bnb4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i32, i32]
        lib.pagedllm_bnb4_dequant.restype = i32
        lib.pagedllm_bnb4_gemv.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, i32]
        lib.pagedllm_bnb4_gemv.restype = i32
        lib.pagedllm_int8_gemv.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]
        lib.pagedllm_int8_gemv.restype = i32
        lib.pagedllm_int8_dequant.argtypes = [ptr, ptr, i64, i64, ptr, i32, i32]
        lib.pagedllm_int8_dequant.restype = i32
        self.lib = lib


@functools.cache
def _kernels() -> _BnbKernels | None:
    lib = load_kernel_library("bnb_cpu")
    return None if lib is None else _BnbKernels(lib)


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


def dequantize_4bit(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_4bit_reference`, by the CPU kernel where it applies (float32 and
    bfloat16; bit-identical)."""
    kernels = _kernels()
    usable = (
        dtype in (torch.float32, torch.bfloat16)
        and _on_cpu(packed, absmax, code)
        and _float32(absmax)
        and _float32(code)
    )
    if kernels is None or not usable:
        return dequantize_4bit_reference(packed, absmax, code, dtype)
    k = check_4bit(packed, absmax, code)
    n, groups = absmax.shape
    if (k // groups) % 16:
        return dequantize_4bit_reference(packed, absmax, code, dtype)
    out = torch.empty(n, k, dtype=dtype)
    kernels.lib.pagedllm_bnb4_dequant(
        packed.data_ptr(),
        absmax.data_ptr(),
        code.data_ptr(),
        n,
        k,
        groups,
        k // groups,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def _rows(x: torch.Tensor, k: int) -> int:
    return x.numel() // k if k else 0


def linear_4bit(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`linear_4bit_reference` (the same up to the order of float32 sums): few rows
    by the 4-bit product kernel, more by decoding the weight for torch's GEMM."""
    k = check_4bit(packed, absmax, code)
    if decoded_by_triton(packed):
        from pagedllm.kernels.triton_quant import triton_dequantize_4bit

        return F.linear(x, triton_dequantize_4bit(packed, absmax, code, x.dtype), bias)
    rows = _rows(x, k)
    kernels = _kernels()
    group = k // absmax.shape[1]
    usable = (
        kernels is not None
        and _on_cpu(x, packed, absmax, code)
        and _float32(absmax)
        and _float32(code)
        and group % 16 == 0
    )
    if not usable:
        return linear_4bit_reference(x, packed, absmax, code, bias)
    if not 1 <= rows <= GEMV_MAX_ROWS:
        return F.linear(x, dequantize_4bit(packed, absmax, code, x.dtype), bias)
    n = packed.shape[0]
    x32 = x.reshape(rows, k).to(torch.float32).contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    status = kernels.lib.pagedllm_bnb4_gemv(
        x32.data_ptr(),
        rows,
        k,
        packed.data_ptr(),
        absmax.data_ptr(),
        code.data_ptr(),
        n,
        absmax.shape[1],
        group,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the 4-bit product kernel could not allocate its activations")
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_int8_reference`, by the CPU kernel where it applies (float32 and
    bfloat16; bit-identical)."""
    kernels = _kernels()
    usable = dtype in (torch.float32, torch.bfloat16) and _on_cpu(q, scale) and _float32(scale)
    if kernels is None or not usable:
        return dequantize_int8_reference(q, scale, dtype)
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype)
    kernels.lib.pagedllm_int8_dequant(
        q.data_ptr(),
        scale.data_ptr(),
        n,
        k,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def linear_int8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear_int8_reference` (the same up to the order of float32 sums): few rows
    by the int8 product kernel, more by decoding the weight for torch's GEMM."""
    if q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
        raise ValueError(
            f"8-bit weights are int8 [n, k] with [n] scales, not {q.dtype} "
            f"{tuple(q.shape)} with {tuple(scale.shape)}"
        )
    if decoded_by_triton(q):
        from pagedllm.kernels.triton_quant import triton_dequantize_int8

        return F.linear(x, triton_dequantize_int8(q, scale, x.dtype), bias)
    n, k = q.shape
    rows = _rows(x, k)
    kernels = _kernels()
    usable = kernels is not None and _on_cpu(x, q, scale) and _float32(scale)
    if not usable:
        return linear_int8_reference(x, q, scale, bias)
    if not 1 <= rows <= GEMV_MAX_ROWS:
        return F.linear(x, dequantize_int8(q, scale, x.dtype), bias)
    x32 = x.reshape(rows, k).to(torch.float32).contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    kernels.lib.pagedllm_int8_gemv(
        x32.data_ptr(),
        rows,
        k,
        q.data_ptr(),
        scale.data_ptr(),
        n,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
