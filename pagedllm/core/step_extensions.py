"""The engine's step extensions, built from its configuration through the
``step_extensions`` registry (see :mod:`pagedllm.core.interfaces.extension`)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import StepExtension


def build_step_extensions(engine: Any) -> list[StepExtension]:
    """pagedllm's own extensions that the configuration turns on, then the plugins' ones
    that ``--step-extensions`` names (each must then be built: never silently off)."""
    registry = engine.pm.registry("step_extensions")
    named = engine.config.scheduler_config.step_extensions
    extensions = []
    for entry in registry:
        if entry.name not in named and not registry.builtin(entry.source):
            continue  # (a plugin's extension is off unless named)
        extension = registry.load(entry.name).from_engine(engine)
        if extension is None:
            if entry.name in named:
                raise ConfigError(
                    f"--step-extensions {entry.name}: this configuration does not let the "
                    "extension run"
                )
            continue
        if extension.name != entry.name:
            raise ConfigError(
                f"step extension {entry.name!r} from {entry.source!r} names itself "
                f"{extension.name!r}; a step extension's name is the one it is registered under"
            )
        extensions.append(extension)
    return extensions
