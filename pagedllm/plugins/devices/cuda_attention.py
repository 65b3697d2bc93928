"""The cuda device's attention backend: the Triton kernels of
``pagedllm.kernels.triton_attention``. One kernel call writes the step's keys and values
into the paged cache, one more attends every query token of the step (decodes, prefill
chunks over cached context and whole prompts alike) to its context read through its
block table: no gather, no padding, no per-request launch.

It runs wherever Triton does: compiled on a GPU, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check it against the reference backend; select it on
any device with ``PAGEDLLM_ATTENTION_BACKEND=triton_paged``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.core.attention.metadata import kernel_step
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import AttentionBackend
from pagedllm.core.transfer import to_device
from pagedllm.kernels.triton_attention import (
    interpreted,
    token_sequences,
    triton_available,
    triton_paged_attention,
    triton_write_kv_cache,
)

__all__ = ["TritonMetadata", "TritonPagedBackend"]


@dataclasses.dataclass(slots=True)
class TritonMetadata:
    num_tokens: int
    # Cache slot of every token of the flat batch.
    slot_mapping: torch.Tensor
    # int64 [3, S]: each request's first and end token and its context length; int32
    # block tables [S, max_blocks]; int32 [T]: each token's request.
    seq_ranges: torch.Tensor
    block_tables: torch.Tensor
    token_seq: torch.Tensor
    kv_caches: list[torch.Tensor]
    backend: Any = None


class TritonPagedBackend(AttentionBackend):
    name = "triton_paged"
    logits_soft_cap = True

    def __init__(self) -> None:
        if not triton_available():
            raise ConfigError(
                "the triton_paged attention backend needs the triton package (pip install triton)"
            )
        if not interpreted() and not torch.cuda.is_available():
            raise ConfigError(
                "the triton_paged attention backend runs on a GPU that Triton compiles for; "
                "on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)"
            )

    def build_metadata(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> TritonMetadata:
        step = kernel_step(query_lens, context_lens, block_tables, block_size)
        return TritonMetadata(
            num_tokens=step.num_tokens,
            slot_mapping=to_device(step.slot_mapping, device),
            seq_ranges=to_device(step.seq_ranges, device),
            block_tables=to_device(step.block_tables, device),
            token_seq=to_device(token_sequences(step.seq_ranges, step.num_tokens), device),
            kv_caches=kv_caches,
            backend=self,
        )

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: TritonMetadata,
    ) -> torch.Tensor:
        kv_cache = metadata.kv_caches[layer.layer_index]
        triton_write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return triton_paged_attention(
            query,
            kv_cache,
            metadata.seq_ranges,
            metadata.block_tables,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.scale,
            layer.sliding_window,
            softcap=getattr(layer, "logits_soft_cap", None),
            token_seq=metadata.token_seq,
        )
