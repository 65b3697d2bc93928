"""Paged attention, KV-cache writes and the fused elementwise ops as Triton kernels, for
GPUs (the cuda device's kernels; issue 13).

Each kernel takes the arguments of its CPU counterpart in ``cpu_ops`` and has a torch
reference beside it: ``attention.write_kv_cache`` and softmax attention over the paged
context, ``norms.rms_norm``, ``rotary.apply_rotary`` and ``silu(gate) * up``. The tests run
them on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's numpy interpreter); on a GPU
they compile. Launched with ``enable_fp_fusion=False`` where a result is to match its
reference bit for bit (RoPE, the cache writes), so no multiply and add fuse into an FMA.

The KV cache of a layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; the
step's sequences are given as for the CPU kernel: ``seq_ranges`` int64 ``[3, S]`` (each
sequence's first and end token in the flat batch, and its context length with this
step's tokens) and ``block_tables`` int32 ``[S, max_blocks]``. One attention kernel serves
decodes, chunked prefills and prefills over cached prefixes alike: query token ``t`` of a
sequence sits at position ``ctx_len - (q_end - t)`` and attends to the positions up to its
own (within the sliding window if any), read through the block table.

Import this module freely; the kernels exist only when ``triton_available()``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = [
    "interpreted",
    "token_sequences",
    "triton_available",
    "triton_paged_attention",
    "triton_rms_norm",
    "triton_rotary_neox_",
    "triton_silu_mul",
    "triton_write_kv_cache",
]

# Keys per iteration of the attention kernel's online softmax.
ATTENTION_BLOCK_N = 32


def triton_available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, on CPU
    tensors) rather than compiling them for a GPU (Triton's own reading of the setting)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """``x`` in ``dtype``, rounded to nearest even as torch's ``.to()`` rounds: done by
        hand for bfloat16, which Triton's interpreter truncates."""
        x = x.to(tl.float32)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return x.to(dtype)

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        cache_ptr,
        slot_ptr,
        key_stride,
        value_stride,
        value_offset,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        dtype = cache_ptr.dtype.element_ty
        k = tl.load(key_ptr + t * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + t * value_stride + offs, mask=mask)
        tl.store(cache_ptr + slot * ROW + offs, _round_to(k, dtype), mask=mask)
        tl.store(cache_ptr + value_offset + slot * ROW + offs, _round_to(v, dtype), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        q_stride,
        cache_ptr,
        value_offset,
        out_ptr,
        out_stride,
        token_seq_ptr,
        q_end_ptr,
        ctx_len_ptr,
        tables_ptr,
        table_stride,
        block_size,
        scale,
        window,
        softcap,
        GROUP: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        kh = h // GROUP
        seq = tl.load(token_seq_ptr + t)
        p = tl.load(ctx_len_ptr + seq) - (tl.load(q_end_ptr + seq) - t)
        lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + t * q_stride + h * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        row = KV_HEADS * HEAD_DIM
        for j0 in range(lo, p + 1, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j <= p
            block = tl.load(tables_ptr + seq * table_stride + j // block_size, mask=valid, other=0)
            slot = block.to(tl.int64) * block_size + j % block_size
            where = slot[:, None] * row + kh * HEAD_DIM + d[None, :]
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(cache_ptr + where, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[None, :] * k, axis=1) * scale
            if softcap > 0:
                # cap * tanh(s / cap), tanh by exp (as libdevice does without it)
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
            scores = tl.where(valid, scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=0))
            keep = tl.exp(m - new_m)
            weights = tl.exp(scores - new_m)
            v = tl.load(cache_ptr + value_offset + where, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * keep + tl.sum(weights[:, None] * v, axis=0)
            total = total * keep + tl.sum(weights, axis=0)
            m = new_m
        out = acc / total
        tl.store(
            out_ptr + t * out_stride + h * HEAD_DIM + d,
            _round_to(out, out_ptr.dtype.element_ty),
            mask=dmask,
        )

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        x_stride,
        res_ptr,
        res_stride,
        total_ptr,
        weight_ptr,
        out_ptr,
        eps,
        offset,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + r * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # the sum in the model's dtype (as the residual stream keeps it)
            res = tl.load(res_ptr + r * res_stride + cols, mask=mask, other=0.0)
            x = _round_to(x.to(tl.float32) + res.to(tl.float32), dtype)
            tl.store(total_ptr + r * N + cols, x, mask=mask)
        h = x.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / N
        h = h * (1.0 / tl.sqrt(variance + eps))
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            y = h * (offset + w)
        else:
            y = w * _round_to(h, dtype).to(tl.float32)
        tl.store(out_ptr + r * N + cols, _round_to(y, dtype), mask=mask)

    @triton.jit
    def _rotary_neox_kernel(
        x_ptr,
        token_stride,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        table_stride,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        pos = tl.load(positions_ptr + t)
        base = x_ptr + t * token_stride + h * HEAD_DIM
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + pos * table_stride + i, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + pos * table_stride + HALF + i, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + pos * table_stride + i, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + pos * table_stride + HALF + i, mask=mask, other=0.0)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        o1 = x1 * c1 + (-x2) * s1
        o2 = x2 * c2 + x1 * s2
        dtype = x_ptr.dtype.element_ty
        tl.store(base + i, _round_to(o1, dtype), mask=mask)
        tl.store(base + HALF + i, _round_to(o2, dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        gate_ptr,
        gate_stride,
        up_ptr,
        up_stride,
        out_ptr,
        N,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + r * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + r * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # silu rounded to the dtype first, then the product (as torch's two ops round)
        s = _round_to(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
        tl.store(out_ptr + r * N + cols, _round_to(s * u, dtype), mask=mask)


def _require() -> None:
    if triton is None:
        raise RuntimeError("the Triton kernels need the triton package")


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected 2-D rows with a dense last dimension")


def triton_write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``attention.write_kv_cache`` as a kernel: ``key``/``value`` ``[T, kv_heads *
    head_dim]`` (rows with a dense last dimension) into the contiguous ``kv_cache`` at
    ``slot_mapping``, converted to the cache's dtype."""
    _require()
    _check_rows("key", key)
    _check_rows("value", value)
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    row = kv_heads * head_dim
    if key.shape[1] != row or value.shape[1] != row:
        raise ValueError(f"key and value rows must have {row} values (kv_heads * head_dim)")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        num_blocks * block_size * row,
        ROW=row,
        BLOCK=_pow2(row),
        enable_fp_fusion=False,
    )


def token_sequences(seq_ranges: torch.Tensor, tokens: int) -> torch.Tensor:
    """int32 ``[tokens]``: the sequence of each listed token (tokens of no listed
    sequence: -1, and the kernel is not launched for them). The same for every layer of a
    step: an attention backend works it out once."""
    starts, ends = seq_ranges[0], seq_ranges[1]
    owner = torch.full((tokens,), -1, dtype=torch.int32, device=seq_ranges.device)
    lengths = ends - starts
    seq_ids = torch.arange(seq_ranges.shape[1], dtype=torch.int32, device=seq_ranges.device)
    flat = torch.repeat_interleave(seq_ids, lengths)
    index = torch.repeat_interleave(starts, lengths) + (
        torch.arange(int(lengths.sum()), device=seq_ranges.device)
        - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    )
    owner[index] = flat
    return owner


def triton_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_ranges: torch.Tensor,
    block_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    token_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query token of the listed sequences (``query`` ``[T, heads * head_dim]``)
    attends to its context in ``kv_cache`` (keys and values already written), read
    through ``block_tables``; returns ``out`` ``[T, heads * head_dim]`` in the query's
    dtype (softmax and sums in float32). ``softcap``: scores become ``softcap *
    tanh(score / softcap)`` (Gemma 2). Rows of tokens of no listed sequence are left as
    they are. ``token_seq``: :func:`token_sequences` of a step whose tokens all belong to
    listed sequences (an attention backend's steps), worked out once for its layers."""
    _require()
    _check_rows("query", query)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if query.shape[1] != num_heads * head_dim:
        raise ValueError(f"query rows must have {num_heads * head_dim} values")
    if not kv_cache.is_contiguous() or block_tables.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous and the block tables dense rows")
    tokens = query.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if tokens == 0 or seq_ranges.shape[1] == 0:
        return out
    _, num_blocks, block_size, _, _ = kv_cache.shape
    owner = token_sequences(seq_ranges, tokens) if token_seq is None else token_seq
    if token_seq is not None:
        first, last = 0, tokens  # (every token listed: no host sync to find them)
    else:
        listed = (owner >= 0).nonzero().flatten()
        if listed.numel() == 0:
            return out
        first, last = int(listed[0]), int(listed[-1]) + 1
        if listed.numel() != last - first:
            raise ValueError("the listed sequences' tokens must be contiguous in the batch")
    q_end = seq_ranges[1] - first if first else seq_ranges[1]  # (int64, as given)
    _paged_attention_kernel[(last - first, num_heads)](
        query[first:],
        query.stride(0),
        kv_cache,
        num_blocks * block_size * num_kv_heads * head_dim,
        out[first:],
        out.stride(0),
        owner[first:],
        q_end,
        seq_ranges[2],
        block_tables,
        block_tables.stride(0),
        block_size,
        float(scale),
        int(sliding_window or 0),
        float(softcap or 0.0),
        GROUP=num_heads // num_kv_heads,
        KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim),
        BLOCK_N=ATTENTION_BLOCK_N,
    )
    return out


def triton_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norms.rms_norm`` of the rows of ``x`` ``[T, h]``; with ``residual``, the pair
    ``(residual + x, rms_norm(residual + x))`` (the sum rounded to ``x``'s dtype first)."""
    _require()
    _check_rows("x", x)
    tokens, n = x.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    if residual is not None:
        _check_rows("residual", residual)
    if tokens:
        _rms_norm_kernel[(tokens,)](
            x,
            x.stride(0),
            residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0,
            total,
            weight,
            out,
            float(eps),
            float(offset),
            N=n,
            BLOCK=_pow2(n),
            HAS_RESIDUAL=residual is not None,
            HAS_OFFSET=bool(offset),
        )
    return (total, out) if residual is not None else out


def triton_rotary_neox_(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
) -> None:
    """``rotary.apply_rotary`` in place on ``query`` ``[T, heads, d]`` and ``key`` ``[T,
    kv_heads, d]`` (heads adjacent, tokens evenly strided) with rows ``positions`` of
    ``cos``/``sin`` (``[max_positions, rotary_dim]``, float32, contiguous); products in
    float32, rounded to the tensor's dtype once, bit for bit the reference's."""
    _require()
    if rotary_dim % 2 or rotary_dim > query.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most the head size")
    for x in (query, key):
        if x.stride(-1) != 1 or (x.shape[-2] > 1 and x.stride(-2) != x.shape[-1]):
            raise ValueError("each token's heads must be adjacent, dense rows")
        if x.shape[0]:
            _rotary_neox_kernel[(x.shape[0], x.shape[1])](
                x,
                x.stride(0),
                positions,
                cos,
                sin,
                cos.stride(0),
                HEAD_DIM=x.shape[-1],
                HALF=rotary_dim // 2,
                BLOCK=_pow2(rotary_dim // 2),
                enable_fp_fusion=False,
            )


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[T, n]`` of one dtype (silu rounded to it, then the
    product, as torch's two ops)."""
    _require()
    _check_rows("gate", gate)
    _check_rows("up", up)
    if gate.dtype != up.dtype or gate.shape != up.shape:
        raise ValueError("silu_mul takes gate and up of one shape and dtype")
    tokens, n = gate.shape
    out = torch.empty((tokens, n), dtype=gate.dtype, device=gate.device)
    if tokens and n:
        block = min(block, _pow2(n))
        _silu_mul_kernel[(tokens, triton.cdiv(n, block))](
            gate, gate.stride(0), up, up.stride(0), out, n, BLOCK=block
        )
    return out
