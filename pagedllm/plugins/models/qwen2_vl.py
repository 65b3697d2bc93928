"""Qwen2-VL and Qwen2.5-VL: a vision transformer over dynamic-resolution patches, merged
2x2 into the language model's width, and a Qwen2 decoder with multimodal rotary positions
(M-RoPE).

The vision tower is transformers' own module for the checkpoint's vision config, run once
per image (its ``pixel_values`` and ``image_grid_thw``, see :mod:`.qwen2_vl_processor`);
the two models differ only there (Qwen2.5-VL's windowed attention, RMSNorms and gated
MLPs). The decoder is pagedllm's Qwen2, which takes the image features as its input
embeddings at the image's placeholder rows.

M-RoPE: each token has three positions (time, height, width); each rotates its own
section of the rotary frequencies (``mrope_section``). Text tokens have three equal
positions; an image's tokens, ``base + (t, row, column)`` of their grid, where ``base``
is where the text before them left off; the text after an image goes on from ``base +
max(grid)``, so a request's positions run ``delta`` = sum over its images of ``max(grid)
- tokens`` behind its 1-D ones past them. The runner gives 1-D positions and each step's
item grids (:meth:`SupportsMultiModal.set_item_grids`); the decoder makes the 3-D
positions of them (transformers' ``get_rope_index``). A step without image tokens to
compute rotates by ``position + delta`` in all sections, which is plain RoPE, so it takes
the 1-D kernels.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.multimodal import SupportsMultiModal
from pagedllm.core.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.kernels.rotary import apply_rotary
from pagedllm.plugins.models.common import VisionLanguageWeights
from pagedllm.plugins.models.llama import Qwen2DecoderLayer, Qwen2ForCausalLM
from pagedllm.plugins.models.llava import LlavaTextModel

# Checkpoint prefixes -> this model's (transformers 5's layout; older checkpoints name the
# decoder ``model.`` and the vision tower ``visual.`` already).
_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over ``[T]`` positions (text) or ``[3, T]`` ones, whose time, height and width
    rows each rotate their section of the frequencies (``mrope_section``)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__(config, head_dim, max_positions)
        section = list(rope_parameters(config).get("mrope_section") or ())
        half = self.rotary_dim // 2
        if len(section) != 3 or sum(section) != half:
            raise ConfigError(
                f"mrope_section {section}: three sections of the {half} rotary frequencies"
            )
        # The position row (0: time, 1: height, 2: width) of each rotary dimension.
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section)).repeat(2)
        self.register_buffer("section_rows", rows.to(self.cos.device), persistent=False)
        self._gathered_3d: tuple | None = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        # Every layer of a step passes the same positions tensor: gather once per step.
        cached = self._gathered_3d
        if cached is not None and cached[0] is positions and cached[1] == query.dtype:
            cos, sin = cached[2], cached[3]
        else:
            self.check_positions(positions)
            dims = torch.arange(self.rotary_dim, device=positions.device)
            chosen = positions[self.section_rows].T  # [T, rotary_dim]
            cos = self.cos[chosen, dims].to(query.dtype)
            sin = self.sin[chosen, dims].to(query.dtype)
            self._gathered_3d = (positions, query.dtype, cos, sin)
        return (
            apply_rotary(query, cos, sin, self.rotary_dim),
            apply_rotary(key, cos, sin, self.rotary_dim),
        )


def span_positions(first: int, count: int, items: tuple[Any, ...]) -> torch.Tensor:
    """The ``[3, count]`` M-RoPE positions of a request's tokens ``first`` to ``first +
    count``, given its items' ``(offset, length, (t, h, w))`` in prompt order."""
    p = torch.arange(first, first + count)
    out = p.repeat(3, 1)
    shift = 0  # (how far the positions run behind the 1-D ones past the items so far)
    for offset, length, (t, h, w) in items:
        inside = (p >= offset) & (p < offset + length)
        if bool(inside.any()):
            k = p[inside] - offset
            base = offset + shift
            out[0, inside] = base + k // (h * w)
            out[1, inside] = base + k // w % h
            out[2, inside] = base + k % w
        gap = max(t, h, w) - length
        out[:, p >= offset + length] += gap
        shift += gap
    return out


