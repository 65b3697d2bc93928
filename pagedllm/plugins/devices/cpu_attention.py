"""The cpu device's attention backend: a paged-attention kernel (``csrc/cpu_ops.c``) that
writes the step's keys and values and reads each request's context through its block
table, with no gather of the context and no padding to the longest one.

Decodes and short prefill chunks (up to :data:`KERNEL_MAX_QUERY` tokens) go to the
kernel, all of them in one call; longer prefills to ``scaled_dot_product_attention`` as
in the reference backend, whose GEMM-based kernel is faster over many query rows. A
bfloat16 cache (``--dtype bfloat16``) is read and written by the kernel on AVX-512 CPUs
for head sizes 16 to 256 (queries and outputs in float32). Soft-capped attention scores
(Gemma 2) are the kernel's too. Where the kernel cannot run (not built, or another cache
type) every step takes the reference path.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.attention.metadata import PrefillSequence, kernel_step
from pagedllm.core.attention.torch_backend import (
    TorchSDPABackend,
    kv_scales,
    prefill_attention,
    soft_cap,
)
from pagedllm.kernels.attention import write_kv_cache
from pagedllm.kernels.batch_invariant import batch_invariant
from pagedllm.kernels.cpu_ops import (
    BF16_HEAD_DIMS,
    MAX_GROUP,
    MAX_HEAD_DIM,
    CpuOps,
    PagedMetadata,
    cpu_ops,
)

__all__ = ["KERNEL_MAX_QUERY", "CpuPagedBackend", "PagedMetadata"]

# Requests adding at most this many tokens in a step are attended by the kernel. Measured
# on a 2-core EPYC, default model in bfloat16, whole prefill steps, kernel / SDPA past 16:
# 64 prompts of 128 tokens 4.3-4.8 / 4.6-5.2 s (attention alone 0.6 / 1.1 s), 16 x 256
# 2.32 / 2.42 s, 4 x 512 1.44 / 1.55 s, 2 x 1024 1.74 / 1.67 s, 1 x 2048 2.44 / 2.16 s.
KERNEL_MAX_QUERY = 256


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu_paged"

    def batch_invariant_refusal(
        self, layers: list[Any], kv_cache_dtype: torch.dtype | None
    ) -> str | None:
        """The kernel attends each (query token, KV head) over the token's context in
        chunks of keys in a fixed order, whatever the step holds (on the bfloat16
        dot-product path, a token's KV heads in turn over each chunk or each head alone,
        by the step's size: the same sums, each head's state kept between chunks), and in
        batch-invariant mode it takes prefills of every length. It needs the compiled
        kernels and, for every layer, what the kernel computes."""
        ops = cpu_ops()
        if ops is None:
            return "the paged-attention kernel is not available (no C compiler, or disabled)"
        if kv_cache_dtype is None:  # (before the model loads: the kernel itself)
            return None
        if kv_cache_dtype not in (torch.float32, torch.bfloat16) or (
            kv_cache_dtype == torch.bfloat16 and not ops.bf16_cache
        ):
            return f"the paged-attention kernel reads no {kv_cache_dtype} KV cache on this CPU"
        for layer in layers:
            if layer.head_dim > MAX_HEAD_DIM or layer.num_heads // layer.num_kv_heads > MAX_GROUP:
                return (
                    f"the paged-attention kernel takes head sizes up to {MAX_HEAD_DIM} and up "
                    f"to {MAX_GROUP} query heads per KV head, not {layer.head_dim} and "
                    f"{layer.num_heads // layer.num_kv_heads}"
                )
            if kv_cache_dtype == torch.bfloat16 and not ops.bf16_cache_ok(layer.head_dim):
                return (
                    f"the paged-attention kernel reads a bfloat16 cache for head sizes "
                    f"{sorted(BF16_HEAD_DIMS)}, not {layer.head_dim}"
                )
        return None

    def build_metadata(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> Any:
        ops = cpu_ops()
        # (a pipeline stage's caches of the layers it does not hold are empty)
        held = next((cache for cache in kv_caches if cache.dim() > 1), None)
        if ops is None or held is None or not _kernel_cache(ops, held):
            return super().build_metadata(
                query_lens, context_lens, block_tables, block_size, kv_caches, device
            )
        # (batch-invariant mode: every query through the kernel, whose result for a token
        # ignores how its prompt was chunked; SDPA's blocks follow the query length)
        max_query = None if batch_invariant() else KERNEL_MAX_QUERY
        step = kernel_step(query_lens, context_lens, block_tables, block_size, max_query=max_query)
        prefills = [
            PrefillSequence(
                offset,
                offset + query_len,
                torch.tensor(
                    [blocks[p // block_size] * block_size + p % block_size for p in range(context)]
                ),
            )
            for offset, query_len, context, blocks in step.others
        ]
        return PagedMetadata(
            num_tokens=step.num_tokens,
            slot_mapping=step.slot_mapping,
            seq_ranges=step.seq_ranges,
            block_tables=step.block_tables,
            prefills=prefills,
            kv_caches=kv_caches,
            ops=ops,
            backend=self,
        )

    def with_bidirectional_spans(
        self, metadata: Any, spans: dict[int, tuple[tuple[int, int], ...]]
    ) -> Any:
        """The kernel attends causally: the requests with spans go to SDPA's prefills."""
        if not isinstance(metadata, PagedMetadata):
            return super().with_bidirectional_spans(metadata, spans)
        block_size = next(c for c in metadata.kv_caches if c.dim() > 1).shape[2]
        moved = [
            column
            for column, start in enumerate(metadata.seq_ranges[0].tolist())
            if spans.get(start)
        ]
        if moved:
            sequences = _kernel_sequences(metadata, block_size)
            kept = [c for c in range(metadata.seq_ranges.shape[1]) if c not in moved]
            for column in moved:
                seq = sequences[column]
                seq.bidirectional = tuple(spans[seq.token_start])
                metadata.prefills.append(seq)
            metadata.seq_ranges = metadata.seq_ranges[:, kept]
            metadata.block_tables = metadata.block_tables[kept]
        for seq in metadata.prefills:
            given = spans.get(seq.token_start)
            if given and not seq.bidirectional:
                seq.bidirectional = tuple(given)
                seq.masks.clear()
        return metadata

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        if not isinstance(metadata, PagedMetadata):
            return super().forward(layer, query, key, value, metadata)
        if not all(t.stride(-1) == 1 for t in (query, key, value)):
            raise TypeError("the paged-attention kernel needs rows of contiguous values")
        num_tokens = query.shape[0]
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        kv_cache = metadata.kv_caches[layer.layer_index]
        kernel_reads_cache = kv_cache.dtype == torch.float32 or metadata.ops.bf16_cache_ok(head_dim)
        if query.dtype != torch.float32 and kernel_reads_cache:
            # (bfloat16 models: the kernel computes in float32 over the bfloat16 cache.)
            out = self.forward(layer, query.float(), key.float(), value.float(), metadata)
            return out.to(query.dtype)
        out = query.new_empty((num_tokens, heads * head_dim))
        if (
            query.dtype != torch.float32
            or not kernel_reads_cache
            or head_dim > MAX_HEAD_DIM
            or heads // kv_heads > MAX_GROUP
        ):
            # Past the kernel's limits: every request through the reference attention.
            write_kv_cache(
                key.view(num_tokens, kv_heads, head_dim),
                value.view(num_tokens, kv_heads, head_dim),
                kv_cache,
                metadata.slot_mapping,
                *kv_scales(layer),
            )
            for seq in [*_kernel_sequences(metadata, kv_cache.shape[2]), *metadata.prefills]:
                _sdpa(layer, query, key, value, kv_cache, seq, out)
            return out
        metadata.ops.paged_attention(
            query,
            key,
            value,
            kv_cache,
            metadata.slot_mapping,
            metadata.seq_ranges,
            metadata.block_tables,
            heads,
            kv_heads,
            head_dim,
            layer.scale,
            layer.sliding_window,
            out,
            soft_cap(layer),
        )
        for seq in metadata.prefills:
            _sdpa(layer, query, key, value, kv_cache, seq, out)
        return out


