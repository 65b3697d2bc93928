"""Plugin discovery and the typed registries plugins fill.

Plugins are found through the ``pagedllm`` entry-point group; pagedllm's own plugins are
declared there too, in its ``pyproject.toml``. :func:`make_plugin_manager` builds a fresh
manager (there is no module-global one), so each test can have its own.

Environment:
- ``PAGEDLLM_PLUGINS``: comma-separated allow-list of third-party plugin names; unset
  loads all. pagedllm's built-in plugins always load unless disabled by name.
- ``PAGEDLLM_DISABLED_PLUGINS``: comma-separated names never loaded (built-ins too).
- ``PAGEDLLM_STRICT_PLUGINS=1``: a plugin that fails to load is fatal instead of a
  warning.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pluggy

from pagedllm.core import hookspecs
from pagedllm.core.errors import PluginError

logger = logging.getLogger("pagedllm.plugins")

ENTRY_POINT_GROUP = "pagedllm"
BUILTIN_DISTRIBUTION = "pagedllm"

ENV_ALLOW = "PAGEDLLM_PLUGINS"
ENV_DISABLE = "PAGEDLLM_DISABLED_PLUGINS"
ENV_STRICT = "PAGEDLLM_STRICT_PLUGINS"


class PluginStatus(enum.Enum):
    LOADED = "loaded"
    FAILED = "failed"
    DISABLED = "disabled"
    NOT_ALLOWED = "not in PAGEDLLM_PLUGINS"


@dataclasses.dataclass(slots=True)
class PluginInfo:
    name: str
    value: str
    distribution: str | None
    version: str | None
    status: PluginStatus
    error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION


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


def _import_target(path: str) -> Any:
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
        # The plugin whose hook is running; set by the plugin manager.
        self.current_source = "<direct>"

    def add(self, name: str, target: type | str, *, override: bool = False) -> None:
        """Register ``target`` under ``name``.

        A name registered twice is an error unless exactly one of the two registrations
        says ``override=True``; that one wins whatever the loading order.
        """
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise PluginError(
                f"plugin {self.current_source!r} registered an invalid {self.kind} name "
                f"{name!r}: names are non-empty strings without spaces"
            )
        if not isinstance(target, str | type):
            raise PluginError(
                f"plugin {self.current_source!r} registered {self.kind} {name!r} with "
                f"{target!r}: a target is a class or a 'module:Class' string"
            )
        new = RegistryEntry(name, target, self.current_source, override)
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
            self._base = _import_target(self._base)
        return self._base

    def load(self, name: str) -> Any:
        """The implementation registered under ``name``, imported on first use."""
        if name in self._loaded:
            return self._loaded[name]
        entry = self.entry(name)
        target = entry.target
        if isinstance(target, str):
            try:
                target = _import_target(target)
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
    "cli_subcommands": "pagedllm.entrypoints.cli.types:CLISubcommand",
    "stat_loggers": None,
    "logits_processors": None,
}
assert REGISTRY_BASES.keys() == hookspecs.REGISTRATION_HOOKS.keys()


def _env_names(env: Mapping[str, str], key: str) -> set[str] | None:
    raw = env.get(key)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginManager:
    """Loaded plugins, their hooks and the registries they fill."""

    def __init__(self, *, strict: bool = False) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.RegistrationSpecs)
        self.pm.add_hookspecs(hookspecs.LifecycleSpecs)
        self.strict = strict
        self.plugins: list[PluginInfo] = []
        self._registries: dict[str, Registry] = {}

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # ------------------------------------------------------------------ loading

    def _fail(self, info: PluginInfo, what: str) -> None:
        info.status = PluginStatus.FAILED
        info.error = traceback.format_exc()
        message = (
            f"pagedllm plugin {info.name!r} ({info.value}"
            f"{', from ' + info.distribution if info.distribution else ''}) {what}; "
            f"what it provides is unavailable.\n{info.error}"
        )
        if self.strict:
            raise PluginError(message)
        logger.warning("%s", message)

    def register(
        self,
        plugin: object,
        name: str,
        *,
        value: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginInfo:
        """Register an already imported plugin object (a module or an instance)."""
        info = PluginInfo(
            name=name,
            value=value or getattr(plugin, "__name__", type(plugin).__name__),
            distribution=distribution,
            version=version,
            status=PluginStatus.LOADED,
        )
        self.plugins.append(info)
        try:
            self.pm.register(plugin, name=name)
        except Exception:
            self._fail(info, "does not implement the pagedllm hooks correctly")
        self._registries.clear()
        return info

    def load_entry_points(self, env: Mapping[str, str]) -> None:
        allow = _env_names(env, ENV_ALLOW)
        disabled = _env_names(env, ENV_DISABLE) or set()
        eps = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (_dist_name(ep) != BUILTIN_DISTRIBUTION, ep.name),
        )
        seen: set[str] = set()
        for ep in eps:
            if ep.name in seen:
                # The same distribution found twice on sys.path (e.g. an editable install
                # and a build directory); the first one wins, like Python imports.
                continue
            seen.add(ep.name)
            dist = _dist_name(ep)
            version = ep.dist.version if ep.dist is not None else None
            info = PluginInfo(ep.name, ep.value, dist, version, PluginStatus.LOADED)
            if ep.name in disabled:
                info.status = PluginStatus.DISABLED
            elif allow is not None and dist != BUILTIN_DISTRIBUTION and ep.name not in allow:
                info.status = PluginStatus.NOT_ALLOWED
            if info.status is not PluginStatus.LOADED:
                self.plugins.append(info)
                continue
            try:
                plugin = ep.load()
            except Exception:
                self.plugins.append(info)
                self._fail(info, "failed to import")
                continue
            self.register(plugin, ep.name, value=ep.value, distribution=dist, version=version)
        if allow is not None:
            unknown = allow - seen
            if unknown:
                logger.warning(
                    "%s names plugins that are not installed: %s",
                    ENV_ALLOW,
                    ", ".join(sorted(unknown)),
                )

    def load_plugin_file(self, path: str | os.PathLike[str]) -> PluginInfo:
        """Import a Python file as a plugin (used by ``--tool-parser-plugin``)."""
        file = Path(path)
        if not file.is_file():
            raise PluginError(f"plugin file {str(file)!r} does not exist")
        module_name = f"pagedllm_file_plugin_{file.stem}_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise PluginError(f"plugin file {str(file)!r} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise PluginError(
                f"plugin file {str(file)!r} failed to import:\n{traceback.format_exc()}"
            ) from exc
        return self.register(module, f"file:{file}", value=str(file))

    # --------------------------------------------------------------- registries

    def registry(self, kind: str) -> Registry:
        """The registry of ``kind``, filled by every loaded plugin's hook on first use."""
        registry = self._registries.get(kind)
        if registry is not None:
            return registry
        if kind not in hookspecs.REGISTRATION_HOOKS:
            raise KeyError(f"unknown registry kind {kind!r}")
        registry = Registry(kind, REGISTRY_BASES[kind])
        caller = getattr(self.pm.hook, hookspecs.REGISTRATION_HOOKS[kind])
        by_plugin = {id(p): n for n, p in self.pm.list_name_plugin()}
        # pluggy returns implementations in registration order; call them in that order.
        for impl in caller.get_hookimpls():
            source = by_plugin.get(id(impl.plugin), impl.plugin_name)
            registry.current_source = source
            try:
                impl.function(**{a: registry for a in impl.argnames})
            except PluginError:
                raise
            except Exception:
                info = self.info(source)
                if info is None:
                    raise
                self._fail(info, f"raised while registering {kind}")
        registry.current_source = "<direct>"
        self._registries[kind] = registry
        return registry

    def choices(self, kind: str) -> list[str]:
        return self.registry(kind).names()

    def load(self, kind: str, name: str) -> Any:
        return self.registry(kind).load(name)

    def info(self, name: str) -> PluginInfo | None:
        for info in self.plugins:
            if info.name == name:
                return info
        return None

    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.status is PluginStatus.FAILED]


def _dist_name(ep: importlib.metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def make_plugin_manager(
    *,
    entry_points: bool = True,
    extra_plugins: Iterable[tuple[str, object]] = (),
    env: Mapping[str, str] | None = None,
    strict: bool | None = None,
) -> PluginManager:
    """A new plugin manager with the installed plugins (and ``extra_plugins``) loaded."""
    env = os.environ if env is None else env
    if strict is None:
        strict = env.get(ENV_STRICT, "").strip().lower() in ("1", "true", "yes")
    manager = PluginManager(strict=strict)
    if entry_points:
        manager.load_entry_points(env)
    for name, plugin in extra_plugins:
        manager.register(plugin, name)
    return manager


RegistryChoices = Callable[[str], list[str]]
