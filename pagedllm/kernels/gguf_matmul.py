"""Linear layer over GGUF-quantized weights: the weight stays packed in GGML blocks.

Two ways, numerically the same dot products as ``F.linear(x, dequantize(W), bias)``:

- on CPUs with AVX-512 or AVX2+FMA, Q4_0/Q4_1/Q8_0 weights at every row count: the
  compiled kernel decodes panels of weight rows into a small buffer and multiplies them
  with tiles of activation rows held in registers, a GEMM micro-kernel that never
  materialises the float weight (``gguf_cpu``); elsewhere the same for up to
  :func:`fused_max_rows` rows (decode steps), or :data:`GEMV_MAX_ROWS` with the other
  types, one weight row at a time;
- many rows otherwise (prefill, large batches), or any rows on a GPU: a chunk of weight
  rows is dequantized (the compiled CPU kernel, the Triton kernels on GPUs, else the torch
  reference) and multiplied with the BLAS GEMM, so the extra memory is one chunk rather
  than the whole float weight.

Results agree with the reference to within matmul-kernel rounding.

Batch-invariant mode (:mod:`pagedllm.kernels.batch_invariant`): Q4_0/Q4_1/Q8_0 products
take the panels at every row count, one row included, with activations chosen by dtype
alone; other types are dequantized by chunks and multiplied in the same panels.

8-bit activations (``PAGEDLLM_GGUF_ACTIVATIONS``): CPU products with Q4_0, Q4_1 and Q8_0
weights can quantize the activations to 8 bits (one scale per 32 values) and take integer
dot products, as llama.cpp and vLLM's GGUF kernels do: within about 1% of the float
product, enough to change greedy tokens of a small model. ``auto`` (the default) does so
for bfloat16 models' products of :data:`INT8_AUTO_MIN_ROWS` rows or more (every decode
step and prefill) on CPUs with AVX512-VNNI, where the integer products are 1.2-1.6x as
fast as the bfloat16 ones; float32 models keep the float products that greedy parity with
transformers is measured against. ``int8`` quantizes at every row count and dtype (AVX2
or newer), ``float`` never.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.kernels.batch_invariant import batch_invariant, linear
from pagedllm.kernels.ggml_types import GGMLQuantizationType
from pagedllm.kernels.gguf_cpu import FUSED_TYPES, GGUFCpuKernels, cpu_kernels
from pagedllm.kernels.gguf_dequant import bytes_per_row, dequantize

__all__ = [
    "ACTIVATIONS_ENV",
    "DEFAULT_CHUNK_ROWS",
    "GEMV_MAX_ROWS",
    "gguf_embedding",
    "gguf_linear",
    "gguf_linear_reference",
    "triton_gguf_linear",
]

# 1024 rows of a 4096-wide layer is 16 MiB of float32: small next to activations, large
# enough that the per-chunk matmul stays efficient.
DEFAULT_CHUNK_ROWS = 1024
# Up to this many activation rows the row-decoding kernel beats dequantize-then-GEMM
# (measured on AVX-512: the GEMM's cost per weight falls with more rows, the kernel's not).
GEMV_MAX_ROWS = 4
# The types with a fused decode-and-dot kernel (and an 8-bit-activation kernel). On
# AVX-512, up to 8 rows (decode steps of a few sequences) decode each block of 32 weights
# in registers and meet every row with it, no buffer (AVX-512 EPYC, the 49152 x 576 Q8_0
# LM head at 4 rows: float32 2.4 ms, bfloat16 1.9 ms, against 4.3 and 3.0 for the earlier
# two-rows-at-a-time buffer); more rows take a panel GEMM (32 weight rows decoded k-major
# once per block of rows, tiles of 12 rows x 32 outputs in registers), ahead of
# dequantize-then-GEMM at every row count (a 1536 x 576 Q4_1 weight: float32 0.63 vs
# 1.04 ms at 64 rows, 4.9 vs 5.5 ms at 512; bfloat16 0.33 vs 0.50 ms at 64). On AVX2 with
# FMA the same panels in 256-bit registers (16 weight rows, 6-row tiles); without either,
# the row-buffer kernel up to 8 rows.
INT8_TYPES = FUSED_TYPES
UNTILED_MAX_ROWS = 8


def fused_max_rows() -> int | None:
    """Up to how many rows the fused kernel beats dequantize-then-GEMM with this build
    (None: at every count)."""
    kernels = cpu_kernels()
    return None if kernels is not None and kernels.row_tiles else UNTILED_MAX_ROWS


ACTIVATIONS_ENV = "PAGEDLLM_GGUF_ACTIVATIONS"
ACTIVATION_MODES = ("auto", "int8", "float")
# ``auto``: bfloat16 products take 8-bit activations from this many rows on. A decode step
# reads every weight from memory, and the panels decode 16 weight rows at a time (16
# streams, more than the hardware prefetchers follow): the kernel prefetches the next panel
# as it decodes one. With that, on an AVX512-VNNI EPYC (2 cores), default model, ms per
# decode step, bfloat16 products / 8-bit ones: 2 sequences 9.6 / 8.5, 4: 12.1 / 10.0, 8:
# 19.5 / 15.7. One row takes the untiled 8-bit row kernel (no panel to decode): the 30
# layers' products of one row from memory 5.7-6.3 ms in bfloat16, 4.8-5.1 in 8 bits.
INT8_AUTO_MIN_ROWS = 1


def activation_mode() -> str:
    """``PAGEDLLM_GGUF_ACTIVATIONS``: ``auto`` (unset), ``int8`` or ``float`` (``float32``,
    its earlier name, is the same)."""
    mode = os.environ.get(ACTIVATIONS_ENV, "auto")
    if mode == "float32":
        return "float"
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"{ACTIVATIONS_ENV}={mode!r}: use auto (the default), int8 or float")
    return mode


def int8_min_rows(dtype: torch.dtype) -> int | None:
    """From how many activation rows of ``dtype`` CPU products with Q4_0/Q4_1/Q8_0 weights
    quantize the activations to 8 bits; None: never."""
    mode = activation_mode()
    if mode != "auto":
        return 1 if mode == "int8" else None
    kernels = cpu_kernels()
    if dtype == torch.bfloat16 and kernels is not None and kernels.q8_panels:
        return INT8_AUTO_MIN_ROWS
    return None


def _dequantize_rows(raw: torch.Tensor, qtype: int, rows: int, k: int, dtype) -> torch.Tensor:
    if raw.device.type == "cpu":
        kernels = cpu_kernels()
        if kernels is not None and kernels.supports(qtype):
            return kernels.dequantize(raw, qtype, rows, k).to(dtype)
    else:
        from pagedllm.kernels.triton_gguf import triton_available, triton_dequantize

        if triton_available():  # GPUs: the Triton kernels
            return triton_dequantize(raw, qtype, (rows, k), dtype=dtype)
    return dequantize(raw, qtype, (rows, k), dtype=dtype)


def gguf_linear(
    x: torch.Tensor,
    raw_weight: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    decode: Callable[[torch.Tensor, int, int, int, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` with ``W`` given as packed GGML rows.

    ``x``: ``[..., in_features]``; ``raw_weight``: uint8 ``[out_features, bytes_per_row]``
    (one GGUF tensor of ne = ``(in_features, out_features)``). ``decode(raw_rows, qtype,
    rows, in_features, dtype)`` forces the chunked path with that dequantizer.
    """
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    qtype = int(qtype)
    row_bytes = bytes_per_row(qtype, in_features)
    raw = raw_weight.reshape(out_features, row_bytes)
    flat = x.reshape(-1, in_features)

    kernels = cpu_kernels() if x.device.type == "cpu" and decode is None else None
    out = None
    invariant = batch_invariant() and x.device.type == "cpu"
    if invariant and kernels is not None and qtype in FUSED_TYPES and kernels.row_tiles:
        out = _invariant_product(kernels, flat, raw, qtype, out_features, in_features)
    elif invariant:  # (other types: dequantized chunks, multiplied in panels below)
        kernels = None
    float_rows = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if out is None and kernels is not None and float_rows:
        # (16-bit activations: bfloat16 ones multiplied in bfloat16 with float32 sums
        # where the CPU has AVX512-BF16, else the float32 kernels on their exact
        # widening; the result rounded back once. Rows past the kernel's limit take the
        # 16-bit GEMM below.)
        # (``.float()`` of float32 rows is the rows themselves.)
        min_rows = int8_min_rows(x.dtype) if qtype in INT8_TYPES else None
        if flat.shape[0] == 1 and qtype == GGMLQuantizationType.Q8_0:
            if x.dtype == torch.bfloat16 and kernels.bf16:
                # (one bfloat16 row against Q8_0 weights: the bfloat16 kernel is faster than
                # the 8-bit row kernel, 1.7 vs 2.3 ms for a 49152 x 576 head from memory)
                min_rows = None
        if min_rows is not None and flat.shape[0] >= min_rows:
            if kernels.q8_panels and x.dtype == torch.bfloat16 and flat.shape[0] > 1:
                # (rounded once, to bfloat16; one row: the row kernel below, rounded once)
                out = kernels.matmul_q8_panels(
                    flat, raw, qtype, out_features, in_features, out_dtype=torch.bfloat16
                )
            else:  # (the kernel takes its panels from 4 rows where the CPU has them)
                out = kernels.matmul_q8(flat.float(), raw, qtype, out_features, in_features)
        max_rows = fused_max_rows() if qtype in FUSED_TYPES else GEMV_MAX_ROWS
        fits = max_rows is None or flat.shape[0] <= max_rows
        if (
            out is None
            and x.dtype == torch.bfloat16
            and kernels.bf16
            and qtype in FUSED_TYPES
            and fits
        ):
            out = kernels.matmul_bf16(
                flat, raw, qtype, out_features, in_features, out_dtype=torch.bfloat16
            )
        if out is None and fits and kernels.supports(qtype):
            out = kernels.matmul(flat.float(), raw, qtype, out_features, in_features)
        if out is not None:
            out = out.to(x.dtype)
    if out is None:
        out = flat.new_empty((flat.shape[0], out_features))
        for start in range(0, out_features, chunk_rows):
            stop = min(start + chunk_rows, out_features)
            w = (decode or _dequantize_rows)(
                raw[start:stop], qtype, stop - start, in_features, x.dtype
            )
            # Writing into a slice of ``out`` avoids a concatenation (a second full copy).
            out[:, start:stop] = linear(flat, w)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def triton_gguf_linear(
    x: torch.Tensor,
    raw_weight: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """``x @ dequantize(W).T + bias``, ``W`` packed GGML rows decoded by the Triton kernels
    ``chunk_rows`` rows at a time (the extra memory is one chunk, not the float weight).

    ``x``: ``[..., in_features]``; ``raw_weight``: uint8 ``[out_features, bytes_per_row]``.
    """
    from pagedllm.kernels.triton_gguf import triton_dequantize

    def decode(raw: torch.Tensor, qt: int, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        return triton_dequantize(raw, qt, (rows, k), dtype)

    return gguf_linear(
        x, raw_weight, qtype, out_features, in_features, bias, chunk_rows, decode=decode
    )


def _invariant_product(
    kernels: GGUFCpuKernels,
    flat: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """Batch-invariant mode: the product of Q4_0/Q4_1/Q8_0 weights in panels at every row
    count, with the activations the mode (``PAGEDLLM_GGUF_ACTIVATIONS``) gives this dtype
    whatever the row count: 8-bit ones in the VNNI panels (without them, the 8-bit row
    loop, the same sums for any row count), else bfloat16 pairs (AVX512-BF16) or float32.
    (The same choices as the native decoder layer's, ``csrc/cpu_layer.c``.)"""
    bf16 = flat.dtype == torch.bfloat16
    out = None
    if int8_min_rows(flat.dtype) is not None:
        if kernels.q8_panels:
            rows = flat if flat.dtype in (torch.float32, torch.bfloat16) else flat.float()
            out_dtype = torch.bfloat16 if bf16 else torch.float32
            out = kernels.matmul_q8_panels(rows, raw, qtype, out_features, in_features, out_dtype)
        else:
            out = kernels.matmul_q8(flat.float(), raw, qtype, out_features, in_features)
    if out is None and bf16 and kernels.bf16:
        out = kernels.matmul_panels(flat, raw, qtype, out_features, in_features, torch.bfloat16)
    if out is None:
        out = kernels.matmul_panels(flat.float(), raw, qtype, out_features, in_features)
    if out is None:
        raise RuntimeError(f"GGML type {qtype}: no panel product in this build")
    return out.to(flat.dtype)


def gguf_embedding(
    ids: torch.Tensor,
    raw_weight: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``ids`` of a packed ``[vocab, bytes_per_row]`` table, dequantized."""
    rows = raw_weight[ids.reshape(-1)]
    out = _dequantize_rows(rows, int(qtype), rows.shape[0], dim, dtype)
    return out.reshape(*ids.shape, dim)


def gguf_linear_reference(
    x: torch.Tensor,
    raw_weight: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain reference: dequantize the whole weight, then ``F.linear``."""
    w = dequantize(raw_weight, qtype, (out_features, in_features), dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