def _sdpa(
    layer: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSequence,
    out: torch.Tensor,
) -> None:
    """One request's attention through SDPA into its rows of ``out`` (``[T, heads*d]``)."""
    tokens, heads, kv_heads, d = query.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    result = prefill_attention(
        layer,
        query.view(tokens, heads, d),
        key.view(tokens, kv_heads, d),
        value.view(tokens, kv_heads, d),
        kv_cache,
        seq,
    )
    out[seq.token_start : seq.token_end] = result.reshape(-1, heads * d)


def _kernel_sequences(metadata: PagedMetadata, block_size: int) -> list[PrefillSequence]:
    """The kernel's requests as SDPA sequences (context slots from their block tables)."""
    sequences = []
    for row, (start, end, context) in enumerate(metadata.seq_ranges.T.tolist()):
        blocks = metadata.block_tables[row]
        positions = torch.arange(context)
        slots = blocks[positions // block_size].long() * block_size + positions % block_size
        sequences.append(PrefillSequence(start, end, slots))
    return sequences


def _kernel_cache(ops: CpuOps, cache: torch.Tensor) -> bool:
    """A cache type the kernel reads (bfloat16 with an AVX-512 build; the head size is
    checked per layer)."""
    return cache.dtype == torch.float32 or (cache.dtype == torch.bfloat16 and ops.bf16_cache)
