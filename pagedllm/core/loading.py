"""Turning the configured names into the plugin objects that load and quantize a model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.config import LoadConfig
    from pagedllm.core.interfaces import ModelLoader, QuantizationConfig
    from pagedllm.core.plugins import PluginManager


def get_model_loader(load_config: LoadConfig, pm: PluginManager) -> ModelLoader:
    """The loader registered for ``--load-format``."""
    return pm.load("load_formats", load_config.load_format)(load_config)


def get_quantization_config(
    method: str | None, pm: PluginManager, checkpoint_config: dict[str, Any] | None = None
) -> QuantizationConfig | None:
    """The quantization config for ``--quantization`` (or the checkpoint's own
    ``quantization_config``); ``None`` for an unquantized model."""
    checkpoint_config = dict(checkpoint_config or {})
    checkpoint_method = checkpoint_config.pop("quant_method", None)
    if method is None:
        method = checkpoint_method
    if method is None:
        return None
    cls = pm.load("quantization_methods", method)
    if checkpoint_method is not None and checkpoint_method not in (
        method,
        *getattr(cls, "checkpoint_methods", ()),
    ):
        raise ConfigError(
            f"--quantization {method}: the checkpoint is quantized with {checkpoint_method!r}"
        )
    try:
        return cls.from_config(checkpoint_config)
    except ValueError as exc:
        raise ConfigError(f"--quantization {method}: {exc}") from exc
