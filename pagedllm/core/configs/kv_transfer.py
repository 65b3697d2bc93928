"""--kv-transfer-config: moving prompts' KV cache between engines (prefill/decode
disaggregation), with vLLM's keys."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.core.configs.base import Config
from pagedllm.core.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

# vLLM's keys that pagedllm takes, and those it refuses (key -> why) when set to anything
# but vLLM's default (the value here).
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id")
_REFUSED: dict[str, tuple[Any, str]] = {
    "kv_buffer_device": ("cpu", "pagedllm's connectors stage blocks in host memory"),
    "kv_port": (14579, "pagedllm's connectors take their address in kv_connector_extra_config"),
    "kv_connector_module_path": (
        None,
        "register the connector with a pagedllm plugin (pagedllm_register_kv_connectors)",
    ),
    "enable_permute_local_kv": (False, "pagedllm moves blocks in its own cache layout"),
    "kv_load_failure_policy": (
        "recompute",
        "a block that cannot be loaded is always computed again ('recompute')",
    ),
}


def _fail(message: str) -> ConfigError:
    return ConfigError(f"--kv-transfer-config: {message}")


@dataclasses.dataclass
class KVTransferConfig(Config):
    """Which connector (a ``kv_connectors`` registry name) moves full prompt blocks, and
    whether this engine writes them (``kv_producer``), reads them (``kv_consumer``) or
    both."""

    kv_connector: str = ""
    kv_role: str = ""
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # (vLLM's label of this engine in its transfers; pagedllm logs it)
    engine_id: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        unknown = sorted(set(values) - set(_KEYS) - _REFUSED.keys())
        if unknown:
            raise _fail(f"unknown key(s) {unknown} (known: {sorted(_KEYS)})")
        for key, (default, why) in _REFUSED.items():
            value = values.get(key)
            if value is not None and value != default:
                raise _fail(f"{key}={value!r} is not supported: {why}")
        return cls(**{k: v for k, v in values.items() if k in _KEYS and v is not None})

    def check(self) -> None:
        if not self.kv_connector:
            raise _fail("'kv_connector' (the connector's name) is required")
        if self.kv_role not in KV_ROLES:
            raise _fail(f"kv_role {self.kv_role or None!r}: choose one of {list(KV_ROLES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise _fail("kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
