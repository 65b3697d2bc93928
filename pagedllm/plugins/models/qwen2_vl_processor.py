"""Qwen2-VL's (and Qwen2.5-VL's) multimodal processor: each ``<|image_pad|>`` of a prompt
(``<|vision_start|><|image_pad|><|vision_end|>``, as its chat template writes an image)
becomes its image's tokens, one per ``merge_size x merge_size`` patches of the image
resized by the checkpoint's own image processor (dynamic resolution: to multiples of
``patch_size * merge_size`` pixels within its min and max pixels), as transformers'
``Qwen2VLProcessor`` expands it; the tokens' grid places them (M-RoPE)."""

from __future__ import annotations

import math
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.models.llava_processor import ImagePlaceholderProcessor


class Qwen2VLProcessor(ImagePlaceholderProcessor):
    def __init__(self, image_processor: Any, image_token_id: int, merge_size: int) -> None:
        super().__init__(image_processor, image_token_id)
        self.merge_size = merge_size

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any, tokenizer: Any) -> Qwen2VLProcessor:
        image_processor = cls.load_image_processor(model_path)
        token = getattr(hf_config, "image_token_id", None)
        if token is None:
            raise ConfigError(f"{model_path}: the config names no image_token_id")
        vision = hf_config.vision_config
        merge = int(vision.spatial_merge_size)
        ours = (getattr(image_processor, "merge_size", None), _first(image_processor.patch_size))
        if ours != (merge, _first(vision.patch_size)):
            raise ConfigError(
                f"{model_path}: the image processor's merge size and patch size {ours} are "
                f"not the vision tower's ({merge}, {_first(vision.patch_size)})"
            )
        return cls(image_processor, int(token), merge)

    def largest_image_size(self, options: dict[str, Any]) -> tuple[int, int] | None:
        # A square of the most pixels the image processor keeps (its longest_edge, in
        # pixels; a request's max_pixels where given).
        pixels = options.get("max_pixels")
        if pixels is None:
            size = options.get("size") or getattr(self.image_processor, "size", None) or {}
            pixels = size.get("longest_edge") or getattr(self.image_processor, "max_pixels", 0)
        if not pixels:
            return None
        side = math.isqrt(int(pixels))
        return side, side

    def item_inputs(
        self, image: Any, index: int, kwargs: dict[str, Any]
    ) -> tuple[Any, int, tuple[int, int, int]]:
        out = self.preprocess(image, index, kwargs)
        grid = out["image_grid_thw"]
        t, h, w = (int(n) for n in grid[0])
        m = self.merge_size
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        return inputs, t * h * w // (m * m), (t, h // m, w // m)


def _first(size: Any) -> int:
    """A patch size given as one number or as (height, width) of equal sides."""
    return int(size[0]) if isinstance(size, list | tuple) else int(size)
