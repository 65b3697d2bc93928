"""Multi-modal inputs: how many images a prompt may hold and the processor's settings
(``--limit-mm-per-prompt``, ``--mm-processor-kwargs``, ``--disable-mm-preprocessor-cache``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pagedllm.core.configs.base import Config, format_value
from pagedllm.core.errors import ConfigError

# vLLM's V1 default: as many images as the context holds (seed 004: "999 (V1)").
DEFAULT_IMAGES_PER_PROMPT = 999
# Modalities pagedllm takes; vLLM's others are accepted only with a limit of 0.
_MODALITIES = {"image": "image", "images": "image"}
_UNSUPPORTED_MODALITIES = ("video", "videos", "audio", "audios")
IMAGES_ONLY = "pagedllm takes images only; video/audio are not supported"


@dataclasses.dataclass
class MultiModalConfig(Config):
    """The multi-modal settings; ``limit_per_prompt`` holds one key, ``image``, after
    checking (the seeds' spellings ``images`` and ``image`` both accepted)."""

    limit_per_prompt: dict[str, int] = dataclasses.field(default_factory=dict)
    # Options of the model's image processor call (e.g. do_normalize), for every image.
    mm_processor_kwargs: dict[str, Any] | None = None
    disable_mm_preprocessor_cache: bool = False

    arg_names: ClassVar[dict[str, str]] = {"limit_per_prompt": "limit_mm_per_prompt"}

    def check(self) -> None:
        self.limit_per_prompt = normalise_limits(self.limit_per_prompt)
        kwargs = self.mm_processor_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(
                f"--mm-processor-kwargs={format_value(kwargs)} is invalid: give a JSON object, "
                'e.g. {"do_normalize": false}'
            )

    @property
    def max_images(self) -> int:
        return self.limit_per_prompt["image"]


def normalise_limits(limits: Any) -> dict[str, int]:
    """``--limit-mm-per-prompt`` as ``{"image": N}``; a video or audio limit above 0 and
    an unknown modality are refused by name."""
    flag = "--limit-mm-per-prompt"
    if not isinstance(limits, dict):
        raise ConfigError(
            f"{flag}={format_value(limits)} is invalid: give a JSON object such as "
            '{"image": 16} or the form image=16'
        )
    out = {"image": DEFAULT_IMAGES_PER_PROMPT}
    for key, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"{flag}={format_value(limits)} is invalid: the limit of {key!r} must be an "
                "integer >= 0"
            )
        if key in _UNSUPPORTED_MODALITIES:
            if value > 0:
                raise ConfigError(f"{flag}={format_value(limits)}: {key}: {IMAGES_ONLY}")
        elif key in _MODALITIES:
            out[_MODALITIES[key]] = value
        else:
            raise ConfigError(
                f"{flag}={format_value(limits)} is invalid: unknown modality {key!r} (pagedllm "
                "takes 'image'; 'video' and 'audio' only with the limit 0)"
            )
    return out
