"""The attention layer models use: writes this step's keys and values into the paged
cache, then attends over each request's whole context."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.core.attention.metadata import AttentionMetadata
from pagedllm.kernels.attention import attention, gather_kv, write_kv_cache


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_index: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads cannot share {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_index = layer_index
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query`` ``[T, heads*d]``, ``key``/``value`` ``[T, kv_heads*d]`` -> ``[T, heads*d]``."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_cache = metadata.kv_caches[self.layer_index]
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        if metadata.num_decodes:
            idx = metadata.decode_token_indices
            keys, values = gather_kv(kv_cache, metadata.decode_slots)
            out = attention(
                query[idx].unsqueeze(1),
                keys.to(query.dtype),
                values.to(query.dtype),
                metadata.decode_mask(self.sliding_window),
                self.scale,
            )
            output[idx] = out.squeeze(1)
        for seq in metadata.prefills:
            start, end = seq.token_start, seq.token_end
            mask = seq.mask(self.sliding_window)
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
                self.scale,
                is_causal=mask is None,
            )
            output[start:end] = out.squeeze(0)
        return output.view(num_tokens, self.num_heads * self.head_dim)
