"""The typed registries that registration hooks fill: names mapped to implementations."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator, Mapping
from types import CodeType
from typing import Any

from pagedllm.core import hookspecs
from pagedllm.core.errors import PluginError

# Set by PAGEDLLM_DISABLED_PLUGINS; named in conflict messages as the way out.
ENV_DISABLE = "PAGEDLLM_DISABLED_PLUGINS"


@dataclasses.dataclass(slots=True)
class RegistryEntry:
    name: str
    target: type | str
    source: str
    override: bool = False
    # Plugins whose registration of the same name this entry replaced.
    replaced: list[str] = dataclasses.field(default_factory=list)

    @property
    def target_path(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


def import_target(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:Attribute', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """Names of one kind (devices, load formats, ...) mapped to their implementations.

    ``base`` is the ABC every target must subclass, given as a class or as a lazy
    ``"module:Class"`` path.
    """

    def __init__(self, kind: str, base: type | str | None = None) -> None:
        self.kind = kind
        self._base = base
        self._entries: dict[str, RegistryEntry] = {}
        self._loaded: dict[str, Any] = {}
        # The plugin credited with an add() made outside any known hook implementation.
        self.current_source = "<direct>"
        # While the plugin manager runs the registration hook: the code of each hook
        # implementation -> its plugin's name (see _source).
        self.hook_sources: Mapping[CodeType, str] = {}

    def _source(self) -> str:
        """The plugin calling :meth:`add`. pluggy runs every implementation in one hook
        call, so the caller is found on the stack: the innermost frame running a hook
        implementation (a helper it calls is credited to it)."""
        if self.hook_sources:
            frame = sys._getframe(2)
            while frame is not None:
                source = self.hook_sources.get(frame.f_code)
                if source is not None:
                    return source
                frame = frame.f_back
        return self.current_source

    def add(self, name: str, target: type | str, *, override: bool = False) -> None:
        """Register ``target`` under ``name``.

        A name registered twice is an error unless exactly one of the two registrations
        says ``override=True``; that one wins whatever the loading order.
        """
        source = self._source()
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise PluginError(
                f"plugin {source!r} registered an invalid {self.kind} name "
                f"{name!r}: names are non-empty strings without spaces"
            )
        if not isinstance(target, str | type):
            raise PluginError(
                f"plugin {source!r} registered {self.kind} {name!r} with "
                f"{target!r}: a target is a class or a 'module:Class' string"
            )
        new = RegistryEntry(name, target, source, override)
        old = self._entries.get(name)
        if old is None:
            self._entries[name] = new
        elif new.override and not old.override:
            new.replaced.append(old.source)
            self._entries[name] = new
        elif old.override and not new.override:
            old.replaced.append(new.source)
        else:
            raise PluginError(
                f"{self.kind} name {name!r} is registered by both plugin {old.source!r} "
                f"and plugin {new.source!r}; uninstall or disable one "
                f"({ENV_DISABLE}=name), or register with override=True to replace it"
            )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}"
            ) from None

    def base(self) -> type | None:
        if isinstance(self._base, str):
            self._base = import_target(self._base)
        return self._base

    def load(self, name: str) -> Any:
        """The implementation registered under ``name``, imported on first use."""
        if name in self._loaded:
            return self._loaded[name]
        entry = self.entry(name)
        target = entry.target
        if isinstance(target, str):
            try:
                target = import_target(target)
            except Exception as exc:
                raise PluginError(
                    f"{self.kind} {name!r} from plugin {entry.source!r} points at "
                    f"{entry.target!r}, which cannot be imported: {exc}"
                ) from exc
        base = self.base()
        if base is not None and not (isinstance(target, type) and issubclass(target, base)):
            raise PluginError(
                f"{self.kind} {name!r} from plugin {entry.source!r} is {target!r}, which is "
                f"not a subclass of {base.__module__}.{base.__qualname__}"
            )
        self._loaded[name] = target
        return target


# Registry kind -> the ABC its entries implement.
REGISTRY_BASES: dict[str, str | None] = {
    "devices": "pagedllm.core.interfaces.device:Device",
    "load_formats": "pagedllm.core.interfaces.loader:ModelLoader",
    "quantization_methods": "pagedllm.core.interfaces.quantization:QuantizationConfig",
    "models": "pagedllm.core.interfaces.model:ModelArchitecture",
    "tool_parsers": "pagedllm.core.interfaces.parsers:ToolParser",
    "reasoning_parsers": "pagedllm.core.interfaces.parsers:ReasoningParser",
    "guided_backends": "pagedllm.core.interfaces.guided:GuidedBackend",
    "attention_backends": "pagedllm.core.interfaces.attention:AttentionBackend",
    "cli_subcommands": "pagedllm.core.interfaces.cli:CLISubcommand",
    "stat_loggers": None,
    "logits_processors": None,
}
assert REGISTRY_BASES.keys() == hookspecs.REGISTRATION_HOOKS.keys()
