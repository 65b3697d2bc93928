"""The engine's typed configuration, built from :class:`~pagedllm.core.engine_args.EngineArgs`.

Each concern has its config object (:mod:`pagedllm.core.configs`), which declares its
fields' defaults (the engine arguments take theirs from it) and checks its own values.
:func:`create_engine_config` validates the arguments (see
:mod:`pagedllm.core.args.validate`), builds each config from the arguments of its
fields' names, lets the device and the plugins adjust the result, checks it again and
freezes it: the engine runs with a configuration nobody changes under it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from pagedllm.core.args.checks import invalid_choices
from pagedllm.core.args.validate import (
    DEFAULT_SCHEDULER,
    ENV_CPU_KVCACHE_SPACE,
    cpu_kvcache_space_gib,
    resolve_device,
    scheduler_class,
    validate_engine_args,
)
from pagedllm.core.batch_invariance import batch_invariant_setting, check_batch_invariant_options
from pagedllm.core.compilation import compilation_config
from pagedllm.core.configs.base import Config
from pagedllm.core.configs.kv_events import KVEventsConfig
from pagedllm.core.configs.kv_transfer import KVTransferConfig
from pagedllm.core.configs.model import LoadConfig, ModelConfig
from pagedllm.core.configs.multimodal import MultiModalConfig
from pagedllm.core.configs.runtime import (
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    CacheConfig,
    DecodingConfig,
    DeviceConfig,
    LoRAConfig,
    ParallelConfig,
    SpeculativeConfig,
)
from pagedllm.core.configs.scheduling import (
    CompilationConfig,
    ObservabilityConfig,
    SchedulerConfig,
)
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager

__all__ = [
    "DEFAULT_CPU_KVCACHE_SPACE_GIB",
    "DEFAULT_SCHEDULER",
    "ENV_CPU_KVCACHE_SPACE",
    "CacheConfig",
    "CompilationConfig",
    "Config",
    "DecodingConfig",
    "DeviceConfig",
    "KVEventsConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "PagedLLMConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "UsageContext",
    "cpu_kvcache_space_gib",
    "create_engine_config",
    "resolve_device",
    "scheduler_class",
]


class UsageContext(enum.Enum):
    LLM_CLASS = "llm_class"
    OPENAI_API_SERVER = "openai_api_server"
    ENGINE_CONTEXT = "engine_context"


@dataclasses.dataclass(kw_only=True)
class PagedLLMConfig(Config):
    """Everything the engine needs, validated (and frozen by :func:`create_engine_config`)."""

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    load_config: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    # The one field without a default: a device is chosen by resolve_device.
    device_config: DeviceConfig
    decoding_config: DecodingConfig = dataclasses.field(default_factory=DecodingConfig)
    observability_config: ObservabilityConfig = dataclasses.field(
        default_factory=ObservabilityConfig
    )
    # --enable-lora's settings, or None without LoRA.
    lora_config: LoRAConfig | None = None
    # --speculative-config, or None.
    speculative_config: SpeculativeConfig | None = None
    # -O, --cuda-graph-sizes, --max-seq-len-to-capture, --enforce-eager.
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    # --limit-mm-per-prompt, --mm-processor-kwargs, --disable-mm-preprocessor-cache.
    multimodal_config: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    # --kv-events-config, or None.
    kv_events_config: KVEventsConfig | None = None
    # --kv-transfer-config, or None.
    kv_transfer_config: KVTransferConfig | None = None

    def check(self) -> None:
        """Each config's own checks (again, unless frozen: a plugin may have changed it),
        then those across configs."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Config) and not value.frozen:  # (frozen: validated)
                value.validate()
        parallel = self.parallel_config
        if parallel.ranks > 1 and self.load_config.qlora_adapter_name_or_path:
            raise ConfigError(
                f"--qlora-adapter-name-or-path is not supported with {parallel.sizes_flag()} yet"
            )
        if parallel.ranks > 1 and self.kv_transfer_config is not None:
            # (each rank would have to save and load its own share of every block)
            raise ConfigError(
                f"--kv-transfer-config is not supported with {parallel.sizes_flag()} yet"
            )
        check_batch_invariant_options(self)


# Defaults that depend on who starts the engine (as in vLLM: the server keeps steps
# short for latency; the LLM class favours throughput).
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {
    UsageContext.LLM_CLASS: 8192,
    UsageContext.OPENAI_API_SERVER: 2048,
    UsageContext.ENGINE_CONTEXT: SchedulerConfig.max_num_batched_tokens,
}


