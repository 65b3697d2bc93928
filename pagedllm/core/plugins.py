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
import difflib
import enum
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import pluggy

from pagedllm.core import hookspecs
from pagedllm.core.errors import PluginError
from pagedllm.core.registry import (
    BUILTIN_DISTRIBUTION,
    ENV_DISABLE,
    REGISTRY_BASES,
    Registry,
    RegistryEntry,
)

__all__ = [
    "ENV_ALLOW",
    "ENV_DISABLE",
    "ENV_STRICT",
    "PluginInfo",
    "PluginManager",
    "PluginStatus",
    "Registry",
    "RegistryEntry",
    "make_plugin_manager",
]

logger = logging.getLogger("pagedllm.plugins")

ENTRY_POINT_GROUP = "pagedllm"

ENV_ALLOW = "PAGEDLLM_PLUGINS"
ENV_STRICT = "PAGEDLLM_STRICT_PLUGINS"

# pagedllm's own entry points that an installation older than them lacks (an editable
# install's metadata is written when installed): registered as built-in all the same.
BUILTIN_ENTRY_POINTS = {
    "pagedllm.core": "pagedllm.core.builtins",
    "pagedllm.features": "pagedllm.features",
    "pagedllm.executors": "pagedllm.executors",
}


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
        # Name-collision warnings already given (registries are refilled after a change).
        self._warned: set[str] = set()

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
        else:
            try:
                self._check_hooks(plugin)
            except PluginError as exc:
                self.pm.unregister(plugin)
                self._fail(info, str(exc))
        self._registries.clear()
        return info

    def _check_hooks(self, plugin: object) -> None:
        """Refuse a plugin whose hooks pluggy would never call: an implementation of a
        hook pagedllm does not define (pluggy's ``check_pending``; a misspelled name)
        or a hook function not marked with ``@hookimpl``."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = sorted(
                caller.name
                for caller in self.pm.get_hookcallers(plugin) or ()
                if not caller.has_spec()
            )
            raise PluginError(
                f"implements {_describe_unknown(unknown, self.hook_names())}"
            ) from None
        implemented = {caller.name for caller in self.pm.get_hookcallers(plugin) or ()}
        unmarked = sorted(
            attr
            for attr in self.hook_names() - implemented
            if inspect.isroutine(getattr(plugin, attr, None))
        )
        if unmarked:
            raise PluginError(
                f"defines {', '.join(map(repr, unmarked))} without marking it with "
                f"@hookimpl (from pagedllm import hookimpl), so it would never be called"
            )

    def hook_names(self) -> set[str]:
        """Every hook pagedllm defines (those with a spec)."""
        return {
            name
            for name, caller in vars(self.pm.hook).items()
            if not name.startswith("_") and caller.has_spec()
        }

    def load_entry_points(self, env: Mapping[str, str]) -> None:
        allow = _env_names(env, ENV_ALLOW)
        disabled = _env_names(env, ENV_DISABLE) or set()
        installed = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        missing = BUILTIN_ENTRY_POINTS.keys() - {ep.name for ep in installed}
        installed += [
            importlib.metadata.EntryPoint(name, BUILTIN_ENTRY_POINTS[name], ENTRY_POINT_GROUP)
            for name in sorted(missing)
        ]
        identities: dict[int, tuple[str | None, str | None]] = {}

        def identity(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
            """(distribution name, version) of ``ep``'s package, read once per package."""
            if ep.dist is None:
                return (BUILTIN_DISTRIBUTION, None) if ep.name in missing else (None, None)
            key = id(ep.dist)
            if key not in identities:
                identities[key] = _dist_identity(ep.dist)
            return identities[key]

        eps = sorted(
            installed, key=lambda ep: (identity(ep)[0] != BUILTIN_DISTRIBUTION, ep.name)
        )
        seen: set[str] = set()
        for ep in eps:
            if ep.name in seen:
                # The same distribution found twice on sys.path (e.g. an editable install
                # and a build directory); the first one wins, like Python imports.
                continue
            seen.add(ep.name)
            dist, version = identity(ep)
            if ep.name in missing:
                version = _own_version()
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
        """Import a Python file as a plugin (used by ``--tool-parser-plugin``); a file
        that fails to import or implements its hooks wrongly is a :class:`PluginError`."""
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
        info = self.register(module, f"file:{file}", value=str(file))
        if info.status is PluginStatus.FAILED:
            # Named on the command line: a broken one stops the start, not just warns.
            raise PluginError(f"plugin file {str(file)!r} is broken:\n{info.error}")
        return info

    # --------------------------------------------------------------- registries

    def registry(self, kind: str) -> Registry:
        """The registry of ``kind``, filled on first use by one call of its registration
        hook through pluggy (so hook wrappers and hook-call monitoring see it). A plugin
        whose implementation raises is reported as failed and unregistered (what it
        provides is unavailable, in every registry), and the hook is called again."""
        registry = self._registries.get(kind)
        if registry is not None:
            return registry
        if kind not in hookspecs.REGISTRATION_HOOKS:
            raise KeyError(f"unknown registry kind {kind!r}")
        caller = getattr(self.pm.hook, hookspecs.REGISTRATION_HOOKS[kind])
        while True:
            registry = Registry(kind, REGISTRY_BASES[kind])
            registry.hook_sources = self._impl_sources(caller.get_hookimpls())
            registry.packages = {p.name: p.distribution for p in self.plugins if p.distribution}
            try:
                caller(registry=registry)
            except PluginError:
                raise
            except Exception as exc:
                source = _failing_source(exc.__traceback__, registry.hook_sources)
                info = self.info(source) if source is not None else None
                if info is None:
                    raise
                self._fail(info, f"raised while registering {kind}")
                self.pm.unregister(name=source)
                self._registries.clear()
                continue
            break
        registry.hook_sources = {}
        self._registries[kind] = registry
        for message in registry.collisions():
            if message not in self._warned:
                self._warned.add(message)
                logger.warning("pagedllm plugins: %s", message)
        return registry

    def _impl_sources(self, impls: Iterable[Any]) -> dict[int, str]:
        """The id of the code of each hook implementation -> the name its plugin was
        loaded under (the plugin's function objects keep the code objects alive)."""
        names = {id(plugin): name for name, plugin in self.pm.list_name_plugin()}
        sources = {}
        for impl in impls:
            function = getattr(impl.function, "__func__", impl.function)
            code = getattr(inspect.unwrap(function), "__code__", None)
            if code is not None:
                sources[id(code)] = names.get(id(impl.plugin), impl.plugin_name)
        return sources

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


