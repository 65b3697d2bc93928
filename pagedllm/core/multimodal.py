"""What the engine knows of image inputs: which models take them, and an image's content
hash (the key its processed form and its prompt tokens are cached under).

The loading of images (data URLs, files, http) is the entry points' concern
(:mod:`pagedllm.entrypoints.media`); here images are already decoded PIL images.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.configs.model import ModelConfig


def model_accepts_images(model_config: ModelConfig) -> bool:
    """Whether the served model takes image inputs (a multi-modal processor is
    registered for its architecture). No model does yet."""
    return False


def image_hash(image: Any) -> str:
    """The sha256 of a decoded image: its mode, size and pixels, so the same picture
    has the same hash whichever way it arrived (data URL, file, http, a PIL image)."""
    digest = hashlib.sha256()
    width, height = image.size
    digest.update(f"{image.mode}:{width}x{height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