def _default_step_tokens(args: Any, usage_context: UsageContext, device: Any) -> int:
    """The token budget of a step where --max-num-batched-tokens is not given: the
    device's own for a server that chunks prompts (``Device.server_step_tokens``), else
    the entry point's."""
    chunked = args.enable_chunked_prefill
    if chunked is None:
        chunked = SchedulerConfig.enable_chunked_prefill
    if usage_context == UsageContext.OPENAI_API_SERVER and chunked and device.server_step_tokens:
        return int(device.server_step_tokens)
    return _DEFAULT_MAX_NUM_BATCHED_TOKENS[usage_context]


def _check_choices(args: Any, pm: PluginManager) -> None:
    """Choices checked for values set from Python too (argparse checks only the CLI).

    A deprecated alias is checked against the choices of the option it stands for, under
    its own name (before its value is copied onto that option).
    """
    problems = invalid_choices(args, pm.choices)
    if problems:
        raise ConfigError("; ".join(problems))


def create_engine_config(
    args: EngineArgs,
    pm: PluginManager,
    usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
) -> PagedLLMConfig:
    """Validate ``args`` and build the typed configuration, frozen.

    Raises :class:`ConfigError` for invalid values and for options whose feature pagedllm
    does not have (naming the option), never ignoring them. Before it is frozen, the
    plugins (``pagedllm_update_config``) and then the device
    (``Device.check_and_update_config``) may adjust it; it is checked again after them.
    """
    device = validate_engine_args(args, pm)
    scheduler = SchedulerConfig.from_args(
        args,
        max_num_batched_tokens=(
            args.max_num_batched_tokens or _default_step_tokens(args, usage_context, device)
        ),
    )
    config = PagedLLMConfig(
        model_config=ModelConfig.from_args(args, batch_invariant=batch_invariant_setting(args)),
        load_config=LoadConfig.from_args(args),
        cache_config=CacheConfig.from_args(
            args, block_size=args.block_size or device.default_block_size
        ),
        scheduler_config=scheduler,
        parallel_config=ParallelConfig.from_args(args),
        device_config=DeviceConfig(device=device),
        decoding_config=DecodingConfig.from_args(args),
        observability_config=ObservabilityConfig.from_args(args),
        lora_config=LoRAConfig.from_args(args) if args.enable_lora else None,
        speculative_config=(
            SpeculativeConfig.from_dict(dict(args.speculative_config))
            if args.speculative_config
            else None
        ),
        compilation_config=compilation_config(args, scheduler.max_num_seqs),
        multimodal_config=MultiModalConfig.from_args(args),
        kv_events_config=(
            KVEventsConfig.from_dict(dict(args.kv_events_config))
            if args.kv_events_config is not None
            else None
        ),
        kv_transfer_config=(
            KVTransferConfig.from_dict(dict(args.kv_transfer_config))
            if args.kv_transfer_config
            else None
        ),
    )
    _check_data_parallel(config, usage_context)
    _check_sleep_mode(config)
    pm.hook.pagedllm_update_config(config=config)
    device.check_and_update_config(config)
    config.validate()
    return config.freeze()


def _check_sleep_mode(config: PagedLLMConfig) -> None:
    """--enable-sleep-mode needs a device that releases memory (keeping addresses), and
    one engine to put to sleep."""
    if not config.model_config.enable_sleep_mode:
        return
    device = config.device_config.device
    if not device.releases_memory:
        raise ConfigError(
            f"--enable-sleep-mode is not supported on the {device.name} device yet (it cannot "
            "release its memory while asleep); leave the flag out"
        )
    dp = config.parallel_config.data_parallel_size
    if dp > 1:
        raise ConfigError(
            f"--enable-sleep-mode with --data-parallel-size {dp} is not supported yet (the "
            "sleep routes put one engine to sleep); leave one of them out"
        )


def _check_data_parallel(config: PagedLLMConfig, usage_context: UsageContext) -> None:
    """``--data-parallel-size``, checked against who starts the engine and the device.

    Replicas are engine processes behind the API server's front end (``pagedllm serve``,
    and ``run-batch``, which serves through the same front end); an ``LLM`` or an
    ``LLMEngine`` is one engine in the caller's process, so asking it for several would
    silently run one. (The sizes themselves are :class:`ParallelConfig`'s checks; how
    many GPUs the replicas need, the device's; the shared key of replicas on several
    nodes, the data-parallel entry point's.)"""
    dp = config.parallel_config.data_parallel_size
    if dp == 1:
        return
    if usage_context != UsageContext.OPENAI_API_SERVER:
        raise ConfigError(
            f"--data-parallel-size {dp}: the offline LLM class, LLMEngine and `pagedllm "
            f"bench throughput` run one engine in this process; serve {dp} replicas with "
            f"`pagedllm serve MODEL --data-parallel-size {dp}` instead"
        )
    device = config.device_config.device
    if not device.runs_data_parallel:
        raise ConfigError(
            f"--data-parallel-size {dp}: the {device.name} device does not run "
            "data-parallel replicas"
        )
