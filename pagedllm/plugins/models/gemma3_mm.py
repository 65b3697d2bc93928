"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, the
multimodal projector (the patch grid average-pooled to ``mm_tokens_per_image`` tokens,
an RMSNorm, a linear map) and the Gemma 3 text model (``gemma3.py``).

As transformers' at inference, an image's tokens attend to each other both ways (the
rest of the prompt causally, sliding-window layers within their window): each step's
image ranges go to the attention backend (``with_bidirectional_spans``), and the
processor asks that no step computes part of an image (``needs_whole_items``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.interfaces.multimodal import SupportsMultiModal
from pagedllm.plugins.models.common import RMSNorm, VisionLanguageWeights, renamed
from pagedllm.plugins.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
from pagedllm.plugins.models.siglip import SiglipTower

# Checkpoint prefixes (transformers 5's, and the older ``language_model.model.``) -> this
# model's parameters.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class Gemma3ImageTextModel(Gemma3Model):
    """The Gemma 3 decoder, whose input embeddings at some rows of a step are given (the
    image features of the step's image tokens, which the embedding scale does not touch)."""

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.vocab_size = config.vocab_size
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None

    def give_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self._given = (rows, embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # (an image token past the vocabulary embeds as token 0, as in transformers)
        input_ids = torch.where(input_ids < self.vocab_size, input_ids, 0)
        hidden = super().embed(input_ids, positions)
        if self._given is not None:
            rows, embeddings = self._given
            self._given = None
            hidden = hidden.clone()
            hidden[rows] = embeddings.to(hidden.dtype)
        return hidden


class Gemma3Projector(nn.Module):
    """transformers' ``Gemma3MultiModalProjector``, under its checkpoint names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size)
        )
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, offset=1.0)
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        images, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(
            images, hidden, self.patches_per_side, self.patches_per_side
        )
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel, self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(VisionLanguageWeights, Gemma3ForCausalLM, SupportsMultiModal):
    checkpoint_renames = _RENAMES
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
    model_cls: ClassVar[type[nn.Module]] = Gemma3ImageTextModel
    # (the vision tower is one module on one device)
    supports_pipeline_parallel: ClassVar[bool] = False
    attends_items_bidirectionally: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__(
            config.text_config,
            quant_config,
            max_positions=max_positions,
            disable_sliding_window=disable_sliding_window,
        )
        self.vision_tower = SiglipTower(config.vision_config)
        self.multi_modal_projector = Gemma3Projector(config)
        # (the tower and the projector stay in floats: quant_config is the text model's)
        self.quantization = None if quant_config is None else quant_config.name
        self._spans: dict[int, tuple[tuple[int, int], ...]] | None = None

    def checkpoint_name(self, name: str) -> str | None:
        name = renamed(name, _RENAMES)
        if name.startswith("vision_tower."):
            return SiglipTower.checkpoint_name(name)
        return Gemma3ForCausalLM.checkpoint_name(self, name)

    def encode(self, modality: str, inputs: Any) -> torch.Tensor:
        """One image's ``mm_tokens_per_image`` features from its pixel values
        (``[1, 3, H, W]``)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = inputs.to(device=weight.device, dtype=weight.dtype)
        features = self.multi_modal_projector(self.vision_tower(pixels))
        return features.reshape(-1, features.shape[-1])

    def set_input_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self.model.give_embeddings(rows, embeddings)

    def set_bidirectional_items(self, spans: dict[int, tuple[tuple[int, int], ...]]) -> None:
        self._spans = spans

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._spans:
            attn_metadata = attn_metadata.backend.with_bidirectional_spans(
                attn_metadata, self._spans
            )
        self._spans = None
        return super().forward(input_ids, positions, attn_metadata, intermediate)
