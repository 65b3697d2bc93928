"""Products of a few rows with dense float32 / bfloat16 weights on the CPU
(``csrc/dense_cpu.c``), for decode steps of unquantized (safetensors) models.

A decode step reads every weight once for a handful of activation rows, so its products
are bound by memory bandwidth; the kernel streams each weight row once and meets every row
with it in registers (bfloat16 pairs with AVX512-BF16's dpbf16ps, float32 fused
multiply-adds with AVX-512F or AVX2, plain C elsewhere), where the BLAS GEMM behind
``F.linear`` reaches about half the bandwidth at one row. :func:`small_linear` takes it for
up to :func:`small_rows_max` rows (by dtype); more rows (prefills, large batches) stay on the
GEMM. On CPUs with AVX2 but not AVX-512 the kernel's tiles, blocked for the caches, take up
to 64 float32 and 128 bfloat16 rows (from 48 rows laying the weight out in packed panels
for an outer-product kernel with the same sums), and :func:`widened_linear` gives more
bfloat16 rows to the float32 GEMM: torch's bfloat16 GEMM has no vector path there. Those
larger float32 products (:func:`gemm_linear`) go to oneDNN's GEMM, the library vLLM's CPU
backend uses for its float products, rather than MKL's behind ``F.linear``.

Each output is one fixed chain of operations over the input features, whatever rows,
tiles or threads share the call (see the C file): a row's result does not depend on the
rest of the step, and the native decoder layer (:mod:`pagedllm.kernels.cpu_layer`), which
calls the same function, agrees with the modules bit for bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pagedllm.kernels.native import load_kernel_library

__all__ = [
    "SMALL_ROWS_MAX",
    "TILES_ROWS_MAX",
    "DenseCpuKernels",
    "dense_kernels",
    "gemm_linear",
    "small_linear",
    "small_rows_max",
    "widened_linear",
]

# Up to how many activation rows the kernel takes a product, by dtype: past that the BLAS
# GEMM, which reuses each weight tile over many rows (AMX tiles for bfloat16 where the CPU
# has them), is as fast. Sapphire Rapids, 2 cores, SmolLM2-135M's 121 products of a step
# from memory, ms: bfloat16 1 row 14.0 against torch's 20.5, 4 rows 17.4 / 23.7, 8 rows
# 23.7 / 22.8; float32 1 row 20.6 / 20.6, 4 rows 27.0 / 37.0, 16 rows 40.4 / 48.2.
SMALL_ROWS_MAX = {torch.bfloat16: 8, torch.float32: 16}
# The same with the AVX2 tiles (CPUs without AVX-512). Zen 3, 2 cores, SmolLM2-135M's
# products (3072 x 576, 576 x 1536, 960 x 576, 576 x 576), GFLOPS of the tiles / MKL's
# float32 GEMM: 32 rows 93-115 / 82-101, 64 rows 104-120 / 104-131, 128 rows 113-118 /
# 130-150, 1024 rows 114-117 / 160-174; the logits (49152 x 576) 102 / 71 at 64 rows.
# torch's bfloat16 GEMM stays under 10 GFLOPS there: more bfloat16 rows are widened for
# the float32 one (widened_linear).
# Float32 takes 64 rows: MKL's GEMM is only as fast there, re-lays the weight at every
# call, and a decode step of up to 64 rows then runs in the native decoder layer.
TILES_ROWS_MAX = {torch.bfloat16: 128, torch.float32: 64}
_DTYPES = (torch.float32, torch.bfloat16)


class DenseCpuKernels:
    """ctypes bindings of the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn = lib.pagedllm_dense_matmul_small
        fn.argtypes = [ptr, i32, i64, i64, ptr, i32, i64, i64, ptr, i32, i64, i32, i32]
        fn.restype = i32
        lib.pagedllm_dense_features.argtypes = []
        lib.pagedllm_dense_features.restype = i32
        features = lib.pagedllm_dense_features()
        # Vector float32 products (AVX-512F, or AVX2 with FMA); bfloat16 pairs (AVX512-BF16);
        # the AVX2 tiles, blocked for the caches (TILES_ROWS_MAX).
        self.simd, self.bf16, self.tiles = (
            bool(features & 1),
            bool(features & 2),
            bool(features & 4),
        )
        self.lib = lib

    def matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype | None = None,
        portable: bool = False,
    ) -> torch.Tensor:
        """``x @ weight.T`` for float32 or bfloat16 ``x`` ``[m, k]`` (rows of any stride,
        elements dense) and a contiguous float32 or bfloat16 ``weight`` ``[n, k]``, into
        ``out_dtype`` (default ``x``'s). ``portable`` takes the plain C path."""
        if weight.dtype not in _DTYPES or x.dtype not in _DTYPES:
            raise TypeError(
                f"dense products take float32 or bfloat16, not {x.dtype} x {weight.dtype}"
            )
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if out_dtype not in _DTYPES:
            raise TypeError(f"dense products give float32 or bfloat16, not {out_dtype}")
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("the weight must be a contiguous matrix")
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"activations of shape {tuple(x.shape)} for {k} input features")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, n, dtype=out_dtype)
        status = self.lib.pagedllm_dense_matmul_small(
            weight.data_ptr(),
            int(weight.dtype == torch.bfloat16),
            n,
            k,
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            m,
            x.stride(0),
            y.data_ptr(),
            int(out_dtype == torch.bfloat16),
            n,
            torch.get_num_threads(),
            int(portable),
        )
        if status != 0:
            raise MemoryError(f"no memory for the dense product's buffers ({m} x {k} rows)")
        return y


