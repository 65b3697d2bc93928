"""The reference attention backend: plain torch, ``scaled_dot_product_attention``.

Decodes (one new token) are attended to together, padded to the longest context;
prefills and prefill chunks one by one over their whole context. It reads every KV-cache
dtype, fp8 included (``kv_cache_dtypes``): with an fp8 cache, prefills too read their keys
and values back from the cache, so that a prompt attends to the same values whether it is
computed in one step, in chunks or from cached blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.attention.metadata import (
    AttentionMetadata,
    PrefillSequence,
    build_attention_metadata,
)
from pagedllm.core.interfaces import AttentionBackend
from pagedllm.kernels.attention import (
    FP8_KV_DTYPES,
    attention,
    calculate_kv_scales,
    read_kv,
    write_kv_cache,
)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    logits_soft_cap = True
    bidirectional_spans = True

    def build_metadata(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> AttentionMetadata:
        metadata = build_attention_metadata(
            query_lens, context_lens, block_tables, block_size, kv_caches, device
        )
        metadata.backend = self
        return metadata

    def with_bidirectional_spans(
        self, metadata: AttentionMetadata, spans: dict[int, tuple[tuple[int, int], ...]]
    ) -> AttentionMetadata:
        # (a decode's one query token is the last of its context: nothing after it to see)
        for seq in metadata.prefills:
            given = spans.get(seq.token_start)
            if given:
                seq.bidirectional = tuple(given)
                seq.masks.clear()
        return metadata

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, layer.num_heads, layer.head_dim)
        key = key.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        value = value.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        kv_cache = metadata.kv_caches[layer.layer_index]
        if getattr(layer, "calculate_kv_scales", False) and kv_cache.dtype in FP8_KV_DTYPES:
            calculate_kv_scales(layer, key, value)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, *kv_scales(layer))
        if not metadata.prefills and metadata.num_decodes == num_tokens:
            # Decode-only step: no scatter into an output buffer needed.
            keys, values = read_kv(kv_cache, metadata.decode_slots, query.dtype, *kv_scales(layer))
            out = attention(
                query.unsqueeze(1),
                keys,
                values,
                metadata.decode_mask(layer.sliding_window),
                layer.scale,
                soft_cap=soft_cap(layer),
            )
            return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
        output = torch.empty_like(query)
        if metadata.num_decodes:
            idx = metadata.decode_token_indices
            keys, values = read_kv(kv_cache, metadata.decode_slots, query.dtype, *kv_scales(layer))
            out = attention(
                query[idx].unsqueeze(1),
                keys,
                values,
                metadata.decode_mask(layer.sliding_window),
                layer.scale,
                soft_cap=soft_cap(layer),
            )
            output[idx] = out.squeeze(1)
        for seq in metadata.prefills:
            output[seq.token_start : seq.token_end] = prefill_attention(
                layer, query, key, value, kv_cache, seq
            )
        return output.view(num_tokens, layer.num_heads * layer.head_dim)


def kv_scales(layer: Any) -> tuple[float, float]:
    """The layer's fp8 KV-cache scales (1.0 for a layer object without them)."""
    return getattr(layer, "k_scale", 1.0), getattr(layer, "v_scale", 1.0)


def soft_cap(layer: Any) -> float | None:
    """The layer's attention logit soft-cap (None for a layer object without one)."""
    return getattr(layer, "logits_soft_cap", None)


def prefill_attention(
    layer: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSequence,
) -> torch.Tensor:
    """One request's attention over its whole context, ``[query tokens, heads, d]``.

    ``query`` ``[T, heads, d]`` and ``key``/``value`` ``[T, kv_heads, d]`` are the step's
    flat batch, whose keys and values are already in ``kv_cache``."""
    start, end = seq.token_start, seq.token_end
    mask = seq.mask(layer.sliding_window)
    if mask is None and kv_cache.dtype not in FP8_KV_DTYPES:
        # No cached context: this step's keys are the whole context.
        keys, values = key[start:end], value[start:end]
    else:
        keys, values = read_kv(kv_cache, seq.slots, query.dtype, *kv_scales(layer))
    out = attention(
        query[start:end].unsqueeze(0),
        keys.unsqueeze(0).to(query.dtype),
        values.unsqueeze(0).to(query.dtype),
        mask,
        layer.scale,
        is_causal=mask is None,
        soft_cap=soft_cap(layer),
    )
    return out.squeeze(0)
