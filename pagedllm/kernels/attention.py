"""Paged KV-cache writes and attention over the paged cache (torch reference).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``: keys then values. A token's *slot* is ``block_id * block_size + offset``.

An fp8 cache (``--kv-cache-dtype fp8``: float8_e4m3fn, or float8_e5m2) holds keys divided
by the layer's ``k_scale`` and values by its ``v_scale``, clamped to the format's range;
:func:`read_kv` multiplies them back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: --calculate-kv-scales maps the first
# batch's largest key to 200 and value to 100, headroom for larger ones later (e4m3's
# largest value is 448).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: divided by ``scale`` and clamped to the
    format's range first when the cache is fp8."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    x = x.float()
    if scale != 1.0:
        x = x / scale
    return x.clamp(-limit, limit).to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached values (``to_cache``'s) as ``dtype``: multiplied by ``scale`` when fp8."""
    if x.dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    x = x.float()
    if scale != 1.0:
        x = x * scale
    return x.to(dtype)


def calculate_kv_scales(layer: Any, key: torch.Tensor, value: torch.Tensor) -> None:
    """``--calculate-kv-scales``: the layer's scales from its first batch, once."""
    tiny = torch.finfo(torch.float32).tiny
    layer.k_scale = max(key.abs().max().item() / K_SCALE_RANGE, tiny)
    layer.v_scale = max(value.abs().max().item() / V_SCALE_RANGE, tiny)
    layer.calculate_kv_scales = False


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` (``[num_tokens, kv_heads, head_dim]``) at their slots."""
    num_heads, head_dim = kv_cache.shape[-2:]
    dtype = kv_cache.dtype
    kv_cache[0].view(-1, num_heads, head_dim)[slot_mapping] = to_cache(key, dtype, k_scale)
    kv_cache[1].view(-1, num_heads, head_dim)[slot_mapping] = to_cache(value, dtype, v_scale)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (any shape ``S``) as ``[*S, kv_heads, head_dim]``."""
    num_heads, head_dim = kv_cache.shape[-2:]
    flat = slots.reshape(-1)
    # index_select on rows of a 2-D view is about twice as fast as advanced indexing.
    keys = kv_cache[0].view(-1, num_heads * head_dim).index_select(0, flat)
    values = kv_cache[1].view(-1, num_heads * head_dim).index_select(0, flat)
    shape = (*slots.shape, num_heads, head_dim)
    return keys.view(shape), values.view(shape)


def read_kv(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_kv` in ``dtype``, fp8 values scaled back."""
    keys, values = gather_kv(kv_cache, slots)
    return from_cache(keys, dtype, k_scale), from_cache(values, dtype, v_scale)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Batched attention. ``query`` is ``[B, q, heads, d]``, ``key``/``value`` are
    ``[B, k, kv_heads, d]`` (grouped-query heads are shared), ``mask`` is a boolean
    ``[B, 1, q, k]`` (True = attend) or None. Returns ``[B, q, heads, d]``.

    ``soft_cap``: scaled scores become ``soft_cap * tanh(score / soft_cap)`` before the
    mask and softmax (Gemma 2's attention logit soft-capping)."""
    if soft_cap is not None:
        return capped_attention(query, key, value, mask, scale, soft_cap, is_causal)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[2] != key.shape[2],
    )
    return out.transpose(1, 2)


def capped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """:func:`attention` with soft-capped scores, computed as transformers' eager
    attention computes it (SDPA has no soft-cap): scores in the query's dtype, softmax
    in float32."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def causal_window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """``[..., q, k]`` boolean mask: a query sees keys at or before its position, and with
    a sliding window only the last ``sliding_window`` positions (its own included)."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    mask = k <= q
    if sliding_window is not None:
        mask &= (q - k) < sliding_window
    return mask
