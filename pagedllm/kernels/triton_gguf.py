"""GGUF (GGML block) dequantization as Triton kernels, for GPUs.

The weight stays packed on the GPU; these kernels decode it to float32 where it is used.
The torch reference in ``gguf_dequant`` is the source of truth: every kernel here decodes
one element per lane with the same float32 operations in the same order (fp16 scales
widened first, products and sums separate), and the tests check the results bit for bit
against it on CPU under ``TRITON_INTERPRET=1`` (Triton's numpy interpreter). Kernels are
launched with ``enable_fp_fusion=False`` so the GPU compiler cannot contract a multiply and
an add into an FMA, which would round differently from the reference.

Import this module freely; the kernels exist only when ``triton_available()``.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from pagedllm.kernels.gguf_dequant import check_raw

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = ["triton_available", "triton_dequantize"]

_T = GGMLQuantizationType

# Block-quantized types: blocks decoded per program. Plain float types are decoded in
# flat runs of _PLAIN_ELEMS elements instead (a "block" there is one value).
_BLOCKS_PER_PROGRAM = 8
_PLAIN_ELEMS = 1024
_PLAIN_TYPES = (_T.F32, _T.F16, _T.BF16)


def triton_available() -> bool:
    """Whether triton imported, i.e. the kernels below exist."""
    return triton is not None


if triton is not None:
    # GGML type ids as compile-time constants for the kernels' type switch.
    _F32 = tl.constexpr(int(_T.F32))
    _F16 = tl.constexpr(int(_T.F16))
    _BF16 = tl.constexpr(int(_T.BF16))
    _Q4_0 = tl.constexpr(int(_T.Q4_0))
    _Q4_1 = tl.constexpr(int(_T.Q4_1))
    _Q5_0 = tl.constexpr(int(_T.Q5_0))
    _Q5_1 = tl.constexpr(int(_T.Q5_1))
    _Q8_0 = tl.constexpr(int(_T.Q8_0))
    _Q2_K = tl.constexpr(int(_T.Q2_K))
    _Q3_K = tl.constexpr(int(_T.Q3_K))
    _Q4_K = tl.constexpr(int(_T.Q4_K))
    _Q5_K = tl.constexpr(int(_T.Q5_K))
    _Q6_K = tl.constexpr(int(_T.Q6_K))

    @triton.jit
    def _u8(ptr):
        """The byte at each of ``ptr``, as int32 (all bit twiddling is done in int32)."""
        return tl.load(ptr).to(tl.int32)

    @triton.jit
    def _f16(ptr):
        """The little-endian fp16 at ``ptr`` (byte pointers), widened to float32."""
        lo = tl.load(ptr).to(tl.uint16)
        hi = tl.load(ptr + 1).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _i8(ptr):
        """The byte at each of ``ptr`` as a signed int8, converted to float32."""
        return tl.load(ptr).to(tl.int8, bitcast=True).to(tl.float32)

    # Each decoder gets ``blk`` (pointers to the first byte of each block, shape [B, 1])
    # and ``e`` (element index within the block, shape [1, QK]) and returns float32
    # [B, QK]. Masked-off blocks point at block 0, so every load stays in bounds.

    @triton.jit
    def _q4_0(blk, e):
        d = _f16(blk)
        q = ((_u8(blk + 2 + e % 16) >> ((e // 16) * 4)) & 0x0F).to(tl.float32) - 8.0
        return d * q

    @triton.jit
    def _q4_1(blk, e):
        d = _f16(blk)
        m = _f16(blk + 2)
        q = ((_u8(blk + 4 + e % 16) >> ((e // 16) * 4)) & 0x0F).to(tl.float32)
        dq = d * q
        return dq + m

    @triton.jit
    def _q5(blk, e, qh_off: tl.constexpr, qs_off: tl.constexpr):
        """The 5-bit quant of Q5_0/Q5_1: low nibble | bit e of the uint32 at qh_off."""
        low = (_u8(blk + qs_off + e % 16) >> ((e // 16) * 4)) & 0x0F
        high = (_u8(blk + qh_off + e // 8) >> (e % 8)) & 1
        return (low | (high << 4)).to(tl.float32)

    @triton.jit
    def _q5_0(blk, e):
        d = _f16(blk)
        q = _q5(blk, e, 2, 6) - 16.0
        return d * q

    @triton.jit
    def _q5_1(blk, e):
        d = _f16(blk)
        m = _f16(blk + 2)
        dq = d * _q5(blk, e, 4, 8)
        return dq + m

    @triton.jit
    def _q8_0(blk, e):
        d = _f16(blk)
        return _i8(blk + 2 + e) * d

    @triton.jit
    def _two_bits(blk, e, off: tl.constexpr):
        """2-bit fields of K-quants: runs of 32 bytes, shift 0, 2, 4, 6 per 32 values."""
        byte = _u8(blk + off + (e // 128) * 32 + e % 32)
        return (byte >> (((e % 128) // 32) * 2)) & 3

    @triton.jit
    def _q2_k(blk, e):
        scale = _u8(blk + e // 16)
        d = _f16(blk + 80)
        dmin = _f16(blk + 82)
        dl = d * (scale & 0x0F).to(tl.float32)
        ml = dmin * (scale >> 4).to(tl.float32)
        q = _two_bits(blk, e, 16).to(tl.float32)
        dlq = dl * q
        return dlq - ml

    @triton.jit
    def _q3_k(blk, e):
        d = _f16(blk + 108)
        i = e // 16  # scale index
        low = (_u8(blk + 96 + i % 8) >> ((i // 8) * 4)) & 0x0F
        high = (_u8(blk + 104 + i % 4) >> ((i // 4) * 2)) & 3
        scale = (low | (high << 4)).to(tl.float32) - 32.0
        dl = d * scale
        ql = _two_bits(blk, e, 32).to(tl.float32)
        # The stored 3rd bit is inverted: subtract 4 where it is clear.
        qh = ((((_u8(blk + e % 32) >> (e // 32)) & 1) ^ 1) << 2).to(tl.float32)
        q = ql - qh
        return dl * q

    @triton.jit
    def _scale_min_k4(blk, e):
        """Sub-block (32 values) scale and min of Q4_K/Q5_K from the 12 bytes at 4..15."""
        s = e // 32
        lo = s < 4
        j = s % 4
        b_d = _u8(blk + 4 + j)
        b_m = _u8(blk + 8 + j)
        b_md = _u8(blk + 12 + j)
        sc = tl.where(lo, b_d & 0x3F, (b_md & 0x0F) | ((b_d >> 2) & 0x30))
        mn = tl.where(lo, b_m & 0x3F, (b_md >> 4) | ((b_m >> 2) & 0x30))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _k4_nibble(blk, e, off: tl.constexpr):
        """Q4_K/Q5_K nibbles: runs of 32 bytes, low nibbles first, then high nibbles."""
        byte = _u8(blk + off + (e // 64) * 32 + e % 32)
        return (byte >> (((e % 64) // 32) * 4)) & 0x0F

    @triton.jit
    def _q4_k(blk, e):
        d = _f16(blk)
        dmin = _f16(blk + 2)
        sc, mn = _scale_min_k4(blk, e)
        dl = d * sc
        ml = dmin * mn
        q = _k4_nibble(blk, e, 16).to(tl.float32)
        dlq = dl * q
        return dlq - ml

    @triton.jit
    def _q5_k(blk, e):
        d = _f16(blk)
        dmin = _f16(blk + 2)
        sc, mn = _scale_min_k4(blk, e)
        dl = d * sc
        ml = dmin * mn
        high = (_u8(blk + 16 + e % 32) >> (e // 32)) & 1
        q = (_k4_nibble(blk, e, 48) | (high << 4)).to(tl.float32)
        dlq = dl * q
        return dlq - ml

    @triton.jit
    def _q6_k(blk, e):
        d = _f16(blk + 208)
        dl = d * _i8(blk + 192 + e // 16)
        low = (_u8(blk + (e // 128) * 64 + e % 64) >> (((e % 128) // 64) * 4)) & 0x0F
        high = _two_bits(blk, e, 128)
        q = (low | (high << 4)).to(tl.float32) - 32.0
        return dl * q

    @triton.jit
    def _dequant_blocks_kernel(
        raw_ptr,
        out_ptr,
        n_blocks,
        QTYPE: tl.constexpr,
        QK: tl.constexpr,
        TYPE_SIZE: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        """Decode BLOCKS consecutive blocks of QK values (TYPE_SIZE bytes each)."""
        b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        mask = b < n_blocks
        blk = raw_ptr + tl.where(mask, b, 0) * TYPE_SIZE
        e = tl.arange(0, QK)[None, :]
        if QTYPE == _Q4_0:
            val = _q4_0(blk, e)
        elif QTYPE == _Q4_1:
            val = _q4_1(blk, e)
        elif QTYPE == _Q5_0:
            val = _q5_0(blk, e)
        elif QTYPE == _Q5_1:
            val = _q5_1(blk, e)
        elif QTYPE == _Q8_0:
            val = _q8_0(blk, e)
        elif QTYPE == _Q2_K:
            val = _q2_k(blk, e)
        elif QTYPE == _Q3_K:
            val = _q3_k(blk, e)
        elif QTYPE == _Q4_K:
            val = _q4_k(blk, e)
        elif QTYPE == _Q5_K:
            val = _q5_k(blk, e)
        else:
            tl.static_assert(QTYPE == _Q6_K, "unsupported GGML block type")
            val = _q6_k(blk, e)
        tl.store(out_ptr + b * QK + e, val, mask=mask)

    @triton.jit
    def _dequant_plain_kernel(raw_ptr, out_ptr, n, QTYPE: tl.constexpr, ELEMS: tl.constexpr):
        """F32 / F16 / BF16: ELEMS consecutive little-endian values widened to float32."""
        i = tl.program_id(0).to(tl.int64) * ELEMS + tl.arange(0, ELEMS)
        mask = i < n
        i = tl.where(mask, i, 0)
        if QTYPE == _F32:
            b = raw_ptr + i * 4
            bits = (
                tl.load(b).to(tl.uint32)
                | (tl.load(b + 1).to(tl.uint32) << 8)
                | (tl.load(b + 2).to(tl.uint32) << 16)
                | (tl.load(b + 3).to(tl.uint32) << 24)
            )
            val = bits.to(tl.float32, bitcast=True)
        elif QTYPE == _F16:
            val = _f16(raw_ptr + i * 2)
        else:  # BF16: the top half of a float32
            tl.static_assert(QTYPE == _BF16, "unsupported GGML float type")
            lo = tl.load(raw_ptr + i * 2).to(tl.uint32)
            hi = tl.load(raw_ptr + i * 2 + 1).to(tl.uint32)
            val = ((lo << 16) | (hi << 24)).to(tl.float32, bitcast=True)
        tl.store(out_ptr + i, val, mask=mask)


def _launch(raw: torch.Tensor, qt: GGMLQuantizationType, out: torch.Tensor) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qt]
    n_blocks = raw.numel() // type_size
    if qt in _PLAIN_TYPES:
        grid = (triton.cdiv(n_blocks, _PLAIN_ELEMS),)
        _dequant_plain_kernel[grid](
            raw, out, n_blocks, QTYPE=int(qt), ELEMS=_PLAIN_ELEMS, enable_fp_fusion=False
        )
    else:
        grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM),)
        _dequant_blocks_kernel[grid](
            raw,
            out,
            n_blocks,
            QTYPE=int(qt),
            QK=block_size,
            TYPE_SIZE=type_size,
            BLOCKS=_BLOCKS_PER_PROGRAM,
            enable_fp_fusion=False,
        )


def triton_dequantize(
    raw: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``gguf_dequant.dequantize`` with Triton kernels: same contract, same float32 bits.

    ``raw`` is uint8 with the last dim equal to the bytes of one row; the result has
    ``shape``, is computed in float32 and then cast to ``dtype``.
    """
    if not triton_available():
        raise RuntimeError("triton_dequantize needs triton; install it with `pip install triton`")
    qt, shape = check_raw(raw, qtype, shape)
    out = torch.empty(shape, dtype=torch.float32, device=raw.device)
    if out.numel():
        _launch(raw.contiguous().reshape(-1), qt, out)
    return out.to(dtype)
