"""Validation of :class:`~pagedllm.core.engine_args.EngineArgs` before any model file is read.

What can be said about one option alone is declared with it (choices, range, supported
values, refusals) and checked by the loops in :mod:`pagedllm.core.args.checks`. What
depends on the machine or the installed plugins (the device, the scheduler class, an
option that has no effect without a guided-decoding backend) is checked here.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING

from pagedllm.core.args.checks import (
    apply_deprecated_aliases,
    check_field_types,
    invalid_choices,
    invalid_values,
    no_op_fields,
    refused_fields,
)
from pagedllm.core.args.spec import is_default, option_name
from pagedllm.core.configs.runtime import DEFAULT_CPU_KVCACHE_SPACE_GIB
from pagedllm.core.configs.scheduling import SchedulerConfig
from pagedllm.core.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.interfaces import Device
    from pagedllm.core.plugins import PluginManager

logger = logging.getLogger("pagedllm.config")

# KV-cache space on the cpu device, in GiB (the cpu has no --gpu-memory-utilization).
ENV_CPU_KVCACHE_SPACE = "PAGEDLLM_CPU_KVCACHE_SPACE"

# Overrides the device's attention backend (a registered name), as VLLM_ATTENTION_BACKEND.
ENV_ATTENTION_BACKEND = "PAGEDLLM_ATTENTION_BACKEND"

DEFAULT_SCHEDULER = str(SchedulerConfig.scheduler_cls)
# vLLM's names for its default scheduler mean ours.
_SCHEDULER_ALIASES = ("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler")

# Options that only tune a guided-decoding backend.
_GUIDED_OPTIONS = (
    "guided_decoding_disable_fallback",
    "guided_decoding_disable_any_whitespace",
    "guided_decoding_disable_additional_properties",
)


def _raise_if_any(problems: list[str]) -> None:
    if problems:
        raise ConfigError("; ".join(problems))


def validate_engine_args(args: EngineArgs, pm: PluginManager) -> Device:
    """Check ``args`` (copying deprecated aliases onto their options) and return the
    device to run on.

    Raises :class:`ConfigError` naming the option for an invalid value and for an
    option whose feature pagedllm does not have, never ignoring it.
    """
    _raise_if_any(check_field_types(args))
    # Refusals, choices and values come before deprecated aliases are copied onto the
    # options they stand for, so that messages name the flag the user typed.
    _raise_if_any(refused_fields(args))
    _raise_if_any(invalid_choices(args, pm.choices))
    _raise_if_any(invalid_values(args))
    for warning in apply_deprecated_aliases(args):
        logger.warning("%s", warning)
    for note in no_op_fields(args):
        logger.info("%s", note)
    _check_enable_reasoning(args)
    scheduler_class(args.scheduler_cls, pm)
    _check_step_extensions(args.step_extensions, pm)

    device = resolve_device(args.device, pm)
    # Import the chosen plugins now, so a broken one fails at start-up, by name.
    pm.load("load_formats", args.load_format)
    if args.quantization not in (None, "auto"):
        pm.load("quantization_methods", args.quantization)
    pm.load("attention_backends", attention_backend_name(device, pm))
    if args.reasoning_parser is not None:
        pm.load("reasoning_parsers", args.reasoning_parser)
    if args.guided_decoding_backend not in (None, "auto"):  # (refused if two plugins claim it)
        pm.registry("guided_backends").usable_entry(args.guided_decoding_backend)
    _refuse_without_effect(args, device, pm.choices("guided_backends"))
    return device


def _check_enable_reasoning(args: EngineArgs) -> None:
    """The deprecated ``--enable-reasoning`` is accepted beside ``--reasoning-parser``,
    which alone turns reasoning output on: alone, or set false beside a parser, it would
    change nothing."""
    if args.enable_reasoning is None:
        return
    if args.enable_reasoning and args.reasoning_parser is None:
        raise ConfigError(
            "--enable-reasoning needs --reasoning-parser NAME, which turns reasoning output on"
        )
    if not args.enable_reasoning and args.reasoning_parser is not None:
        raise ConfigError(
            "--enable-reasoning=False cannot turn reasoning output off while --reasoning-parser "
            "is set; leave out --reasoning-parser instead"
        )


def attention_backend_name(device: Device, pm: PluginManager) -> str:
    """The device's attention backend, or the one ``PAGEDLLM_ATTENTION_BACKEND`` names."""
    name = os.environ.get(ENV_ATTENTION_BACKEND, "").strip()
    if not name:
        return device.attention_backend
    choices = pm.choices("attention_backends")
    if name not in choices:
        raise ConfigError(
            f"{ENV_ATTENTION_BACKEND}={name!r} is not an attention backend; registered: "
            f"{', '.join(sorted(choices))}"
        )
    return name


