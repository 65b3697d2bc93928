"""float8_e4m3fn weights: quantization, the torch reference of their product, and the
CPU kernels (``csrc/fp8_cpu.c``) tested against it.

A weight is float8_e4m3fn ``[n, k]`` with float32 scales ``[n, groups]``: column ``kk``
of row ``j`` is ``weight[j, kk] * scale[j, kk // group_size]`` (``group_size`` is ``k``
for one group, the block width for block-wise scales). One group holds per-row
(per-channel) scales, or a per-tensor scale repeated on every row; several groups are the
column blocks of block-wise checkpoints (rows already expanded from row blocks).

CPUs have no fp8 arithmetic: activations stay in the model's dtype and weights are
widened per use (vLLM's weight-only fp8, as on GPUs without fp8 support). A product with
at most :data:`GEMV_MAX_ROWS` activation rows (decode) reads the fp8 bytes directly; a
larger one decodes the weight into the activations' dtype and hands it to torch's GEMM.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pagedllm.kernels import decoded_by_triton
from pagedllm.kernels.native import load_kernel_library
from pagedllm.kernels.quant_layouts import FP8_DTYPE, check_fp8

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GEMV_MAX_ROWS",
    "check_fp8",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize_fp8",
]

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
GEMV_MAX_ROWS = 8


def quantize_fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [n, k], float32 scale [n, 1])`` with ``weight ~= fp8 * scale``: the largest
    magnitude of the tensor (or of each row) maps to the format's largest value, 448."""
    w = weight.float()
    if per_channel:
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().expand(w.shape[0], 1)
    # An all-zero row or tensor keeps scale 1 (any scale would give zeros).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).contiguous()
    quantized = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_fp8_reference(
    weight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``weight * scale`` in float32, then ``dtype``: what the kernels compute."""
    check_fp8(weight, scale, group_size)
    k = weight.shape[1]
    full = scale if scale.shape[1] == 1 else scale.repeat_interleave(group_size, dim=1)[:, :k]
    return (weight.float() * full).to(dtype)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with the weight widened to ``x``'s dtype."""
    return F.linear(x, dequantize_fp8_reference(weight, scale, group_size, x.dtype), bias)


class _Fp8Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pagedllm_fp8_dequant.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i32, i32]
        lib.pagedllm_fp8_dequant.restype = i32
        lib.pagedllm_fp8_gemv.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i32]
        lib.pagedllm_fp8_gemv.restype = i32
        self.lib = lib


@functools.cache
def _kernels() -> _Fp8Kernels | None:
    lib = load_kernel_library("fp8_cpu")
    return None if lib is None else _Fp8Kernels(lib)


def _usable(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.is_contiguous()
        and scale.dtype == torch.float32
        and scale.is_contiguous()
    )


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_fp8_reference`, by the CPU kernel where it applies (float32 and
    bfloat16 on the cpu; bit-identical)."""
    kernels = _kernels()
    usable = dtype in (torch.float32, torch.bfloat16) and _usable(weight, scale)
    if kernels is None or not usable:
        return dequantize_fp8_reference(weight, scale, group_size, dtype)
    check_fp8(weight, scale, group_size)
    n, k = weight.shape
    groups = scale.shape[1]
    out = torch.empty(n, k, dtype=dtype)
    kernels.lib.pagedllm_fp8_dequant(
        weight.view(torch.uint8).data_ptr(),
        scale.data_ptr(),
        n,
        k,
        groups,
        group_size,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fp8_linear_reference` (the same up to the order of float32 sums): few rows
    by the fp8 product kernel, more by decoding the weight for torch's GEMM."""
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    kernels = _kernels()
    if decoded_by_triton(weight):
        from pagedllm.kernels.triton_quant import triton_dequantize_fp8

        return F.linear(x, triton_dequantize_fp8(weight, scale, group_size, x.dtype), bias)
    if kernels is None or not _usable(weight, scale) or x.device.type != "cpu":
        return fp8_linear_reference(x, weight, scale, group_size, bias)
    if not 1 <= rows <= GEMV_MAX_ROWS:
        return F.linear(x, dequantize_fp8(weight, scale, group_size, x.dtype), bias)
    check_fp8(weight, scale, group_size)
    n = weight.shape[0]
    x32 = x.reshape(rows, k).to(torch.float32).contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    kernels.lib.pagedllm_fp8_gemv(
        x32.data_ptr(),
        rows,
        k,
        weight.view(torch.uint8).data_ptr(),
        scale.data_ptr(),
        n,
        scale.shape[1],
        group_size,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
