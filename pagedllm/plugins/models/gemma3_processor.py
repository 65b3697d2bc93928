"""Gemma 3's multimodal processor: each ``<start_of_image>`` of a prompt (one per image,
as the chat template writes it) becomes transformers' ``Gemma3Processor`` expansion,
``"\\n\\n<start_of_image>" + <image_soft_token> x mm_tokens_per_image +
"<end_of_image>\\n\\n"``, tokenized as that processor's tokenizer call makes it (Gemma's
runs of newlines are single tokens: a prompt's newline next to the expansion's joins it).
The image's placeholder range is its soft tokens, which take the image's features."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.interfaces.multimodal import MultiModalItem
from pagedllm.plugins.models.llava_processor import ImagePlaceholderProcessor

_NEWLINES = "\n\n"


class Gemma3Processor(ImagePlaceholderProcessor):
    # An image's tokens attend to each other both ways: no step computes part of one.
    needs_whole_items = True

    def __init__(
        self,
        image_processor: Any,
        tokenizer: Any,
        boi_token_id: int,
        eoi_token_id: int,
        image_token_id: int,
        num_image_tokens: int,
    ) -> None:
        super().__init__(image_processor, boi_token_id)
        self.tokenizer = tokenizer
        self.eoi_token_id = eoi_token_id
        self.soft_token_id = image_token_id
        self.num_image_tokens = num_image_tokens

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any, tokenizer: Any) -> Gemma3Processor:
        image_processor = cls.load_image_processor(model_path)
        ids = {}
        for name in ("boi_token_index", "eoi_token_index", "image_token_index"):
            value = getattr(hf_config, name, None)
            if value is None:
                raise ConfigError(f"{model_path}: the config names no {name}")
            ids[name] = int(value)
        return cls(
            image_processor,
            tokenizer,
            ids["boi_token_index"],
            ids["eoi_token_index"],
            ids["image_token_index"],
            int(hf_config.mm_tokens_per_image),
        )

    def item_inputs(self, image: Any, index: int, kwargs: dict[str, Any]) -> tuple[Any, int, None]:
        if kwargs.get("do_pan_and_scan"):
            raise InvalidRequestError(
                "mm_processor_kwargs",
                "do_pan_and_scan: Gemma 3's pan-and-scan crops are not supported here; "
                "leave it False",
            )
        pixels = self.preprocess(image, index, kwargs)["pixel_values"]
        if pixels.shape[0] != 1:
            raise InvalidRequestError(
                f"multi_modal_data.image[{index}]", "the image processor made crops of it"
            )
        return pixels, self.num_image_tokens, None

    def check_tokens(self, token_ids: list[int]) -> None:
        if self.soft_token_id in token_ids:
            raise InvalidRequestError(
                "prompt", "the prompt holds image soft tokens: give one <start_of_image> per image"
            )

    def placeholder_mismatch(self, num_images: int, num_placeholders: int) -> str:
        return (
            f"{num_images} image(s) for {num_placeholders} <start_of_image> token(s) in "
            "the prompt: one per image"
        )

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
        # (a prompt's newlines beside the expansion's join them into one token)
        before = (
            self.tokenizer.decode([expanded.pop()])
            if expanded and self._joins(expanded[-1])
            else ""
        )
        expanded.extend(self._encode(before + _NEWLINES))
        expanded.append(self.image_token_id)
        items.append(MultiModalItem("image", key, inputs, len(expanded), length))
        expanded.extend([self.soft_token_id] * length)
        expanded.append(self.eoi_token_id)
        following = position + 1
        nxt = token_ids[following] if following < len(token_ids) else None
        after = ""
        if nxt is not None and self._joins(nxt):
            after = self.tokenizer.decode([nxt])
            following += 1
        expanded.extend(self._encode(_NEWLINES + after))
        return following

    def _joins(self, token: int) -> bool:
        """Whether ``token`` is a run of newlines."""
        text = self.tokenizer.decode([token])
        return bool(text) and set(text) == {"\n"}

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
