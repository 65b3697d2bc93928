"""What every attention layer needs to know about one step's flat batch.

Built once per step by the model runner and shared by all layers. Requests that add one
token (decodes) are attended to together, padded to the longest context; the others
(prefills and prefill chunks) one by one, each over its whole context.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.kernels.attention import causal_window_mask


@dataclasses.dataclass(slots=True)
class PrefillSequence:
    """A request contributing several tokens this step."""

    token_start: int
    token_end: int
    # Cache slots of its whole context (cached tokens and this step's), in order.
    slots: torch.Tensor
    # Masks by sliding window (None = full attention); None when plainly causal.
    masks: dict[int | None, torch.Tensor | None] = dataclasses.field(default_factory=dict)
    # Context position ranges [start, end) whose query tokens also see the keys after them
    # up to the range's end (AttentionBackend.with_bidirectional_spans).
    bidirectional: tuple[tuple[int, int], ...] = ()

    @property
    def num_query_tokens(self) -> int:
        return self.token_end - self.token_start

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        if sliding_window not in self.masks:
            context = self.slots.shape[0]
            if (
                self.num_query_tokens == context
                and (sliding_window is None or sliding_window >= context)
                and not self.bidirectional
            ):
                # No cached context: plain causal attention.
                self.masks[sliding_window] = None
            else:
                key_pos = torch.arange(context)
                query_pos = key_pos[context - self.num_query_tokens :]
                mask = causal_window_mask(query_pos, key_pos, sliding_window)
                for start, end in self.bidirectional:
                    # (as transformers' Gemma 3: within a range both ways, and the
                    # sliding window still bounds how far back a query sees)
                    inside = (query_pos >= start) & (query_pos < end)
                    ahead = (key_pos > query_pos[:, None]) & (key_pos < end)
                    mask |= inside[:, None] & ahead
                self.masks[sliding_window] = mask[None, None]
        return self.masks[sliding_window]


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    # Cache slot of every token of the flat batch.
    slot_mapping: torch.Tensor
    # Decodes: their index in the flat batch, their context's slots [B, max_context]
    # (padded with the row's first slot) and context lengths.
    decode_token_indices: torch.Tensor
    decode_slots: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[PrefillSequence]
    kv_caches: list[torch.Tensor]
    # The backend that built this metadata and computes attention with it.
    backend: Any = None
    _decode_masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_indices.shape[0])

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, 1, max_context]``: which padded context slots each decode attends."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            lens = self.decode_context_lens
            key_pos = torch.arange(self.decode_slots.shape[1])
            query_pos = (lens - 1).unsqueeze(-1)
            mask = causal_window_mask(query_pos, key_pos, sliding_window)  # [B, 1, K]
            self._decode_masks[sliding_window] = mask[:, None]
            mask = self._decode_masks[sliding_window]
        return mask


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    kv_caches: list[torch.Tensor],
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for requests adding ``query_lens[i]`` tokens to reach ``context_lens[i]``
    tokens of context, whose blocks are ``block_tables[i]``; in flat-batch order."""
    slot_chunks: list[torch.Tensor] = []
    decode_idx: list[int] = []
    decode_slot_rows: list[torch.Tensor] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSequence] = []
    offset = 0
    for query_len, context_len, blocks in zip(query_lens, context_lens, block_tables, strict=True):
        num_blocks = -(-context_len // block_size)
        table = torch.tensor(blocks[:num_blocks], dtype=torch.long)
        context_slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()
        context_slots = context_slots[:context_len]
        slot_chunks.append(context_slots[context_len - query_len :])
        if query_len == 1:
            decode_idx.append(offset)
            decode_slot_rows.append(context_slots)
            decode_lens.append(context_len)
        else:
            prefills.append(PrefillSequence(offset, offset + query_len, context_slots.to(device)))
        offset += query_len
    max_context = max(decode_lens, default=0)
    decode_slots = torch.empty((len(decode_lens), max_context), dtype=torch.long)
    for row, slots in enumerate(decode_slot_rows):
        # Padding repeats the row's first slot: masked out, but always a written slot
        # (an unwritten one could hold NaN, and NaN * 0 is NaN).
        decode_slots[row] = slots[0]
        decode_slots[row, : slots.shape[0]] = slots
    return AttentionMetadata(
        num_tokens=offset,
        slot_mapping=torch.cat(slot_chunks).to(device) if slot_chunks else torch.empty(0),
        decode_token_indices=torch.tensor(decode_idx, dtype=torch.long, device=device),
        decode_slots=decode_slots.to(device),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long),
        prefills=prefills,
        kv_caches=kv_caches,
    )


@dataclasses.dataclass(slots=True)
class KernelStep:
    """A step as the paged-attention kernels take it (cpu_paged's C kernel, triton_paged):
    every token's slot, and for each request the kernel attends, its first and end token in
    the flat batch and its context length (int64 ``[3, S]``) and its blocks (int32 ``[S,
    max_blocks]``). ``others``: the requests left to another path, as ``(first token,
    query tokens, context length, blocks)``."""

    num_tokens: int
    slot_mapping: torch.Tensor
    seq_ranges: torch.Tensor
    block_tables: torch.Tensor
    others: list[tuple[int, int, int, list[int]]]


def kernel_step(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    max_query: int | None = None,
) -> KernelStep:
    """The :class:`KernelStep` of requests adding ``query_lens[i]`` tokens to reach
    ``context_lens[i]``, whose blocks are ``block_tables[i]``; requests adding more than
    ``max_query`` tokens (None: no limit) go to ``others``. CPU tensors."""
    slots: list[int] = []
    ranges: tuple[list[int], list[int], list[int]] = ([], [], [])
    tables: list[list[int]] = []
    others: list[tuple[int, int, int, list[int]]] = []
    offset = 0
    for query_len, context_len, blocks in zip(query_lens, context_lens, block_tables, strict=True):
        for pos in range(context_len - query_len, context_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        if max_query is None or query_len <= max_query:
            ranges[0].append(offset)
            ranges[1].append(offset + query_len)
            ranges[2].append(context_len)
            tables.append(blocks[: -(-context_len // block_size)])
        else:
            others.append((offset, query_len, context_len, blocks))
        offset += query_len
    width = max((len(t) for t in tables), default=0)
    table = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return KernelStep(
        num_tokens=offset,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        seq_ranges=torch.tensor(ranges, dtype=torch.long).reshape(3, -1),
        block_tables=table,
        others=others,
    )
