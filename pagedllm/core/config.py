"""Typed configuration objects built from :class:`~pagedllm.core.engine_args.EngineArgs`.

``EngineArgs`` is the flat list of options a user sets; :func:`create_engine_config`
validates them (with messages that name the option and the valid values) and splits them
into one config object per concern.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.argspec import (
    apply_deprecated_aliases,
    check_field_types,
    field_meta,
    format_value,
    option_name,
    refused_fields,
)
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.interfaces import Device
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.scheduler import Scheduler

logger = logging.getLogger("pagedllm.config")

# KV-cache space on the cpu device, in GiB (the cpu has no --gpu-memory-utilization).
ENV_CPU_KVCACHE_SPACE = "PAGEDLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0


class UsageContext(enum.Enum):
    LLM_CLASS = "llm_class"
    OPENAI_API_SERVER = "openai_api_server"
    ENGINE_CONTEXT = "engine_context"


@dataclasses.dataclass(slots=True)
class ModelConfig:
    model: str
    tokenizer: str
    tokenizer_mode: str
    trust_remote_code: bool
    revision: str | None
    tokenizer_revision: str | None
    dtype: str
    seed: int | None
    max_model_len: int | None
    hf_config_path: str | None
    # A dict of config attributes, or (from Python) a callable that edits the config.
    hf_overrides: dict[str, Any] | Callable[[Any], Any]
    rope_scaling: dict[str, Any]
    rope_theta: float | None
    served_model_name: list[str]
    task: str
    skip_tokenizer_init: bool
    max_logprobs: int
    disable_sliding_window: bool
    generation_config: str
    override_generation_config: dict[str, Any]
    logits_processor_pattern: str | None
    config_format: str
    enforce_eager: bool
    quantization: str | None


@dataclasses.dataclass(slots=True)
class LoadConfig:
    load_format: str
    download_dir: str | None
    ignore_patterns: list[str]
    model_loader_extra_config: dict[str, Any]
    use_tqdm_on_load: bool


@dataclasses.dataclass(slots=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    gpu_memory_utilization: float
    swap_space_gib: float
    num_gpu_blocks_override: int | None
    kv_cache_dtype: str
    # The KV-cache budget on devices without a memory fraction (the cpu).
    cpu_kvcache_space_gib: float


@dataclasses.dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prefill_token_threshold: int
    policy: str
    preemption_mode: str
    delay_factor: float
    scheduler_cls: str | None


@dataclasses.dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclasses.dataclass(slots=True)
class DeviceConfig:
    name: str
    device: Device

    @property
    def torch_device(self) -> Any:
        return self.device.torch_device()


@dataclasses.dataclass(slots=True)
class DecodingConfig:
    guided_decoding_backend: str
    disable_fallback: bool
    disable_any_whitespace: bool
    disable_additional_properties: bool
    reasoning_parser: str | None
    # --guided-decoding-compile-*: worker processes, and the bounds of one compile.
    compile_workers: int = 2
    compile_timeout: float = 5.0
    compile_memory_mib: int = 512
    compile_cache_size: int = 256

    def __post_init__(self) -> None:
        _require(
            self.compile_workers >= 0,
            "--guided-decoding-compile-workers",
            self.compile_workers,
            "it must be 0 or more",
        )
        _require(
            self.compile_timeout > 0,
            "--guided-decoding-compile-timeout",
            self.compile_timeout,
            "it must be more than 0 seconds",
        )
        _require(
            self.compile_memory_mib > 0,
            "--guided-decoding-compile-memory",
            self.compile_memory_mib,
            "it must be more than 0 MiB",
        )
        _require(
            self.compile_cache_size >= 1,
            "--guided-decoding-cache-size",
            self.compile_cache_size,
            "it must be at least 1",
        )


@dataclasses.dataclass(slots=True)
class ObservabilityConfig:
    disable_log_stats: bool


@dataclasses.dataclass(slots=True)
class PagedLLMConfig:
    """Everything the engine needs, validated."""

    model_config: ModelConfig
    load_config: LoadConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    decoding_config: DecodingConfig
    observability_config: ObservabilityConfig
    # Features pagedllm does not build yet are refused before these could be set.
    lora_config: None = None
    speculative_config: None = None


# Defaults that depend on who starts the engine (as in vLLM: the server keeps steps
# short for latency; the LLM class favours throughput).
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {
    UsageContext.LLM_CLASS: 8192,
    UsageContext.OPENAI_API_SERVER: 2048,
    UsageContext.ENGINE_CONTEXT: 2048,
}
_DEFAULT_MAX_NUM_SEQS = 256


def _check_choices(args: EngineArgs, pm: PluginManager) -> None:
    """Choices checked for values set from Python too (argparse checks only the CLI).

    A deprecated alias is checked against the choices of the option it stands for, under
    its own name (before :func:`apply_deprecated_aliases` copies it).
    """
    fields = {field.name: field for field in dataclasses.fields(args)}
    for field in fields.values():
        meta = field_meta(field)
        if meta is None:
            continue
        value = getattr(args, field.name)
        if value is None:
            continue
        if meta.alias_of in fields and meta.choices is None and meta.registry is None:
            meta = field_meta(fields[meta.alias_of]) or meta
        if meta.registry is not None:
            valid = [*meta.extra_choices, *pm.choices(meta.registry)]
        elif meta.choices is not None:
            valid = list(meta.choices)
        else:
            continue
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if item not in valid:
                raise ConfigError(
                    f"{option_name(field.name)}: invalid choice {item!r} "
                    f"(choose from {', '.join(map(str, valid))})"
                )


def _require(condition: bool, option: str, value: Any, why: str) -> None:
    if not condition:
        raise ConfigError(f"{option}={format_value(value)} is invalid: {why}")


# vLLM's default --swap-space, in GiB (accepted so that leaving the flag out works).
_DEFAULT_SWAP_SPACE_GIB = 4

_GUIDED_OPTIONS = (
    "guided_decoding_disable_fallback",
    "guided_decoding_disable_any_whitespace",
    "guided_decoding_disable_additional_properties",
)


def _refuse_unused(args: EngineArgs, device_name: str, guided_backends: list[str]) -> None:
    """Options that are valid but would have no effect in this configuration are refused
    rather than silently ignored."""
    if args.task not in ("auto", "generate"):
        raise ConfigError(
            f"--task {args.task}: pagedllm serves text generation only (use auto or generate)"
        )
    if args.config_format not in ("auto", "hf"):
        raise ConfigError(
            f"--config-format {args.config_format}: only Hugging Face configs are read "
            f"(use auto or hf)"
        )
    if args.logits_processor_pattern is not None:
        raise ConfigError(
            "--logits-processor-pattern: requests cannot name logits processors in pagedllm "
            "yet, so there is nothing to allow"
        )
    # 0 says what pagedllm does (it reserves no swap space); the default is accepted too.
    if args.swap_space not in (0, _DEFAULT_SWAP_SPACE_GIB):
        raise ConfigError(
            f"--swap-space={args.swap_space}: pagedllm never swaps: it preempts by "
            f"recomputation and needs no swap space; use 0 or leave it out"
        )
    if device_name == "cpu" and args.gpu_memory_utilization != 0.9:
        raise ConfigError(
            "--gpu-memory-utilization does not apply to the cpu device; size the KV cache "
            f"with {ENV_CPU_KVCACHE_SPACE} (GiB) or --num-gpu-blocks-override"
        )
    if not guided_backends:
        for name in _GUIDED_OPTIONS:
            if getattr(args, name):
                raise ConfigError(
                    f"{option_name(name)}: no guided-decoding backend is installed, so this "
                    f"option would have no effect"
                )


_PREEMPTION_SWAP_REFUSED = (
    "--preemption-mode swap is not supported: pagedllm preempts by recomputation "
    "(on the cpu the KV cache already lives in host memory, so swapping would only "
    "copy it); leave --preemption-mode unset or use recompute"
)


def _refuse_unsupported(args: EngineArgs) -> None:
    """Valid choices that pagedllm cannot honour, refused here (before any weight is
    read) rather than when the engine is built."""
    if args.preemption_mode == "swap":
        raise ConfigError(_PREEMPTION_SWAP_REFUSED)
    if args.tokenizer_mode not in ("auto", "slow"):
        raise ConfigError(
            f"--tokenizer-mode {args.tokenizer_mode}: not supported (use auto or slow)"
        )
    scheduler_class(args.scheduler_cls)


DEFAULT_SCHEDULER = "pagedllm.core.scheduler.Scheduler"
# vLLM's names for its default scheduler mean ours.
_SCHEDULER_ALIASES = ("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler")


def scheduler_class(path: str | None) -> type[Scheduler]:
    """``--scheduler-cls``: a dotted path to a Scheduler subclass."""
    import importlib

    from pagedllm.core.scheduler import Scheduler

    if path in (None, DEFAULT_SCHEDULER, *_SCHEDULER_ALIASES):
        return Scheduler
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--scheduler-cls {path}: cannot import it: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigError(
            f"--scheduler-cls {path}: not a subclass of pagedllm.core.scheduler.Scheduler"
        )
    return cls


def resolve_device(name: str, pm: PluginManager) -> Device:
    """The device for ``--device NAME`` (``auto``: the best available one that runs models)."""
    registry = pm.registry("devices")
    if name == "auto":
        candidates = []
        for entry in registry:
            cls = registry.load(entry.name)
            if cls.runs_models and cls.is_available():
                candidates.append(cls)
        if not candidates:
            raise ConfigError("--device auto: no available device can run models")
        return max(candidates, key=lambda c: c.priority)()
    cls = registry.load(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        available = [e.name for e in registry if registry.load(e.name).is_available()]
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


def create_engine_config(
    args: EngineArgs,
    pm: PluginManager,
    usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
) -> PagedLLMConfig:
    """Validate ``args`` and build the typed configuration.

    Raises :class:`ConfigError` for invalid values and for options whose feature pagedllm
    does not have (naming the option), never ignoring them.
    """
    problems = check_field_types(args)
    if problems:
        raise ConfigError("; ".join(problems))
    # Refusals and choices come before deprecated aliases are copied onto the options
    # they stand for, so that messages name the flag the user typed.
    problems = refused_fields(args)
    if problems:
        raise ConfigError("; ".join(problems))
    _check_choices(args, pm)
    for warning in apply_deprecated_aliases(args):
        logger.warning("%s", warning)
    _refuse_unsupported(args)

    device = resolve_device(args.device, pm)
    # Import the chosen plugins now, so a broken one fails at start-up, by name.
    pm.load("load_formats", args.load_format)
    if args.quantization is not None:
        pm.load("quantization_methods", args.quantization)

    _require(
        0 < args.gpu_memory_utilization <= 1,
        "--gpu-memory-utilization",
        args.gpu_memory_utilization,
        "must be in (0, 1]",
    )
    _require(args.swap_space >= 0, "--swap-space", args.swap_space, "must be >= 0 GiB")
    if args.num_gpu_blocks_override is not None:
        _require(
            args.num_gpu_blocks_override >= 1,
            "--num-gpu-blocks-override",
            args.num_gpu_blocks_override,
            "must be at least 1",
        )
    if args.max_model_len is not None:
        _require(
            args.max_model_len >= 1, "--max-model-len", args.max_model_len, "must be at least 1"
        )
    if args.max_num_seqs is not None:
        _require(args.max_num_seqs >= 1, "--max-num-seqs", args.max_num_seqs, "must be at least 1")
    if args.max_num_batched_tokens is not None:
        _require(
            args.max_num_batched_tokens >= 1,
            "--max-num-batched-tokens",
            args.max_num_batched_tokens,
            "must be at least 1",
        )
    _require(
        args.max_num_partial_prefills >= 1,
        "--max-num-partial-prefills",
        args.max_num_partial_prefills,
        "must be at least 1",
    )
    _require(
        1 <= args.max_long_partial_prefills <= args.max_num_partial_prefills,
        "--max-long-partial-prefills",
        args.max_long_partial_prefills,
        f"must be between 1 and --max-num-partial-prefills ({args.max_num_partial_prefills})",
    )
    _require(
        args.long_prefill_token_threshold >= 0,
        "--long-prefill-token-threshold",
        args.long_prefill_token_threshold,
        "must be >= 0",
    )
    _require(
        args.max_logprobs >= -1,
        "--max-logprobs",
        args.max_logprobs,
        "must be >= 0, or -1 for no limit",
    )
    _require(
        args.scheduler_delay_factor >= 0,
        "--scheduler-delay-factor",
        args.scheduler_delay_factor,
        "must be >= 0",
    )
    if args.seed is not None:
        _require(-(2**63) <= args.seed < 2**63, "--seed", args.seed, "must fit in 64 bits")

    _refuse_unused(args, device.name, pm.choices("guided_backends"))

    served = args.served_model_name
    if served is None:
        served_names = [args.model]
    elif isinstance(served, str):
        served_names = [served]
    else:
        served_names = list(served)
    _require(
        bool(served_names) and all(served_names),
        "--served-model-name",
        served,
        "names must be non-empty",
    )

    ignore = args.ignore_patterns
    if ignore is None:
        ignore_patterns = ["original/**/*"]
    elif isinstance(ignore, str):
        ignore_patterns = [ignore]
    else:
        ignore_patterns = list(ignore)

    enable_chunked_prefill = (
        True if args.enable_chunked_prefill is None else args.enable_chunked_prefill
    )
    config = PagedLLMConfig(
        model_config=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer or args.model,
            tokenizer_mode=args.tokenizer_mode,
            trust_remote_code=args.trust_remote_code,
            revision=args.revision,
            tokenizer_revision=args.tokenizer_revision,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len,
            hf_config_path=args.hf_config_path,
            hf_overrides=(
                args.hf_overrides if callable(args.hf_overrides) else dict(args.hf_overrides or {})
            ),
            rope_scaling=dict(args.rope_scaling or {}),
            rope_theta=args.rope_theta,
            served_model_name=served_names,
            task=args.task,
            skip_tokenizer_init=args.skip_tokenizer_init,
            max_logprobs=args.max_logprobs,
            disable_sliding_window=args.disable_sliding_window,
            generation_config=args.generation_config,
            override_generation_config=dict(args.override_generation_config or {}),
            logits_processor_pattern=args.logits_processor_pattern,
            config_format=args.config_format,
            enforce_eager=bool(args.enforce_eager),
            quantization=args.quantization,
        ),
        load_config=LoadConfig(
            load_format=args.load_format,
            download_dir=args.download_dir,
            ignore_patterns=ignore_patterns,
            model_loader_extra_config=dict(args.model_loader_extra_config or {}),
            use_tqdm_on_load=args.use_tqdm_on_load,
        ),
        cache_config=CacheConfig(
            block_size=args.block_size or device.default_block_size,
            enable_prefix_caching=(
                True if args.enable_prefix_caching is None else args.enable_prefix_caching
            ),
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            gpu_memory_utilization=args.gpu_memory_utilization,
            swap_space_gib=float(args.swap_space),
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            cpu_kvcache_space_gib=cpu_kvcache_space_gib(),
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=(
                args.max_num_batched_tokens or _DEFAULT_MAX_NUM_BATCHED_TOKENS[usage_context]
            ),
            max_num_seqs=args.max_num_seqs or _DEFAULT_MAX_NUM_SEQS,
            enable_chunked_prefill=enable_chunked_prefill,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
            preemption_mode=args.preemption_mode or "recompute",
            delay_factor=args.scheduler_delay_factor,
            scheduler_cls=args.scheduler_cls,
        ),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(name=device.name, device=device),
        decoding_config=DecodingConfig(
            guided_decoding_backend=args.guided_decoding_backend,
            disable_fallback=args.guided_decoding_disable_fallback,
            disable_any_whitespace=args.guided_decoding_disable_any_whitespace,
            disable_additional_properties=args.guided_decoding_disable_additional_properties,
            compile_workers=args.guided_decoding_compile_workers,
            compile_timeout=args.guided_decoding_compile_timeout,
            compile_memory_mib=args.guided_decoding_compile_memory,
            compile_cache_size=args.guided_decoding_cache_size,
            reasoning_parser=args.reasoning_parser,
        ),
        observability_config=ObservabilityConfig(disable_log_stats=args.disable_log_stats),
    )
    pm.hook.pagedllm_update_config(config=config)
    return config
