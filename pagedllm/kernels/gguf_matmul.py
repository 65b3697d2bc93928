"""Linear layer over GGUF-quantized weights (torch reference).

The weight stays packed in GGML blocks; it is dequantized a chunk of output rows at a time
and multiplied immediately, so the extra memory is one chunk of dequantized rows rather
than the whole float weight. Numerically each output element is the same dot product as
``F.linear(x, dequantize(W), bias)`` (only the grouping of rows into matmul calls
differs), so results agree to within matmul-kernel rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pagedllm.kernels.gguf_dequant import bytes_per_row, dequantize

__all__ = ["DEFAULT_CHUNK_ROWS", "gguf_linear", "gguf_linear_reference"]

# 1024 rows of a 4096-wide layer is 16 MiB of float32: small next to activations, large
# enough that the per-chunk matmul stays efficient.
DEFAULT_CHUNK_ROWS = 1024


def gguf_linear(
    x: torch.Tensor,
    raw_weight: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` with ``W`` given as packed GGML rows.

    ``x``: ``[..., in_features]``; ``raw_weight``: uint8 ``[out_features, bytes_per_row]``
    (one GGUF tensor of ne = ``(in_features, out_features)``). The weight is decoded in
    ``x.dtype`` (from float32, as ``dequantize`` computes) ``chunk_rows`` output rows at a
    time.
    """
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    row_bytes = bytes_per_row(qtype, in_features)
    raw = raw_weight.reshape(out_features, row_bytes)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")

    out = x.new_empty((*x.shape[:-1], out_features))
    for start in range(0, out_features, chunk_rows):
        stop = min(start + chunk_rows, out_features)
        w = dequantize(raw[start:stop], qtype, (stop - start, in_features), dtype=x.dtype)
        # Writing into a slice of ``out`` avoids a concatenation (a second full copy).
        out[..., start:stop] = F.linear(x, w)
    if bias is not None:
        out += bias.to(out.dtype)
    return out


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
