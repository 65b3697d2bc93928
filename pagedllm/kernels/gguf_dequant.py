"""GGML/GGUF block dequantization (torch reference).

Every supported type is decoded with vectorised torch ops over all blocks at once. The
arithmetic mirrors ``gguf.quants`` (the numpy reference shipped with llama.cpp's ``gguf``
package) operation by operation: fp16 scales are widened to float32 first, then products
and sums are taken in the same order, so the float32 results are bit-exact equal to
``gguf.quants.dequantize``. Integer parts (nibbles, high bits, 6-bit scales) are exact in
any order, so only the floating-point steps have to follow the reference.

All multi-byte fields are little-endian, as GGUF stores them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedllm.kernels.ggml_types import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

__all__ = ["SUPPORTED_TYPES", "bytes_per_row", "check_raw", "dequantize"]

_T = GGMLQuantizationType


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, widened to float32, shape (n, 1).

    ``.contiguous()`` first so the dtype view never depends on the raw buffer's alignment
    (a slice of a memory-mapped file can start at an odd offset)."""
    field = blocks[:, start : start + 2].contiguous().view(torch.float16)
    return field.to(torch.float32)


def _shifts(values: Sequence[int], device: torch.device, ndim: int, axis: int) -> torch.Tensor:
    """A uint8 tensor of shift amounts laid along ``axis`` of an ``ndim``-d broadcast."""
    shape = [1] * ndim
    shape[axis] = len(values)
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split packed 4-bit values: for each run of ``group`` bytes, first the ``group`` low
    nibbles, then the ``group`` high nibbles (the order every GGML type uses).
    Returns uint8 of shape (n, 2 * qs.shape[1])."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts([0, 4], qs.device, 4, 2)
    return (q & 0x0F).reshape(n, -1)


def _bits(qh: torch.Tensor, group: int, nbits: int) -> torch.Tensor:
    """Unpack ``nbits``-wide fields: for each run of ``group`` bytes, field 0 of all of
    them, then field 1, ... (the layout of Q2_K/Q3_K/Q5_K/Q6_K high bits and 2-bit quants).
    Returns uint8 of shape (n, (8 // nbits) * qh.shape[1])."""
    n = qh.shape[0]
    shifts = list(range(0, 8, nbits))
    q = qh.reshape(n, -1, 1, group) >> _shifts(shifts, qh.device, 4, 2)
    return (q & ((1 << nbits) - 1)).reshape(n, -1)


