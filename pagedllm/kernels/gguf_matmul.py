"""Linear layer over GGUF-quantized weights: the weight stays packed in GGML blocks.

Two ways, numerically the same dot products as ``F.linear(x, dequantize(W), bias)``:

- a few activation rows (decode): the compiled CPU kernel decodes one weight row at a
  time into a small buffer and takes its dot products there (``gguf_cpu``);
- many rows (prefill, large batches), or any rows on a GPU: a chunk of weight rows is
  dequantized (the compiled CPU kernel, the Triton kernels on GPUs, else the torch
  reference) and multiplied with the BLAS GEMM, so the extra memory is one chunk rather
  than the whole float weight.

Results agree with the reference to within matmul-kernel rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pagedllm.kernels.gguf_cpu import cpu_kernels
from pagedllm.kernels.gguf_dequant import bytes_per_row, dequantize

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "GEMV_MAX_ROWS",
    "gguf_embedding",
    "gguf_linear",
    "gguf_linear_reference",
]

# 1024 rows of a 4096-wide layer is 16 MiB of float32: small next to activations, large
# enough that the per-chunk matmul stays efficient.
DEFAULT_CHUNK_ROWS = 1024
# Up to this many activation rows the row-decoding kernel beats dequantize-then-GEMM
# (measured on AVX-512: the GEMM's cost per weight falls with more rows, the kernel's not).
GEMV_MAX_ROWS = 4


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
    if (
        kernels is not None
        and x.dtype == torch.float32
        and flat.shape[0] <= GEMV_MAX_ROWS
        and kernels.supports(qtype)
    ):
        out = kernels.matmul(flat, raw, qtype, out_features, in_features)
    else:
        out = flat.new_empty((flat.shape[0], out_features))
        for start in range(0, out_features, chunk_rows):
            stop = min(start + chunk_rows, out_features)
            w = (decode or _dequantize_rows)(
                raw[start:stop], qtype, stop - start, in_features, x.dtype
            )
            # Writing into a slice of ``out`` avoids a concatenation (a second full copy).
            out[:, start:stop] = F.linear(flat, w)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], out_features)


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
