"""The typed registries that registration hooks fill: names mapped to implementations."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from pagedllm.core import hookspecs
from pagedllm.core.errors import PluginError

# Set by PAGEDLLM_DISABLED_PLUGINS; named in conflict messages as the way out.
ENV_DISABLE = "PAGEDLLM_DISABLED_PLUGINS"
# The distribution whose plugins are pagedllm's own ("built-in").
BUILTIN_DISTRIBUTION = "pagedllm"


@dataclasses.dataclass(slots=True)
class RegistryEntry:
    name: str
    target: type | str
    source: str
    override: bool = False
    # Plugins whose registrations of this name lost to this one: it passed override=True,
    # or it is built in and they did not.
    replaced: list[str] = dataclasses.field(default_factory=list)
    # Plugins whose claims on this name are as strong as this one's: nobody wins, and the
    # name is refused when used (see Registry.load).
    conflicts: list[str] = dataclasses.field(default_factory=list)

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
        # While the plugin manager runs the registration hook: the id of the code object of
        # each hook implementation -> its plugin's name (see _source). By identity: code
        # objects compare equal by value, and two plugins may well share a hook's text.
        self.hook_sources: Mapping[int, str] = {}
        # Plugin name -> its distribution (pip package), where known: pagedllm's own
        # plugins are built in, and messages about a name claimed twice name packages.
        self.packages: Mapping[str, str] = {}
        # Every registration of each name, in registration order.
        self._claims: dict[str, list[RegistryEntry]] = {}

    def _source(self) -> str:
        """The plugin calling :meth:`add`. pluggy runs every implementation in one hook
        call, so the caller is found on the stack: the innermost frame running a hook
        implementation (a helper it calls is credited to it)."""
        if self.hook_sources:
            frame = sys._getframe(2)
            while frame is not None:
                source = self.hook_sources.get(id(frame.f_code))
                if source is not None:
                    return source
                frame = frame.f_back
        return self.current_source

    def add(self, name: str, target: type | str, *, override: bool = False) -> None:
        """Register ``target`` under ``name``.

        A name claimed twice costs only that name, whatever the loading order: a
        registration with ``override=True`` wins, else pagedllm's built-in one; two equal
        claims (two plugins, or two overrides) make the name refused when it is used
        (:meth:`load`). :meth:`collisions` describes each case for a warning.
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
        # A plugin registering a name again (hooks must be idempotent) replaces its own.
        claims = [c for c in self._claims.get(name, []) if c.source != source]
        claims.append(RegistryEntry(name, target, source, override))
        self._claims[name] = claims
        top = max(map(self._rank, claims))
        winner, *equal = [c for c in claims if self._rank(c) == top]
        winner.replaced = [c.source for c in claims if self._rank(c) < top]
        winner.conflicts = [c.source for c in equal]
        self._entries[name] = winner

    def _rank(self, entry: RegistryEntry) -> int:
        if entry.override:
            return 2
        return 1 if self.builtin(entry.source) else 0

    def builtin(self, source: str) -> bool:
        return self.packages.get(source) == BUILTIN_DISTRIBUTION

    def describe(self, source: str) -> str:
        """``plugin 'a' (package pagedllm-plugin-a)``: the plugin and what installed it."""
        package = self.packages.get(source)
        return f"plugin {source!r}" + (f" (package {package})" if package else "")

    def collisions(self) -> list[str]:
        """One message per name claimed more than once: who keeps it, and why."""
        messages = []
        for name, claims in sorted(self._claims.items()):
            if len(claims) < 2:
                continue
            entry = self._entries[name]
            conflict = self.conflict(name)
            if conflict is not None:
                messages.append(conflict)
                continue
            losers = " and ".join(map(self.describe, entry.replaced))
            if entry.override:
                messages.append(
                    f"{self.kind} name {name!r}: {self.describe(entry.source)} registers it "
                    f"with override=True, replacing the one of {losers}"
                )
            else:
                messages.append(
                    f"{self.kind} name {name!r} is pagedllm's built-in one, from "
                    f"{self.describe(entry.source)}; {losers} registers it too, without "
                    f"override=True, so pagedllm's is used and the plugin's ignored (a "
                    f"plugin passes override=True to replace a built-in)"
                )
        return messages

    def conflict(self, name: str) -> str | None:
        """Why ``name`` cannot be used, naming the plugins that claim it equally; ``None``
        when one registration of it wins (or it is not registered)."""
        entry = self._entries.get(name)
        if entry is None or not entry.conflicts:
            return None
        sources = sorted([entry.source, *entry.conflicts])
        how = "all with override=True" if entry.override else "none with override=True"
        both = "both" if len(sources) == 2 else "each of"
        return (
            f"{self.kind} name {name!r} is registered by {both} "
            f"{' and '.join(map(self.describe, sources))} ({how}), so it is refused when "
            f"used; uninstall or disable one of them "
            f"({' or '.join(f'{ENV_DISABLE}={source}' for source in sources)})"
            + ("" if entry.override else ", or have one register it with override=True")
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

    def usable_entry(self, name: str) -> RegistryEntry:
        """The entry of ``name``, refused (naming the plugins) if two claim it equally."""
        entry = self.entry(name)
        conflict = self.conflict(name)
        if conflict is not None:
            raise PluginError(f"cannot use {conflict}")
        return entry

    def base(self) -> type | None:
        if isinstance(self._base, str):
            self._base = import_target(self._base)
        return self._base

    def load(self, name: str) -> Any:
        """The implementation registered under ``name``, imported on first use."""
        if name in self._loaded:
            return self._loaded[name]
        entry = self.usable_entry(name)
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
    "executors": "pagedllm.core.interfaces.executor:Executor",
    "schedulers": "pagedllm.core.interfaces.scheduler:SchedulerInterface",
    "step_extensions": "pagedllm.core.interfaces.extension:StepExtension",
    "multimodal_processors": "pagedllm.core.interfaces.multimodal:MultiModalProcessor",
    "kv_connectors": "pagedllm.core.interfaces.kv_connector:KVConnector",
}
assert REGISTRY_BASES.keys() == hookspecs.REGISTRATION_HOOKS.keys()
