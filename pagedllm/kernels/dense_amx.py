"""Products of many bfloat16 rows with a dense bfloat16 weight on Intel AMX tiles
(``csrc/dense_amx.c``), for the batched decode steps and the logits of unquantized
(safetensors) bfloat16 models on CPUs with AMX.

oneDNN's AMX GEMM behind ``F.linear`` re-lays the stored weight into the tiles' layout on
every call, which at tens of rows costs more than the product itself; the kernel takes
the weight as stored (as the tiles' A operand of the transposed product) and re-lays only
the activations. :func:`amx_linear` takes it for :data:`AMX_ROWS` rows (past that the
GEMM's re-laying is paid back, and it blocks for caches better; below, for 1-3 rows,
:mod:`pagedllm.kernels.dense_cpu`'s kernel is faster), and batch-invariant mode never comes here
(:func:`pagedllm.kernels.batch_invariant.linear` takes its panels first).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels.native import load_kernel_library

__all__ = ["AMX_ROWS", "AmxKernels", "amx_kernels", "amx_linear"]

# The row counts the kernel takes (the first is csrc's PAGEDLLM_AMX_MIN_ROWS, checked at
# load). Sapphire Rapids, one core, SmolLM2-135M's products of a 64-row step within the
# model (weights from memory): 35 ms against F.linear's 55 ms; from cache, 128 rows 10.9 /
# 15.6 ms, 256 rows 27.5 / 25.6 ms.
AMX_ROWS = range(4, 193)


class AmxKernels:
    """ctypes bindings of the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn = lib.pagedllm_dense_matmul_amx
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i32, i64, i32]
        fn.restype = i32
        lib.pagedllm_amx_available.argtypes = []
        lib.pagedllm_amx_available.restype = i32
        lib.pagedllm_amx_min_rows.restype = i32
        if lib.pagedllm_amx_min_rows() != AMX_ROWS.start:
            raise RuntimeError("dense_amx.c and AMX_ROWS disagree on the fewest rows")
        # Compiled with the tiles, and this process granted their state by the kernel.
        self.available = bool(lib.pagedllm_amx_available())
        self.lib = lib

    @staticmethod
    def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the kernel takes ``x @ weight.T``: bfloat16 ``x`` ``[m, k]`` (last
        dimension dense) and a contiguous bfloat16 ``weight`` ``[n, k]``, ``k`` a multiple
        of 32 and ``n`` of 16."""
        return (
            x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.dim() == 2
            and x.stride(1) == 1
            and weight.dim() == 2
            and weight.is_contiguous()
            and x.shape[1] == weight.shape[1]
            and weight.shape[1] % 32 == 0
            and weight.shape[0] % 16 == 0
        )

    def matmul(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor | None:
        """``x @ weight.T`` into ``out_dtype`` (bfloat16 or float32), or None where the
        kernel does not take it (:meth:`fits`, or no AMX)."""
        if not self.available or not self.fits(x, weight) or x.shape[0] == 0:
            return None
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"AMX products give bfloat16 or float32, not {out_dtype}")
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=out_dtype)
        status = self.lib.pagedllm_dense_matmul_amx(
            weight.data_ptr(),
            n,
            k,
            x.data_ptr(),
            m,
            x.stride(0),
            y.data_ptr(),
            int(out_dtype == torch.bfloat16),
            n,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("the AMX product could not allocate its activation tiles")
        return y if status == 0 else None


@functools.cache
def amx_kernels() -> AmxKernels | None:
    """The compiled kernels, or ``None`` (after one warning) when they cannot be built."""
    lib = load_kernel_library("dense_amx")
    return None if lib is None else AmxKernels(lib)


def amx_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` by the kernel where it applies (CPU bfloat16 tensors,
    :data:`AMX_ROWS` rows, see :meth:`AmxKernels.fits`), else None (the caller's GEMM; also
    while ``torch.compile`` traces, which a call into the library would split)."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or weight.requires_grad
        or x.shape[-1] == 0
        or x.numel() // x.shape[-1] not in AMX_ROWS
        or torch.compiler.is_compiling()
    ):
        return None
    kernels = amx_kernels()
    if kernels is None or not kernels.available:
        return None
    flat = x.reshape(-1, x.shape[-1])
    out = kernels.matmul(flat, weight)
    return None if out is None else out.reshape(*x.shape[:-1], weight.shape[0])
