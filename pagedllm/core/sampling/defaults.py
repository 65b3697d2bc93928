"""A model's sampling defaults (``--generation-config``): the values a request's unset
sampling fields take, and the cap ``max_new_tokens`` puts on every request's output."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.sampling.params import SamplingParams

# The sampling fields a generation config sets (vLLM's list), in its names and ours alike.
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# Every generation-config key pagedllm reads (eos_token_id: the model's stop tokens).
GENERATION_CONFIG_KEYS = (*SAMPLING_FIELDS, "max_new_tokens", "eos_token_id")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """``values``: field -> the model's default for it (of :data:`SAMPLING_FIELDS`);
    ``max_tokens``: the most tokens any request may generate (``max_new_tokens``), or
    ``None``; ``source``: where they came from, for the start-up log and errors."""

    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.values) - set(SAMPLING_FIELDS))
        assert not unknown, f"not sampling defaults: {unknown}"
        where = f"the generation config ({self.source})"
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise ConfigError(
                f"{where}: max_new_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        try:
            SamplingParams(**self.values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], source: str) -> SamplingDefaults:
        """The defaults a generation config (``generation_config.json``'s keys) sets."""
        values = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
        return cls(values, config.get("max_new_tokens"), source)

    def cap(self, max_tokens: int | None) -> int | None:
        """``max_tokens`` within the cap (``None``, "until the context is full", is the cap)."""
        if self.max_tokens is None or (max_tokens is not None and max_tokens <= self.max_tokens):
            return max_tokens
        return self.max_tokens

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """``SamplingParams(**fields)`` where a sampling field left out or ``None`` takes
        the model's default (else ``SamplingParams``'), and ``max_tokens`` left out takes
        the cap (else 16), a larger one is capped."""
        for name in SAMPLING_FIELDS:
            if fields.get(name) is None:
                fields.pop(name, None)
                if name in self.values:
                    fields[name] = self.values[name]
        if "max_tokens" not in fields and self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        elif "max_tokens" in fields:
            fields["max_tokens"] = self.cap(fields["max_tokens"])
        return SamplingParams(**fields)

    def describe(self) -> str:
        """One line for the start-up log: the defaults, the cap and where they came from."""
        values = ", ".join(f"{k}={self.values[k]}" for k in SAMPLING_FIELDS if k in self.values)
        parts = [f"{values} where a request sets none"] if values else []
        if self.max_tokens is not None:
            parts.append(f"max_tokens at most {self.max_tokens} for every request")
        return f"sampling defaults: {'; '.join(parts) or 'none'} (from {self.source})"


def check_generation_override(override: Mapping[str, Any]) -> None:
    """``--override-generation-config``: a key pagedllm does not read would do nothing,
    and a value no request could take would fail every request; both are refused."""
    unknown = sorted(set(override) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"--override-generation-config: unknown key(s) {', '.join(unknown)}; the "
            f"generation-config keys pagedllm reads are {', '.join(GENERATION_CONFIG_KEYS)}"
        )
    SamplingDefaults.from_generation_config(override, "--override-generation-config")
