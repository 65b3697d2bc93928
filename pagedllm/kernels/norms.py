"""Normalisations (torch reference, numerically as Hugging Face computes them)."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """``weight * x / rms(x)`` computed in float32; ``offset`` is added to the weight
    (Gemma stores ``weight - 1``)."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if offset:
        return (hidden * (offset + weight.float())).to(dtype)
    return weight * hidden.to(dtype)