def _refuse_without_effect(args: EngineArgs, device: Device, guided_backends: list[str]) -> None:
    """Options that are valid but would have no effect in this configuration are refused
    rather than silently ignored."""
    if not device.uses_gpu_memory_utilization and not is_default(args, "gpu_memory_utilization"):
        # The cpu is the one device that sizes its KV cache another way.
        raise ConfigError(
            f"--gpu-memory-utilization does not apply to the {device.name} device; size the "
            f"KV cache with {ENV_CPU_KVCACHE_SPACE} (GiB) or --num-gpu-blocks-override"
        )
    if not device.captures_graphs:
        # (The deprecated alias first: the message names the flag as typed.)
        for name in ("cuda_graph_sizes", "max_context_len_to_capture", "max_seq_len_to_capture"):
            if not is_default(args, name):
                raise ConfigError(
                    f"{option_name(name)} does not apply to the {device.name} device, which "
                    f"captures no CUDA graphs"
                )
        given = args.compilation_config
        if isinstance(given, dict) and {k.lower() for k in given} & {
            "cudagraph_capture_sizes",
            "use_cudagraph",
        }:
            raise ConfigError(
                f"--compilation-config: cudagraph_capture_sizes and use_cudagraph do not "
                f"apply to the {device.name} device, which captures no CUDA graphs"
            )
    if not guided_backends:
        for name in _GUIDED_OPTIONS:
            if not is_default(args, name):
                raise ConfigError(
                    f"{option_name(name)}: no guided-decoding backend is installed, so this "
                    f"option would have no effect"
                )


def scheduler_class(path: str | type | None, pm: PluginManager | None = None) -> type:
    """``--scheduler-cls``: a registered scheduler's name, a dotted path to a class, or
    the class; it implements :class:`~pagedllm.core.interfaces.scheduler.SchedulerInterface`."""
    from pagedllm.core.interfaces.scheduler import SchedulerInterface
    from pagedllm.core.scheduler import Scheduler

    if path in (None, DEFAULT_SCHEDULER, *_SCHEDULER_ALIASES):
        return Scheduler
    registry = pm.registry("schedulers") if pm is not None else None
    if isinstance(path, type):
        cls: object = path
        path = f"{path.__module__}.{path.__qualname__}"
    elif "." not in path:
        if registry is None or path not in registry:
            names = ", ".join(registry.names()) if registry is not None else "default"
            raise ConfigError(
                f"--scheduler-cls {path}: no scheduler of that name (registered: {names}; "
                "or give a class's dotted path 'module.Class')"
            )
        try:
            return registry.load(path)
        except PluginError as exc:
            raise ConfigError(f"--scheduler-cls {path}: {exc}") from exc
    else:
        module_name, _, class_name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"--scheduler-cls {path}: cannot import it: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, SchedulerInterface)):
        raise ConfigError(
            f"--scheduler-cls {path}: not a subclass of "
            f"{Scheduler.__module__}.{Scheduler.__qualname__} (nor of "
            f"{SchedulerInterface.__module__}.{SchedulerInterface.__qualname__}, the "
            "scheduler contract)"
        )
    return cls


def _check_step_extensions(names: list[str], pm: PluginManager) -> None:
    """``--step-extensions``: registered step extensions, each named once."""
    registry = pm.registry("step_extensions")
    for name in names:
        if name not in registry:
            raise ConfigError(
                f"--step-extensions {name}: no step extension of that name (registered: "
                f"{', '.join(registry.names()) or 'none'})"
            )
        try:
            registry.load(name)
        except PluginError as exc:
            raise ConfigError(f"--step-extensions {name}: {exc}") from exc


def resolve_device(name: str, pm: PluginManager) -> Device:
    """The device for ``--device NAME`` (``auto``: the best available one that runs models)."""
    registry = pm.registry("devices")
    if name == "auto":
        candidates = []
        for entry in registry:
            if entry.conflicts:  # (refused when named; "auto" does without it)
                continue
            cls = registry.load(entry.name)
            if cls.runs_models and cls.is_available():
                candidates.append(cls)
        if not candidates:
            raise ConfigError("--device auto: no available device can run models")
        return max(candidates, key=lambda c: c.priority)()
    cls = registry.load(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        available = [
            e.name for e in registry if not e.conflicts and registry.load(e.name).is_available()
        ]
        raise ConfigError(
            f"--device {name}: not available on this machine: {reason}. "
            f"Available devices: {', '.join(available) or 'none'}"
        )
    if not cls.runs_models:
        raise ConfigError(
            f"--device {name}: the device is present, but pagedllm has no model runner "
            f"for it yet; use --device cpu"
        )
    return cls()


def cpu_kvcache_space_gib(env: dict[str, str] | os._Environ[str] | None = None) -> float:
    env = os.environ if env is None else env
    raw = env.get(ENV_CPU_KVCACHE_SPACE)
    if raw is None or raw.strip() == "":
        return DEFAULT_CPU_KVCACHE_SPACE_GIB
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{ENV_CPU_KVCACHE_SPACE}={raw!r} is invalid: expected a number of GiB"
        ) from None
    if value <= 0:
        raise ConfigError(f"{ENV_CPU_KVCACHE_SPACE}={raw!r} is invalid: must be positive")
    return value