# ---------------------------------------------------------------------------------------
# Legacy 32-element block types
# ---------------------------------------------------------------------------------------


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0, 18 bytes / 32 values: fp16 d | 16 bytes of nibbles (low nibbles are values
    0..15, high nibbles 16..31). value = d * (q - 8)."""
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.float32) - 8.0
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1, 20 bytes / 32 values: fp16 d | fp16 m | 16 bytes of nibbles.
    value = d * q + m."""
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 16).to(torch.float32)
    # Separate mul and add (not addcmul) so no fused multiply-add changes the rounding.
    return (d * q) + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The 32 fifth bits of Q5_0/Q5_1: bit i of the little-endian uint32 is value i's, i.e.
    bit i % 8 of byte i // 8. Returned already shifted to bit 4."""
    n = qh.shape[0]
    bits = (qh.reshape(n, 4, 1) >> _shifts(range(8), qh.device, 3, 2)) & 1
    return bits.reshape(n, 32) << 4


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0, 22 bytes / 32 values: fp16 d | 4 bytes high bits | 16 bytes of low nibbles.
    value = d * (q - 16)."""
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:], 16) | _q5_high(blocks[:, 2:6])
    return d * (q.to(torch.float32) - 16.0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1, 24 bytes / 32 values: fp16 d | fp16 m | 4 bytes high bits | 16 bytes of low
    nibbles. value = d * q + m."""
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:], 16) | _q5_high(blocks[:, 4:8])
    return (d * q.to(torch.float32)) + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0, 34 bytes / 32 values: fp16 d | 32 int8. value = q * d."""
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


# ---------------------------------------------------------------------------------------
# K-quants: 256-element super-blocks (QK_K) made of 16 or 8 sub-blocks
# ---------------------------------------------------------------------------------------


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K, 84 bytes / 256 values: 16 bytes of scales (low nibble scale, high nibble min,
    one per 16 values) | 64 bytes of 2-bit quants (4 per byte, in runs of 32 bytes) |
    fp16 d | fp16 dmin. value = (d * scale) * q - (dmin * min)."""
    n = blocks.shape[0]
    scales = blocks[:, : QK_K // 16]
    d = _f16(blocks, QK_K // 16 + QK_K // 4)
    dmin = _f16(blocks, QK_K // 16 + QK_K // 4 + 2)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _bits(blocks[:, QK_K // 16 : QK_K // 16 + QK_K // 4], 32, 2)
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K, 110 bytes / 256 values: 32 bytes hmask (3rd bit, inverted) | 64 bytes of
    2-bit low quants | 12 bytes of 6-bit scales (16 of them, offset by 32) | fp16 d.
    value = (d * (scale - 32)) * (q_low - 4 * (1 - hbit))."""
    n = blocks.shape[0]
    hmask = blocks[:, : QK_K // 8]
    qs = blocks[:, QK_K // 8 : QK_K // 8 + QK_K // 4]
    packed = blocks[:, QK_K // 8 + QK_K // 4 : QK_K // 8 + QK_K // 4 + 12]
    d = _f16(blocks, QK_K // 8 + QK_K // 4 + 12)
    # Bytes 0..7 hold the low 4 bits of scales 0..7 (low nibbles) and 8..15 (high
    # nibbles); bytes 8..11 hold the top 2 bits, scale j in byte 8 + j % 4 at bit 2*(j//4).
    low = _nibbles(packed[:, :8], 8)
    high = _bits(packed[:, 8:], 4, 2)
    scales = (low | (high << 4)).to(torch.float32) - 32.0
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(qs, 32, 2).reshape(n, 16, 16)
    # The 3rd bit subtracts 4 when it is *clear* (the stored mask is inverted).
    qh = (_bits(hmask, 32, 1).reshape(n, 16, 16) ^ 1) << 2
    q = ql.to(torch.float32) - qh.to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scale block of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit
    mins. Bytes 0..3: scales 0..3 (low 6 bits) + top 2 bits of scales 4..7; bytes 4..7:
    mins 0..3 + top bits of mins 4..7; bytes 8..11: low nibble scale 4..7, high nibble
    min 4..7."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K, 144 bytes / 256 values: fp16 d | fp16 dmin | 12 bytes of scales/mins (8
    sub-blocks of 32) | 128 bytes of nibbles (runs of 32 bytes: low nibbles are one
    sub-block, high nibbles the next). value = (d * scale) * q - (dmin * min)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K, 176 bytes / 256 values: fp16 d | fp16 dmin | 12 bytes of scales/mins |
    32 bytes of 5th bits (bit j of byte i is value 32*j + i's) | 128 bytes of nibbles as
    in Q4_K. value = (d * scale) * q - (dmin * min)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = _nibbles(blocks[:, 48:], 32)
    qh = _bits(blocks[:, 16:48], 32, 1)
    q = (ql | (qh << 4)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K, 210 bytes / 256 values: 128 bytes of low nibbles (runs of 64 bytes) | 64
    bytes of 2-bit high parts (runs of 32 bytes) | 16 int8 scales (one per 16 values) |
    fp16 d. value = (d * scale) * (q - 32)."""
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, : QK_K // 2], 64)
    qh = _bits(blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4], 32, 2)
    scales = blocks[:, QK_K // 2 + QK_K // 4 : QK_K // 2 + QK_K // 4 + QK_K // 16]
    d = _f16(blocks, QK_K // 2 + QK_K // 4 + QK_K // 16)
    dl = (d * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    q = (ql | (qh << 4)).to(torch.float32) - 32.0
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------
# Plain floating-point types (a "block" is one element)
# ---------------------------------------------------------------------------------------


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    """F32: 4 little-endian bytes per value."""
    return blocks.contiguous().view(torch.float32)


def _f16_plain(blocks: torch.Tensor) -> torch.Tensor:
    """F16: 2 bytes per value, widened exactly to float32."""
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    """BF16: 2 bytes per value, the top half of a float32 (widening is exact, NaNs keep
    their payload as in gguf's bit-shift)."""
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.F32: _f32,
    _T.F16: _f16_plain,
    _T.BF16: _bf16,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q8_0: _q8_0,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DEQUANT)


def _qtype(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    """Normalise and validate a GGML type; unsupported ones raise a ValueError naming it."""
    try:
        qt = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"unknown GGML tensor type {qtype!r}") from None
    if qt not in _DEQUANT:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"GGML tensor type {qt.name} ({int(qt)}) is not supported by pagedllm's GGUF "
            f"dequantization; supported types: {names}"
        )
    return qt


def bytes_per_row(qtype: int | GGMLQuantizationType, row_length: int) -> int:
    """Bytes one row of ``row_length`` values occupies; the row must be whole blocks."""
    qt = _qtype(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qt]
    if row_length % block_size:
        raise ValueError(
            f"row length {row_length} is not a multiple of the {qt.name} block size {block_size}"
        )
    return row_length // block_size * type_size


def check_raw(
    raw: torch.Tensor, qtype: int | GGMLQuantizationType, shape: Sequence[int]
) -> tuple[GGMLQuantizationType, tuple[int, ...]]:
    """Validate packed data against the type and the shape it should decode to; returns
    the normalised ``(type, shape)``. Errors name the type and the sizes."""
    qt = _qtype(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGML data must be uint8, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    row_bytes = bytes_per_row(qt, shape[-1])
    n_rows = 1
    for s in shape[:-1]:
        n_rows *= s
    if raw.numel() != n_rows * row_bytes:
        raise ValueError(
            f"{qt.name} data of {raw.numel()} bytes does not hold shape {shape} "
            f"({n_rows} rows x {row_bytes} bytes)"
        )
    return qt, shape


def dequantize(
    raw: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode packed GGML blocks to a tensor of ``shape``.

    ``raw`` is uint8 with any leading shape and the last dim equal to the bytes of one row
    (``bytes_per_row(qtype, shape[-1])``); blocks never straddle rows, so the flat byte
    stream is simply a sequence of blocks. Computed in float32 (bit-exact with
    ``gguf.quants.dequantize``), then cast to ``dtype``.
    """
    qt, shape = check_raw(raw, qtype, shape)
    _, type_size = GGML_QUANT_SIZES[qt]
    blocks = raw.reshape(-1, type_size)
    out = _DEQUANT[qt](blocks)
    return out.reshape(shape).to(dtype)