def mrope_positions(positions: torch.Tensor, spans: list[tuple[Any, ...]]) -> torch.Tensor:
    """A step's rotary positions: its 1-D ``positions`` where no row differs in its three
    (the rows of requests with items shifted by their delta), else ``[3, T]`` ones."""
    pieces = [(row, span_positions(first, count, items)) for row, first, count, items in spans]
    flat = all(bool((p[0] == p[1]).all() and (p[0] == p[2]).all()) for _, p in pieces)
    if flat:
        out = positions.clone()
        for row, p in pieces:
            out[row : row + p.shape[1]] = p[0].to(out.device)
        return out
    out = positions.repeat(3, 1)
    for row, p in pieces:
        out[:, row : row + p.shape[1]] = p.to(out.device)
    return out


class Qwen2VLDecoderLayer(Qwen2DecoderLayer):
    def forward(self, positions, hidden, rotary, metadata) -> torch.Tensor:
        if positions.dim() == 1:
            return super().forward(positions, hidden, rotary, metadata)
        # (3-D positions: op by op; the native layer rotates by 1-D ones)
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, metadata)
        hidden, normed = self.post_attention_layernorm.add_forward(attn, hidden)
        return hidden + self.mlp(normed)


class Qwen2VLTextModel(LlavaTextModel):
    """The Qwen2 decoder with the image features as its input embeddings at their rows
    (:class:`LlavaTextModel`'s) and M-RoPE positions made of the step's item grids."""

    layer_cls = Qwen2VLDecoderLayer

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary_emb = MRotaryEmbedding(config, head_dim, self.rotary_emb.cos.shape[0])
        self._grids: list[tuple[Any, ...]] | None = None

    def give_grids(self, spans: list[tuple[Any, ...]]) -> None:
        self._grids = spans

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spans, self._grids = self._grids, None
        if spans:
            positions = mrope_positions(positions, spans)
        return super().forward(input_ids, positions, metadata, intermediate)


class Qwen2VLForConditionalGeneration(VisionLanguageWeights, Qwen2ForCausalLM, SupportsMultiModal):
    checkpoint_renames = _RENAMES
    vision_prefixes = ("visual.",)
    model_cls: ClassVar[type[nn.Module]] = Qwen2VLTextModel
    # (the vision tower is one module on one device)
    supports_pipeline_parallel: ClassVar[bool] = False
    uses_item_grids: ClassVar[bool] = True
    # transformers' vision tower class of the architecture.
    vision_module: ClassVar[tuple[str, str]] = (
        "transformers.models.qwen2_vl.modeling_qwen2_vl",
        "Qwen2VisionTransformerPretrainedModel",
    )

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        import importlib

        # (transformers 5 keeps tie_word_embeddings on the outer config)
        self.tie_by_default = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(
            config.text_config,
            quant_config,
            max_positions=max_positions,
            disable_sliding_window=disable_sliding_window,
        )
        module, name = self.vision_module
        vision_cls = getattr(importlib.import_module(module), name)
        self.visual = vision_cls._from_config(config.vision_config)
        # (the tower stays in floats: quant_config is the text model's)
        self.quantization = None if quant_config is None else quant_config.name

    def encode(self, modality: str, inputs: Any) -> torch.Tensor:
        """One image's features (``[tokens, hidden]``) from its ``pixel_values`` (its
        patches, ``[t * h * w, channels * temporal patch * patch**2]``) and
        ``image_grid_thw`` (``[[t, h, w]]``)."""
        weight = self.visual.patch_embed.proj.weight
        pixels = inputs["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        out = self.visual(pixels, grid_thw=inputs["image_grid_thw"].to(weight.device))
        # (transformers 5 returns the merged features as the pooler output)
        return getattr(out, "pooler_output", out)

    def set_input_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        self.model.give_embeddings(rows, embeddings)

    def set_item_grids(self, spans: list[tuple[Any, ...]]) -> None:
        self.model.give_grids(spans)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_module = (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    )
