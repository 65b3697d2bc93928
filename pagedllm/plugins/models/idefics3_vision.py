"""Idefics3's (and SmolVLM's) vision transformer: SigLIP whose patch position embeddings
are bucketed over each image's own patch grid (NaViT-style, so that images of any size
smaller than ``image_size`` take fractional positions of the full grid), with a patch
attention mask for padded pixels; and the connector, a pixel shuffle by ``scale_factor``
and a linear projection into the language model's width. Parameter names are the
checkpoints' (``vision_model.*``, ``connector.*``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.plugins.models.common import activation


class VisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size
        )
        self.position_embedding = nn.Embedding(self.per_side**2, config.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        batch = pixels.shape[0]
        embeddings = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        device = pixels.device
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)
        rows = patch_mask[:, :, 0].sum(dim=1)
        cols = patch_mask[:, 0, :].sum(dim=1)
        # (each image's valid patches spread over the whole position grid)
        h = torch.arange(patch_mask.shape[1], device=device, dtype=torch.float32)
        w = torch.arange(patch_mask.shape[2], device=device, dtype=torch.float32)
        frac_h = (h[None, :] * (1.0 / rows)[:, None]).clamp(max=1.0 - 1e-6)
        frac_w = (w[None, :] * (1.0 / cols)[:, None]).clamp(max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.per_side + bucket_w[:, None, :]).reshape(batch, -1)
        ids = torch.where(patch_mask.reshape(batch, -1), ids, torch.zeros_like(ids))
        return embeddings + self.position_embedding(ids)


class VisionAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = width // self.heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), attn_mask=mask
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """``pixels`` ``[crops, 3, H, W]``, ``pixel_mask`` ``[crops, H, W]`` (the
        unpadded pixels): ``[crops, patches, hidden]``."""
        p = self.patch_size
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        x = self.embeddings(pixels, patch_mask)
        flat = patch_mask.reshape(patch_mask.shape[0], -1)
        # (keys of padded patches masked out; all valid: no mask, as transformers)
        mask = None if bool(flat.all()) else flat[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


class Idefics3Connector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = nn.Module()
        width = config.vision_config.hidden_size * config.scale_factor**2
        self.modality_projection.proj = nn.Linear(width, config.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``[crops, side * side, d]`` -> ``[crops, side * side / scale**2, d * scale**2]``:
    each ``scale x scale`` block of patches becomes one token (transformers' order)."""
    batch, length, dim = x.shape
    side = int(length**0.5)
    x = x.view(batch, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(batch, side // scale, side // scale, dim * scale**2).permute(0, 2, 1, 3)
    return x.reshape(batch, length // scale**2, dim * scale**2)
