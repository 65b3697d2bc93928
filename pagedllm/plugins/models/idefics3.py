"""Idefics3 and SmolVLM: a SigLIP-like vision transformer over each crop of an image
(:mod:`~pagedllm.plugins.models.idefics3_vision`), a pixel-shuffle connector and a Llama
language model (pagedllm's, taking a crop's features as its input embeddings at the crop's
image tokens, as LLaVA's does)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.interfaces.multimodal import SupportsMultiModal
from pagedllm.plugins.models.common import VisionLanguageWeights
from pagedllm.plugins.models.idefics3_vision import Idefics3Connector, Idefics3VisionTransformer
from pagedllm.plugins.models.llama import LlamaForCausalLM
from pagedllm.plugins.models.llava import LlavaTextModel

_RENAMES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


class Idefics3ForConditionalGeneration(VisionLanguageWeights, LlamaForCausalLM, SupportsMultiModal):
    checkpoint_renames = _RENAMES
    vision_prefixes = ("vision_model.", "connector.")
    model_cls: ClassVar[type[nn.Module]] = LlavaTextModel
    # (the vision tower is one module on one device)
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        text = copy.deepcopy(config.text_config)
        # (the whole model's flag ties the head, as in transformers: a tied checkpoint
        # saves no lm_head)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(
            text,
            quant_config,
            max_positions=max_positions,
            disable_sliding_window=disable_sliding_window,
        )
        self.vision_model = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)
        # (the tower and the connector stay in floats: quant_config is the text model's)
        self.quantization = None if quant_config is None else quant_config.name

    def encode(self, modality: str, inputs: Any) -> torch.Tensor:
        """A crop's features: ``inputs`` is its pixel values ``[1, 3, H, W]`` and pixel
        attention mask ``[1, H, W]``."""
        pixels, mask = inputs
        weight = self.connector.modality_projection.proj.weight
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        features = self.connector(self.vision_model(pixels, mask.to(weight.device)))
        return features.reshape(-1, features.shape[-1])

    def set_input_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self.model.give_embeddings(rows, embeddings)


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    pass
