"""The compiled CPU kernels for GGUF weights (``csrc/gguf_cpu.c``), built on first use
(:mod:`pagedllm.kernels.native`). Without them callers fall back to the torch reference
(:mod:`pagedllm.kernels.gguf_dequant`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from pagedllm.kernels.ggml_types import GGMLQuantizationType
from pagedllm.kernels.gguf_dequant import check_raw
from pagedllm.kernels.native import load_kernel_library

__all__ = ["FUSED_TYPES", "GGUFCpuKernels", "cpu_kernels"]


# The GGML types with fused kernels (panels, small-row products, and the optional 8-bit and
# bfloat16 products): Q4_0, Q4_1, Q8_0 (``fused_layout`` in csrc/gguf_cpu.c).
FUSED_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
)


class GGUFCpuKernels:
    """ctypes bindings of the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pagedllm_gguf_supported.argtypes = [i32]
        lib.pagedllm_gguf_supported.restype = i32
        lib.pagedllm_gguf_dequant.argtypes = [i32, ptr, i64, i64, i64, ptr, i32]
        lib.pagedllm_gguf_dequant.restype = i32
        lib.pagedllm_gguf_matmul.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32]
        lib.pagedllm_gguf_matmul.restype = i32
        lib.pagedllm_gguf_matmul_q8.argtypes = lib.pagedllm_gguf_matmul.argtypes
        lib.pagedllm_gguf_matmul_q8.restype = i32
        lib.pagedllm_gguf_matmul_q8p.argtypes = [*lib.pagedllm_gguf_matmul.argtypes, i32, i32]
        lib.pagedllm_gguf_matmul_q8p.restype = i32
        lib.pagedllm_gguf_matmul_bf16.argtypes = [*lib.pagedllm_gguf_matmul.argtypes, i32]
        lib.pagedllm_gguf_matmul_bf16.restype = i32
        lib.pagedllm_gguf_matmul_panels.argtypes = [*lib.pagedllm_gguf_matmul.argtypes, i32, i32]
        lib.pagedllm_gguf_matmul_panels.restype = i32
        lib.pagedllm_dense_matmul_panels.argtypes = [ptr, i32, i64, i64, ptr, i64, i64, ptr]
        lib.pagedllm_dense_matmul_panels.argtypes += [i64, i32, i32, i32]
        lib.pagedllm_dense_matmul_panels.restype = i32
        lib.pagedllm_gguf_features.argtypes = []
        lib.pagedllm_gguf_features.restype = i32
        features = lib.pagedllm_gguf_features()
        # The build's panel product of many rows (AVX-512, or AVX2 with FMA) and its
        # bfloat16 one (AVX512-BF16).
        self.row_tiles, self.bf16 = bool(features & 1), bool(features & 2)
        # The 8-bit products in panels (AVX512-VNNI).
        self.q8_panels = bool(features & 4)
        lib.pagedllm_gguf_q8_tiles.argtypes = [i32]
        lib.pagedllm_gguf_q8_tiles.restype = i32
        # ... and those products of 8 rows or more on AMX tiles, bit-identical to the panels.
        self.q8_tiles = bool(lib.pagedllm_gguf_q8_tiles(1))
        self.lib = lib

    def use_q8_tiles(self, on: bool) -> bool:
        """Turns the AMX tiles of the 8-bit products on or off (tests compare the two);
        returns whether they are now used."""
        return bool(self.lib.pagedllm_gguf_q8_tiles(int(on)))

    def supports(self, qtype: int) -> bool:
        return bool(self.lib.pagedllm_gguf_supported(int(qtype)))

    def dequantize(self, raw: torch.Tensor, qtype: int, rows: int, k: int) -> torch.Tensor:
        """float32 ``[rows, k]`` from uint8 ``[rows, row_bytes]`` (contiguous, on the cpu)."""
        check_raw(raw, qtype, (rows, k))  # the kernel trusts the sizes it is given
        raw = raw.contiguous().view(rows, -1)
        out = torch.empty(rows, k, dtype=torch.float32)
        status = self.lib.pagedllm_gguf_dequant(
            int(qtype),
            raw.data_ptr(),
            rows,
            raw.shape[-1],
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"GGML type {qtype} is not supported by the CPU kernels")
        return out

    def matmul(
        self, x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int
    ) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x`` ``[m, k]`` and packed ``W`` ``[n, row_bytes]``."""
        y, status = self._product(self.lib.pagedllm_gguf_matmul, x, raw, qtype, n, k)
        if status == -1:
            raise ValueError(f"GGML type {qtype} is not supported by the CPU kernels")
        if status != 0:
            raise MemoryError("the GGUF matmul could not allocate its row buffer")
        return y

    def matmul_q8(
        self, x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int
    ) -> torch.Tensor | None:
        """``x @ W.T`` with ``x`` quantized to 8 bits per block of 32 and integer dot
        products (Q4_0, Q4_1, Q8_0 weights on AVX2 or newer); None where it does not apply
        (another type, or a CPU without AVX2)."""
        return self._optional_product(
            self.lib.pagedllm_gguf_matmul_q8, "8-bit", x, raw, qtype, n, k
        )

    def matmul_q8_panels(
        self,
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """``matmul_q8``'s product (the same quantization and integer sums) in panels, for
        float32 or bfloat16 ``x`` (widened exactly), in float32 or in bfloat16 rounded as
        ``.to()`` rounds; None where it does not apply (another type, or a CPU without
        AVX512-VNNI)."""
        return self._rows_product(
            self.lib.pagedllm_gguf_matmul_q8p,
            "matmul_q8_panels",
            "8-bit",
            (torch.float32, torch.bfloat16),
            x,
            raw,
            qtype,
            n,
            k,
            out_dtype,
            int(x.dtype == torch.bfloat16),
        )

    def matmul_bf16(
        self,
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """``x @ W.T`` for bfloat16 ``x`` ``[m, k]``, the weights rounded to bfloat16 and
        multiplied in pairs into float32 sums (AVX512-BF16's dpbf16ps), as a bfloat16 GEMM
        of the dequantized weight computes (one row: the float32 row kernel's product of
        the exact widening, unrounded weights); in float32, or in bfloat16 rounded as
        ``.to()`` rounds. None where it does not apply (not Q4_0/Q4_1/Q8_0, or a CPU
        without AVX512-BF16)."""
        return self._rows_product(
            self.lib.pagedllm_gguf_matmul_bf16,
            "matmul_bf16",
            "bfloat16",
            (torch.bfloat16,),
            x,
            raw,
            qtype,
            n,
            k,
            out_dtype,
        )

    def matmul_panels(
        self,
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """``x @ W.T`` in panels at every row count, one row included (the product of
        :meth:`matmul` or :meth:`matmul_bf16` from a few rows on): each output one chain of
        multiply-adds over ``k`` whatever rows share the call. float32 ``x`` into float32,
        or bfloat16 ``x`` (AVX512-BF16) into float32 or bfloat16; None where it does not
        apply (not Q4_0/Q4_1/Q8_0, or no panels in this build)."""
        bf16 = x.dtype == torch.bfloat16
        return self._rows_product(
            self.lib.pagedllm_gguf_matmul_panels,
            "matmul_panels",
            "panel",
            (torch.float32, torch.bfloat16),
            x,
            raw,
            qtype,
            n,
            k,
            out_dtype,
            int(bf16),
        )

    def matmul_dense(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        """``x @ weight.T`` for a dense float32 or bfloat16 ``weight`` ``[n, k]`` in the
        panels of :meth:`matmul_panels` (each output one chain of multiply-adds over ``k``,
        whatever rows share the call): float32 ``x`` into float32, or bfloat16 ``x`` with a
        bfloat16 weight of even ``k`` (AVX512-BF16) into float32 or bfloat16. None where it
        does not apply (no panels in this build, or those dtypes there)."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
            raise TypeError(f"matmul_dense takes a float32 or bfloat16 matrix, not {weight.dtype}")
        if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (
            torch.float32,
            torch.bfloat16,
        ):
            raise TypeError("matmul_dense takes and gives float32 or bfloat16 rows")
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"activations of shape {tuple(x.shape)} for {k} input features")
        weight, x = weight.contiguous(), x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=out_dtype)
        status = self.lib.pagedllm_dense_matmul_panels(
            weight.data_ptr(),
            int(weight.dtype == torch.bfloat16),
            n,
            k,
            x.data_ptr(),
            x.shape[0],
            k,
            y.data_ptr(),
            n,
            torch.get_num_threads(),
            int(x.dtype == torch.bfloat16),
            int(out_dtype == torch.bfloat16),
        )
        if status == -1:
            return None
        if status != 0:
            raise MemoryError("the dense panel product could not allocate its panels")
        return y

    def _rows_product(
        self,
        fn: Any,
        name: str,
        kind: str,
        takes: tuple[torch.dtype, ...],
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype,
        *flags: int,
    ) -> torch.Tensor | None:
        """A product of rows of a dtype in ``takes`` into float32 or bfloat16 ``out_dtype``
        (``flags``: the kernel's arguments after the thread count, before the output flag)."""
        if x.dtype not in takes:
            names = " or ".join(str(t).removeprefix("torch.") for t in takes)
            raise TypeError(f"{name} takes {names} rows, not {x.dtype}")
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} gives float32 or bfloat16, not {out_dtype}")
        return self._optional_product(
            fn, kind, x, raw, qtype, n, k, out_dtype, *flags, int(out_dtype == torch.bfloat16)
        )

    @classmethod
    def _optional_product(
        cls,
        fn: Any,
        kind: str,
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype = torch.float32,
        *extra: int,
    ) -> torch.Tensor | None:
        """``fn``'s product, or None where the kernel does not apply (status -1; any type
        but Q4_0/Q4_1/Q8_0)."""
        if int(qtype) not in FUSED_TYPES:
            return None
        y, status = cls._product(fn, x, raw, qtype, n, k, out_dtype, *extra)
        if status == -1:
            return None
        if status != 0:
            raise MemoryError(f"the {kind} GGUF matmul could not allocate its buffers")
        return y

    @staticmethod
    def _product(
        fn: Any,
        x: torch.Tensor,
        raw: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        out_dtype: torch.dtype = torch.float32,
        *extra: int,
    ) -> tuple[torch.Tensor, int]:
        """``fn``'s product of ``x`` ``[m, k]`` and packed ``raw`` ``[n, row_bytes]`` into a
        new ``[m, n]`` of ``out_dtype``, and its status (``extra``: arguments after the
        thread count)."""
        check_raw(raw, qtype, (n, k))  # the kernel trusts the sizes it is given
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"activations of shape {tuple(x.shape)} for {k} input features")
        x = x.contiguous()
        raw = raw.contiguous().view(n, -1)
        m = x.shape[0]
        y = torch.empty(m, n, dtype=out_dtype)
        status = fn(
            int(qtype),
            raw.data_ptr(),
            n,
            raw.shape[-1],
            k,
            x.data_ptr(),
            m,
            k,
            y.data_ptr(),
            n,
            torch.get_num_threads(),
            *extra,
        )
        return y, status


@functools.cache
def cpu_kernels() -> GGUFCpuKernels | None:
    """The compiled kernels, or ``None`` (after one warning) when they cannot be built."""
    lib = load_kernel_library("gguf_cpu")
    return None if lib is None else GGUFCpuKernels(lib)
