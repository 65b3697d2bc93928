"""LLaVA (1.5): a vision tower (CLIP), a two-layer projector and a Llama language model.

The language model is pagedllm's Llama (its decoder takes the image features as its input
embeddings at the image's placeholder positions); the vision tower is transformers' own
module for the checkpoint's vision config (``AutoModel.from_config``, as transformers'
LLaVA builds it), run once per image: its hidden states of ``vision_feature_layer``, the
CLS row dropped under the ``default`` feature-select strategy, through the projector.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.interfaces.multimodal import SupportsMultiModal
from pagedllm.plugins.models.common import VisionLanguageWeights, activation
from pagedllm.plugins.models.llama import LlamaForCausalLM, LlamaModel

# Checkpoint prefixes -> this model's parameter prefixes: the language model's (older
# checkpoints and transformers 5's own layout), and the vision tower's inner module of
# transformers 4 (``vision_tower.vision_model.``), which transformers 5 has not.
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)


class LlavaTextModel(LlamaModel):
    """The Llama decoder, whose input embeddings at some rows of a step are given (the
    image features of the step's placeholder tokens)."""

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None

    def give_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self._given = (rows, embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self._given is not None:
            rows, embeddings = self._given
            self._given = None
            hidden = hidden.clone()
            hidden[rows] = embeddings.to(hidden.dtype)
        return hidden


class LlavaProjector(nn.Module):
    """transformers' ``LlavaMultiModalProjector``, under its checkpoint names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        width = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        hidden = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(width, hidden, bias=bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageWeights, LlamaForCausalLM, SupportsMultiModal):
    checkpoint_renames = _RENAMES
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
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
        import transformers

        super().__init__(
            config.text_config,
            quant_config,
            max_positions=max_positions,
            disable_sliding_window=disable_sliding_window,
        )
        self.llava_config = config
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r}: 'default' or 'full' only"
            )
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaProjector(config)
        # (the tower and the projector stay in floats: quant_config is the text model's)
        self.quantization = None if quant_config is None else quant_config.name

    def encode(self, modality: str, inputs: Any) -> torch.Tensor:
        """One image's features: ``inputs`` is its pixel values (``[1, 3, H, W]``)."""
        config = self.llava_config
        weight = self.multi_modal_projector.linear_1.weight
        pixels = inputs.to(device=weight.device, dtype=weight.dtype)
        states = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        layers = config.vision_feature_layer
        chosen = [states[layers]] if isinstance(layers, int) else [states[i] for i in layers]
        if config.vision_feature_select_strategy == "default":
            chosen = [s[:, 1:] for s in chosen]  # (the CLS row)
        features = self.multi_modal_projector(torch.cat(chosen, dim=-1))
        return features.reshape(-1, features.shape[-1])

    def set_input_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self.model.give_embeddings(rows, embeddings)
