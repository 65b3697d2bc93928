"""Paged KV-cache writes and attention over the paged cache (torch reference).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``: keys then values. A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` (``[num_tokens, kv_heads, head_dim]``) at their slots."""
    num_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_heads, head_dim)[slot_mapping] = key.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_heads, head_dim)[slot_mapping] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (any shape ``S``) as ``[*S, kv_heads, head_dim]``."""
    num_heads, head_dim = kv_cache.shape[-2:]
    flat = slots.reshape(-1)
    # index_select on rows of a 2-D view is about twice as fast as advanced indexing.
    keys = kv_cache[0].view(-1, num_heads * head_dim).index_select(0, flat)
    values = kv_cache[1].view(-1, num_heads * head_dim).index_select(0, flat)
    shape = (*slots.shape, num_heads, head_dim)
    return keys.view(shape), values.view(shape)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """Batched attention. ``query`` is ``[B, q, heads, d]``, ``key``/``value`` are
    ``[B, k, kv_heads, d]`` (grouped-query heads are shared), ``mask`` is a boolean
    ``[B, 1, q, k]`` (True = attend) or None. Returns ``[B, q, heads, d]``."""
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
