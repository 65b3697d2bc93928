"""LLaVA's multimodal processor: each ``<image>`` token of a prompt becomes the image's
number of feature tokens, and each image its pixel values, made by the checkpoint's own
image processor (transformers' ``AutoImageProcessor``, as transformers' ``LlavaProcessor``
makes them). :class:`ImagePlaceholderProcessor` is what it shares with other models whose
prompts hold one placeholder token per image (Qwen2-VL's)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.interfaces.multimodal import (
    MultiModalItem,
    MultiModalProcessor,
    ProcessedPrompt,
    content_hash,
)


class ImagePlaceholderProcessor(MultiModalProcessor):
    """A prompt's ``image_token_id`` tokens, one per image, each expanded to its image's
    tokens (:meth:`item_inputs`); images preprocessed by the checkpoint's own
    ``image_processor``."""

    modalities = ("image",)
    # (options go to the image processor's call: e.g. do_normalize, image_mean)
    takes_processor_kwargs = True
    #: Keyword arguments every call of the image processor takes (not the user's options).
    call_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, image_processor: Any, image_token_id: int) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id

    @staticmethod
    def load_image_processor(model_path: str) -> Any:
        import transformers

        try:
            return transformers.AutoImageProcessor.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{model_path}: no image processor (preprocessor_config.json or "
                f"processor_config.json) for its images: {exc}"
            ) from exc

    @abstractmethod
    def item_inputs(
        self, image: Any, index: int, kwargs: dict[str, Any]
    ) -> tuple[Any, int, tuple[int, int, int] | None]:
        """The ``index``-th image's encoder inputs, number of tokens and their grid
        (:attr:`MultiModalItem.grid`), preprocessed with the options ``kwargs``."""

    def process(
        self,
        token_ids: list[int],
        data: dict[str, list[Any]],
        hashes: dict[str, list[str]],
        options: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        images = data.get("image", [])
        placeholders = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise InvalidRequestError(
                "multi_modal_data.image", self.placeholder_mismatch(len(images), len(placeholders))
            )
        self.check_tokens(token_ids)
        given = hashes.get("image") or [None] * len(images)
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        last = 0
        for index, (position, image) in enumerate(zip(placeholders, images, strict=True)):
            inputs, length, grid = self.item_inputs(image, index, options or {})
            expanded.extend(token_ids[last:position])
            key = str(given[index] or content_hash(image))
            last = self.expand_image(
                token_ids, position, expanded, items, key, inputs, length, grid
            )
        expanded.extend(token_ids[last:])
        return ProcessedPrompt(expanded, items)

    def placeholder_mismatch(self, num_images: int, num_placeholders: int) -> str:
        """The error of a prompt whose placeholders do not match its images."""
        return (
            f"{num_images} image(s) for {num_placeholders} image placeholder(s) in the "
            "prompt: one placeholder per image"
        )

    def check_tokens(self, token_ids: list[int]) -> None:
        """Raise :class:`InvalidRequestError` for a prompt token the expansion makes (none
        here)."""

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
        """Append the image's tokens (its placeholder at ``position`` of ``token_ids``
        expanded) to ``expanded`` and its item(s), whose content hash is ``key``, to
        ``items``; the position in ``token_ids`` where the prompt goes on. Here: its
        ``length`` placeholder tokens, one item."""
        items.append(MultiModalItem("image", key, inputs, len(expanded), length, grid))
        expanded.extend([self.image_token_id] * length)
        return position + 1

    def largest_image_size(self, options: dict[str, Any]) -> tuple[int, int] | None:
        """(width, height) of an image of the most tokens; None: unknown."""
        return None

    def largest_item(self, options: dict[str, Any]) -> MultiModalItem | None:
        size = self.largest_image_size(options)
        if size is None:
            return None
        from PIL import Image

        inputs, length, grid = self.item_inputs(Image.new("RGB", size), 0, options)
        return MultiModalItem("image", "largest", inputs, 0, length, grid)

    def preprocess(self, image: Any, index: int, kwargs: dict[str, Any]) -> Any:
        """The image processor's output for the ``index``-th image, called with the
        options ``kwargs`` (--mm-processor-kwargs, a prompt's mm_processor_kwargs)."""
        if not (hasattr(image, "mode") and hasattr(image, "size")):
            raise InvalidRequestError(
                f"multi_modal_data.image[{index}]",
                f"an image (PIL.Image.Image), not {type(image).__name__}",
            )
        if image.mode != "RGB":
            image = image.convert("RGB")
        try:
            return self.image_processor(
                images=[image], return_tensors="pt", **self.call_kwargs, **kwargs
            )
        except Exception as exc:
            if kwargs:
                raise InvalidRequestError(
                    "mm_processor_kwargs", f"mm_processor_kwargs {kwargs} do not apply: {exc}"
                ) from exc
            raise InvalidRequestError(
                f"multi_modal_data.image[{index}]", f"cannot preprocess the image: {exc}"
            ) from exc


class LlavaProcessor(ImagePlaceholderProcessor):
    def __init__(self, image_processor: Any, image_token_id: int, patch_size: int, full: bool):
        super().__init__(image_processor, image_token_id)
        self.patch_size = patch_size
        # The 'full' feature-select strategy keeps the CLS row: one token more.
        self.full = full

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any, tokenizer: Any) -> LlavaProcessor:
        image_processor = cls.load_image_processor(model_path)
        token = getattr(hf_config, "image_token_index", None)
        if token is None:
            token = getattr(hf_config, "image_token_id", None)
        if token is None:
            raise ConfigError(f"{model_path}: the config names no image_token_index")
        return cls(
            image_processor,
            int(token),
            int(hf_config.vision_config.patch_size),
            getattr(hf_config, "vision_feature_select_strategy", "default") == "full",
        )

    def largest_image_size(self, options: dict[str, Any]) -> tuple[int, int] | None:
        # (every image is resized and cropped to one size)
        crop = getattr(self.image_processor, "crop_size", None) or {}
        return crop.get("width") or 1, crop.get("height") or 1

    def item_inputs(self, image: Any, index: int, kwargs: dict[str, Any]) -> tuple[Any, int, None]:
        pixels = self.preprocess(image, index, kwargs)["pixel_values"]
        height, width = pixels.shape[-2:]
        length = (height // self.patch_size) * (width // self.patch_size) + int(self.full)
        return pixels, length, None
