"""Turning the configured names into the plugin objects that load and quantize a model."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError

logger = logging.getLogger("pagedllm.loading")

if TYPE_CHECKING:
    from pagedllm.core.config import LoadConfig
    from pagedllm.core.interfaces import ModelLoader, QuantizationConfig
    from pagedllm.core.plugins import PluginManager


def get_model_loader(load_config: LoadConfig, pm: PluginManager) -> ModelLoader:
    """The loader registered for ``--load-format``."""
    return pm.load("load_formats", load_config.load_format)(load_config)


def loader_for_quantization(
    loader: ModelLoader,
    load_config: LoadConfig,
    quant: QuantizationConfig | None,
    pm: PluginManager,
) -> ModelLoader:
    """``loader``, or the load format the quantization method reads its checkpoints
    with (``QuantizationConfig.load_format``) when ``--load-format`` is ``auto``. A load
    format made for one method (``ModelLoader.quantization``) refuses the others.
    ``--qlora-adapter-name-or-path`` is handed to the bitsandbytes method here, before
    the model is built (its adapter's target modules are the layers it quantizes)."""
    adapter = load_config.qlora_adapter_name_or_path
    if adapter:
        if quant is None or quant.name != "bitsandbytes":
            raise ConfigError(
                "--qlora-adapter-name-or-path goes with --quantization bitsandbytes (its "
                "target_modules choose the layers quantized at load)"
            )
        quant.use_qlora_adapter(adapter)
    wanted = getattr(quant, "load_format", None)
    chosen = load_config.load_format
    if wanted is not None and chosen != wanted:
        if chosen != "auto":
            raise ConfigError(
                f"--quantization {quant.name} reads its weights with --load-format "
                f"{wanted} (or auto), not {chosen}"
            )
        logger.info("--quantization %s: loading with --load-format %s", quant.name, wanted)
        return get_model_loader(dataclasses.replace(load_config, load_format=wanted), pm)
    needs = getattr(loader, "quantization", None)
    if needs is not None and (quant is None or quant.name != needs):
        raise ConfigError(
            f"--load-format {chosen} reads {needs} checkpoints only; use it with "
            f"--quantization {needs} (the model is "
            f"{'not quantized' if quant is None else f'quantized with {quant.name}'})"
        )
    return loader


def get_quantization_config(
    method: str | None, pm: PluginManager, checkpoint_config: dict[str, Any] | None = None
) -> QuantizationConfig | None:
    """The quantization config for ``--quantization`` (or, unset or ``auto``, the
    checkpoint's own ``quantization_config``); ``None`` for an unquantized model."""
    checkpoint_config = dict(checkpoint_config or {})
    checkpoint_method = checkpoint_config.pop("quant_method", None)
    if method in (None, "auto"):
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