@functools.cache
def dense_kernels() -> DenseCpuKernels | None:
    """The compiled kernels, or ``None`` (after one warning) when they cannot be built."""
    lib = load_kernel_library("dense_cpu")
    return None if lib is None else DenseCpuKernels(lib)


@functools.cache
def _row_limits() -> dict[torch.dtype, int]:
    kernels = dense_kernels()
    return TILES_ROWS_MAX if kernels is not None and kernels.tiles else SMALL_ROWS_MAX


def small_rows_max(dtype: torch.dtype) -> int:
    """The most activation rows of ``dtype`` (float32 or bfloat16) :func:`small_linear`
    takes on this CPU."""
    return _row_limits()[dtype]


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the products the small-row kernel does not take:
    float32 CPU tensors by oneDNN's inner product (re-laying the weight at each call, as
    MKL's GEMM behind ``F.linear`` does: no second copy of the weight is kept), anything
    else (other dtypes, devices, autograd, torch.compile's graphs) by ``F.linear``.

    Zen 3, 2 cores, SmolLM2-135M's four layer products, GFLOPS of oneDNN / MKL (medians of
    15 alternating runs): 1024 rows 128 / 113, 512 rows 138 / 128, 256 rows 123 / 114, 128
    rows 101 / 86; a float32 prefill-only run (64 x 128 prompt tokens) 476 against 422
    total tok/s (medians of 4 alternating runs)."""
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (bias is not None and bias.dtype != torch.float32)
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or x.dim() < 2
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or torch.compiler.is_compiling()
        or not _onednn_available()
    ):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` for bfloat16 CPU rows and weight on CPUs with the AVX2 tiles
    (no AVX-512), past :func:`small_rows_max`: both widened to float32 for the float32 GEMM,
    the result rounded once to bfloat16; else None."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or weight.requires_grad
        or torch.compiler.is_compiling()
    ):
        return None
    kernels = dense_kernels()
    if kernels is None or not kernels.tiles:
        return None
    return gemm_linear(x.float(), weight.float()).to(torch.bfloat16)


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` by the kernel where it applies: CPU tensors, at most
    :func:`small_rows_max` rows, ``x`` and ``weight`` both float32 or both bfloat16, a
    contiguous weight; else None (the caller's GEMM)."""
    if (
        x.device.type != "cpu"
        # (a library call would split a graph torch.compile traces: its GEMM stays in it)
        or torch.compiler.is_compiling()
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or weight.dim() != 2
        or not weight.is_contiguous()
        or x.numel() > _row_limits()[x.dtype] * weight.shape[1]
        or x.shape[-1] != weight.shape[1]
        or x.numel() == 0
        or weight.requires_grad
    ):
        return None
    kernels = dense_kernels()
    if kernels is None:
        return None
    flat = x.reshape(-1, x.shape[-1])
    return kernels.matmul(flat, weight).reshape(*x.shape[:-1], weight.shape[0])
