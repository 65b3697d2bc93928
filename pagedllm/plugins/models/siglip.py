"""A SigLIP vision tower, as Gemma 3 (and Idefics3-like models) use it: transformers' own
module for the checkpoint's ``vision_config`` (``AutoModel.from_config``, as transformers'
multimodal models build it; LLaVA's CLIP tower is built the same way), under the names
that transformers 5 saves it with (``vision_tower.embeddings...``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The tower's inner module in transformers 4's checkpoints, which transformers 5's has not.
CHECKPOINT_RENAMES = (("vision_tower.vision_model.", "vision_tower."),)


class SiglipTower(nn.Module):
    """Patch embeddings and encoder layers of a SigLIP vision model: ``forward(pixels)``
    is its last hidden state, ``[images, patches, hidden]`` (no pooling head)."""

    def __init__(self, vision_config: Any) -> None:
        import transformers

        super().__init__()
        model = transformers.AutoModel.from_config(vision_config)
        # (transformers 5's SiglipVisionModel is the transformer itself; 4's wraps it)
        model = getattr(model, "vision_model", model)
        self.embeddings = model.embeddings
        self.encoder = model.encoder
        self.post_layernorm = model.post_layernorm

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixels)
        hidden = self.encoder(inputs_embeds=hidden).last_hidden_state
        return self.post_layernorm(hidden)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The tower's parameter a checkpoint tensor ``vision_tower.*`` fills (None: the
        pooling head, which the tower has not)."""
        for old, new in CHECKPOINT_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name.startswith("vision_tower.head."):
            return None
        return name
