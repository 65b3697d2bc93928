"""Idefics3's (and SmolVLM's) multimodal processor: the checkpoint's own image processor
(transformers' ``AutoImageProcessor``) resizes each image and splits it into a grid of
crops plus the global image; each ``<image>`` of the prompt becomes the text transformers'
``Idefics3Processor`` / ``SmolVLMProcessor`` writes for it (per crop
``<fake_token_around_image><row_i_col_j>`` and ``image_seq_len`` ``<image>`` tokens, a
newline per row, then ``<fake_token_around_image><global-img>``, the global image's
tokens and ``<fake_token_around_image>``), tokenized.

Each crop is one :class:`MultiModalItem` (its ``image_seq_len`` image tokens, hashed as
the image's hash and the crop's index): the row/column tokens between them stay text, so
chunked prefill, the encoder cache and the prefix cache treat a crop as any image."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.interfaces.multimodal import MultiModalItem
from pagedllm.plugins.models.llava_processor import ImagePlaceholderProcessor

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


def image_prompt_string(rows: int, cols: int, seq_len: int, image_token: str) -> str:
    """What transformers' processors write for an image split into ``rows x cols`` crops
    (0 x 0: not split)."""
    image = image_token * seq_len
    text = ""
    if rows or cols:
        for row in range(1, rows + 1):
            text += "".join(f"{FAKE}<row_{row}_col_{col}>{image}" for col in range(1, cols + 1))
            text += "\n"
        text += "\n"
    return text + f"{FAKE}{GLOBAL}{image}{FAKE}"


class Idefics3Processor(ImagePlaceholderProcessor):
    # (the grid of crops: the expansion's rows and columns)
    call_kwargs: ClassVar[dict[str, Any]] = {"return_row_col_info": True}

    def __init__(
        self,
        image_processor: Any,
        image_token_id: int,
        tokenizer: Any,
        crop_size: int,
        seq_len: int,
    ) -> None:
        super().__init__(image_processor, image_token_id)
        # (the vision encoder's image size: each crop's, whose tokens are seq_len)
        self.crop_size = crop_size
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        # (rows, cols) -> the expansion's token ids
        self._expansions: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any, tokenizer: Any) -> Idefics3Processor:
        if tokenizer is None:
            raise ConfigError(f"{model_path}: images need its tokenizer, not --skip-tokenizer-init")
        image_processor = cls.load_image_processor(model_path)
        token = getattr(hf_config, "image_token_id", None)
        if token is None:
            raise ConfigError(f"{model_path}: the config names no image_token_id")
        vision = hf_config.vision_config
        seq_len = (vision.image_size // vision.patch_size) ** 2 // hf_config.scale_factor**2
        return cls(image_processor, int(token), tokenizer, int(vision.image_size), seq_len)

    def item_inputs(self, image: Any, index: int, kwargs: dict[str, Any]) -> tuple[Any, int, None]:
        """The image's crops: ``(pixel_values [crops, 3, H, W], pixel_attention_mask
        [crops, H, W], rows, cols)``, and the number of image tokens."""
        out = self.preprocess(image, index, kwargs)
        pixels = out["pixel_values"][0]
        mask = out.get("pixel_attention_mask")
        mask = mask[0] if mask is not None else pixels.new_ones(pixels.shape[0], *pixels.shape[2:])
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if tuple(pixels.shape[-2:]) != (self.crop_size, self.crop_size):
            # (e.g. another max_image_size: its crops would not make seq_len tokens each)
            raise InvalidRequestError(
                "mm_processor_kwargs" if kwargs else f"multi_modal_data.image[{index}]",
                f"the image processor made {tuple(pixels.shape[-2:])} pixel crops; this "
                f"model's vision encoder takes {self.crop_size}x{self.crop_size} "
                f"(max_image_size longest_edge {self.crop_size})",
            )
        return (pixels, mask.bool(), rows, cols), pixels.shape[0] * self.seq_len, None

    def largest_item(self, options: dict[str, Any]) -> MultiModalItem | None:
        # (every item is one crop of the encoder's size: the largest too)
        size = self.crop_size
        pixels = torch.zeros(1, 3, size, size)
        mask = torch.ones(1, size, size, dtype=torch.bool)
        return MultiModalItem("image", "largest", (pixels, mask), 0, self.seq_len)

    def expansion(self, rows: int, cols: int) -> list[int]:
        key = (rows, cols)
        if key not in self._expansions:
            text = image_prompt_string(rows, cols, self.seq_len, self.image_token)
            self._expansions[key] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._expansions[key]

    def expand_image(
        self,
        token_ids: list[int],
        position: int,
        expanded: list[int],
        items: list[MultiModalItem],
        key: str,
        inputs: Any,
        length: int,
        grid: tuple[int, int, int] | None,
    ) -> int:
        pixels, mask, rows, cols = inputs
        start = len(expanded)
        tokens = self.expansion(rows, cols)
        expanded.extend(tokens)
        # Runs of image tokens in the expansion: one per crop, in pixel_values' order.
        runs = [
            i
            for i, t in enumerate(tokens)
            if t == self.image_token_id and (i == 0 or tokens[i - 1] != self.image_token_id)
        ]
        if len(runs) != pixels.shape[0]:
            raise AssertionError(f"{len(runs)} image token runs for {pixels.shape[0]} crops")
        for crop, run in enumerate(runs):
            crop_inputs = (pixels[crop : crop + 1], mask[crop : crop + 1])
            items.append(
                MultiModalItem("image", f"{key}#{crop}", crop_inputs, start + run, self.seq_len)
            )
        return position + 1
