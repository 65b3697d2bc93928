"""The reference attention backend: plain torch, ``scaled_dot_product_attention``.

Decodes (one new token) are attended to together, padded to the longest context;
prefills and prefill chunks one by one over their whole context.
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
from pagedllm.kernels.attention import attention, gather_kv, write_kv_cache


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

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
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        if not metadata.prefills and metadata.num_decodes == num_tokens:
            # Decode-only step: no scatter into an output buffer needed.
            keys, values = gather_kv(kv_cache, metadata.decode_slots)
            out = attention(
                query.unsqueeze(1),
                keys.to(query.dtype),
                values.to(query.dtype),
                metadata.decode_mask(layer.sliding_window),
                layer.scale,
            )
            return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
        output = torch.empty_like(query)
        if metadata.num_decodes:
            idx = metadata.decode_token_indices
            keys, values = gather_kv(kv_cache, metadata.decode_slots)
            out = attention(
                query[idx].unsqueeze(1),
                keys.to(query.dtype),
                values.to(query.dtype),
                metadata.decode_mask(layer.sliding_window),
                layer.scale,
            )
            output[idx] = out.squeeze(1)
        for seq in metadata.prefills:
            output[seq.token_start : seq.token_end] = prefill_attention(
                layer, query, key, value, kv_cache, seq
            )
        return output.view(num_tokens, layer.num_heads * layer.head_dim)


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
    if mask is None:
        # No cached context: this step's keys are the whole context.
        keys, values = key[start:end], value[start:end]
    else:
        keys, values = gather_kv(kv_cache, seq.slots)
    out = attention(
        query[start:end].unsqueeze(0),
        keys.unsqueeze(0).to(query.dtype),
        values.unsqueeze(0).to(query.dtype),
        mask,
        layer.scale,
        is_causal=mask is None,
    )
    return out.squeeze(0)
