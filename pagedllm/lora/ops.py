"""The batched LoRA product: each token's ``x @ A[s].T @ B[s].T * scale[s]`` with ``s`` its
request's adapter slot (-1: none), added to the base layer's output.

:func:`lora_delta_reference` gathers every token's own matrices (the definition);
:func:`add_lora` groups the step's tokens by slot and runs one pair of GEMMs per adapter
(a step's tokens of one request are contiguous, and a batch holds few adapters), which is
what the engine calls."""

from __future__ import annotations

import torch


def lora_delta_reference(
    x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``[tokens, out]``: token ``t``'s delta ``x[t] @ a[s].T @ b[s].T * scale[s]`` for
    ``s = slots[t]`` (zeros where ``s < 0``); ``a`` ``[slots, r, in]``, ``b``
    ``[slots, out, r]``."""
    used = slots.clamp(min=0)
    low = torch.bmm(a[used], x.unsqueeze(-1))  # [T, r, 1]
    delta = torch.bmm(b[used], low).squeeze(-1) * scale[used].unsqueeze(-1)
    return torch.where((slots >= 0).unsqueeze(-1), delta, torch.zeros_like(delta))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """``y`` plus the LoRA deltas of the step's tokens, grouped: ``groups`` holds each
    active slot with the rows of its tokens."""
    for slot, rows in groups:
        low = x.index_select(0, rows) @ a[slot].T
        y.index_add_(0, rows, (low @ b[slot].T) * scale[slot])
    return y


def add_lora_embedding(
    y: torch.Tensor,
    ids: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """An embedding's LoRA (peft's ``lora_embedding_A`` ``[r, vocab]`` and ``_B``
    ``[dim, r]`` per slot): each token's row of ``A.T`` through ``B``, added to ``y``."""
    for slot, rows in groups:
        low = a[slot].T.index_select(0, ids.index_select(0, rows))
        y.index_add_(0, rows, (low @ b[slot].T) * scale[slot])
    return y