def _describe_unknown(names: list[str], hook_names: set[str]) -> str:
    """``unknown hook 'pagedllm_register_device' (did you mean ...?)``"""
    hooks = sorted(hook_names)
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, hooks, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    described = f"unknown hook{'s' if len(parts) > 1 else ''} {', '.join(parts)}"
    if "did you mean" in described:
        return described
    return f"{described}; pagedllm's hooks are {', '.join(hooks)}"


def _failing_source(tb: TracebackType | None, sources: Mapping[int, str]) -> str | None:
    """The plugin whose hook implementation raised: the innermost one in the traceback."""
    found = None
    while tb is not None:
        found = sources.get(id(tb.tb_frame.f_code), found)
        tb = tb.tb_next
    return found


def _own_version() -> str | None:
    try:
        return importlib.metadata.version(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dist_identity(dist: importlib.metadata.Distribution) -> tuple[str | None, str | None]:
    """The ``Name`` and ``Version`` of an installed distribution from its metadata's header
    lines alone: ``dist.name`` and ``dist.version`` parse the whole file as an e-mail
    message, long description included, at each access (a few ms a package, paid at every
    ``pagedllm`` start)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in fields:
            fields[key] = value.strip()
    name = fields.get("Name") or dist.name
    version = fields.get("Version") or dist.version
    return name, version


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
