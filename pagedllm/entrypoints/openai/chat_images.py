"""The image parts of chat messages: found and checked (their number against
``--limit-mm-per-prompt``), loaded off the event loop, and refused with a 400 naming the
part (``messages[0].content[1].image_url``) when anything is wrong with one."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pagedllm.entrypoints.media import LoadedImage, MediaConnector, MediaError
from pagedllm.entrypoints.openai.errors import OpenAIError

IMAGE_PART_TYPES = ("image_url", "image_pil")
_IMAGE_URL_KEYS = {"url", "detail"}


@dataclasses.dataclass(frozen=True, slots=True)
class ImagePart:
    """One image part: where it is in the request, and its URL or (offline) PIL image."""

    param: str
    url: str | None = None
    image: Any = None


def image_parts(messages: list[Any]) -> list[ImagePart]:
    """The image parts of ``messages`` in order, their shape checked."""
    parts = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                parts.append(_image_part(part, f"messages[{i}].content[{j}]"))
    return parts


def _image_part(part: dict[str, Any], where: str) -> ImagePart:
    if part["type"] == "image_pil":
        return ImagePart(f"{where}.image_pil", image=part.get("image_pil"))
    param = f"{where}.image_url"
    value = part.get("image_url")
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise OpenAIError(400, f'{param} must be an object {{"url": "..."}}', param=param)
    unknown = sorted(set(value) - _IMAGE_URL_KEYS)
    if unknown:
        raise OpenAIError(
            400, f"{param} has unknown keys {unknown} (valid: url, detail)", param=param
        )
    if value.get("detail", "auto") != "auto":
        raise OpenAIError(
            400,
            f"{param}.detail {value['detail']!r} is not supported: the model's processor "
            "sets the resolution; leave detail out or use 'auto'",
            param=f"{param}.detail",
        )
    return ImagePart(param, url=value["url"])


async def load_images(
    parts: list[ImagePart], connector: MediaConnector, *, keep: bool
) -> list[LoadedImage]:
    """The parts' images, loaded on threads. With ``keep=False`` they are only checked,
    one at a time, and dropped (memory for one image, not all of them)."""
    if not keep:
        for part in parts:
            await _load(part, connector)
        return []
    results = await asyncio.gather(*(_load(p, connector) for p in parts), return_exceptions=True)
    for result in results:  # (the first failing part, in request order)
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]


async def _load(part: ImagePart, connector: MediaConnector) -> LoadedImage:
    try:
        if part.url is None:
            return await connector.from_pil_async(part.image)
        return await connector.load_image_async(part.url)
    except MediaError as exc:
        raise OpenAIError(400, f"{part.param}: {exc}", param=part.param) from None


def check_image_count(parts: list[ImagePart], max_images: int) -> None:
    if len(parts) > max_images:
        raise OpenAIError(
            400,
            f"the messages hold {len(parts)} images; at most {max_images} per prompt are "
            "allowed (--limit-mm-per-prompt)",
            param="messages",
        )
