"""An attention backend written from the contract alone: its own per-step metadata and
plain torch, one request at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.core.interfaces import AttentionBackend


# [docs:attention]
@dataclasses.dataclass(slots=True)
class LoopMetadata:
    # The engine's Attention layer calls ``metadata.backend.forward``.
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    # The cache slot each token of the flat batch is written to.
    slot_mapping: torch.Tensor
    # Per request: (first token in the flat batch, one past its last, slots of its whole
    # context in position order: cached tokens first, then this step's).
    sequences: list[tuple[int, int, torch.Tensor]]


class LoopBackend(AttentionBackend):
    """Attention one request at a time, in plain torch."""

    name = "dummy_loop"

    def build_metadata(self, query_lens, context_lens, block_tables, block_size, kv_caches, device):
        sequences, offset = [], 0
        for query_len, context_len, blocks in zip(
            query_lens, context_lens, block_tables, strict=True
        ):
            positions = torch.arange(context_len)
            table = torch.tensor(blocks, dtype=torch.long)
            slots = table[positions // block_size] * block_size + positions % block_size
            sequences.append((offset, offset + query_len, slots.to(device)))
            offset += query_len
        slot_mapping = [slots[len(slots) - (end - start) :] for start, end, slots in sequences]
        return LoopMetadata(self, kv_caches, torch.cat(slot_mapping), sequences)

    def forward(self, layer, query, key, value, metadata):
        tokens, heads, kv_heads, dim = (
            query.shape[0],
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
        )
        # kv_caches[i] is [2, num_blocks, block_size, kv_heads, head_dim]: keys, values.
        cache = metadata.kv_caches[layer.layer_index]
        keys_cache = cache[0].view(-1, kv_heads, dim)
        values_cache = cache[1].view(-1, kv_heads, dim)
        keys_cache[metadata.slot_mapping] = key.view(tokens, kv_heads, dim).to(cache.dtype)
        values_cache[metadata.slot_mapping] = value.view(tokens, kv_heads, dim).to(cache.dtype)
        query = query.view(tokens, heads, dim)
        output = torch.empty_like(query)
        for start, end, slots in metadata.sequences:
            # Grouped-query attention: each KV head serves heads // kv_heads query heads.
            keys = keys_cache[slots].to(query.dtype).repeat_interleave(heads // kv_heads, 1)
            values = values_cache[slots].to(query.dtype).repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", query[start:end], keys) * layer.scale
            key_pos = torch.arange(len(slots), device=query.device)
            query_pos = key_pos[len(slots) - (end - start) :, None]
            allowed = key_pos <= query_pos
            if layer.sliding_window is not None:
                allowed &= query_pos - key_pos < layer.sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            output[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return output.view(tokens, heads * dim)


# [/docs:attention]


class CountingBackend(LoopBackend):
    """:class:`LoopBackend`, counting the layer calls it serves (the dummy device's)."""

    name = "dummy_attn"
    calls = 0

    def forward(self, layer: Any, query, key, value, metadata):
        type(self).calls += 1
        return super().forward(layer, query, key, value, metadata)
