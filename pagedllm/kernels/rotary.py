"""Rotary position embeddings (torch reference)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, rotary_dim]``
    (NeoX layout: the two halves of the rotary dims are paired). Dims past
    ``rotary_dim`` pass through (partial rotary)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if rotary_dim is None or rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
