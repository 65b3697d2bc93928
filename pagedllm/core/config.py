"""Typed configuration objects built from :class:`~pagedllm.core.engine_args.EngineArgs`.

``EngineArgs`` is the flat list of options a user sets; :func:`create_engine_config`
validates them (see :mod:`pagedllm.core.args.validate`) and splits them into one config
object per concern. Every config field has a default (the option's declared default, or
what pagedllm picks when the option is unset), so a test or a plugin can build one from
the fields it cares about.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.args.checks import invalid_choices
from pagedllm.core.args.spec import declared_default, format_value
from pagedllm.core.args.validate import (
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    DEFAULT_SCHEDULER,
    ENV_CPU_KVCACHE_SPACE,
    cpu_kvcache_space_gib,
    resolve_device,
    scheduler_class,
    validate_engine_args,
)
from pagedllm.core.batch_invariance import batch_invariant_setting, check_batch_invariant_options
from pagedllm.core.compilation import CompilationConfig, compilation_config
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.interfaces import Device
    from pagedllm.core.plugins import PluginManager

__all__ = [
    "DEFAULT_CPU_KVCACHE_SPACE_GIB",
    "DEFAULT_SCHEDULER",
    "ENV_CPU_KVCACHE_SPACE",
    "CacheConfig",
    "CompilationConfig",
    "DecodingConfig",
    "DeviceConfig",
    "LoadConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PagedLLMConfig",
    "ParallelConfig",
    "SchedulerConfig",
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


def _flag(name: str) -> Any:
    """The declared default of engine option ``name`` (immutable values only)."""
    return declared_default(EngineArgs, name)


@dataclasses.dataclass(slots=True)
class ModelConfig:
    model: str = _flag("model")
    # The model's own tokenizer when empty.
    tokenizer: str = ""
    tokenizer_mode: str = _flag("tokenizer_mode")
    trust_remote_code: bool = _flag("trust_remote_code")
    revision: str | None = _flag("revision")
    tokenizer_revision: str | None = _flag("tokenizer_revision")
    dtype: str = _flag("dtype")
    seed: int | None = _flag("seed")
    max_model_len: int | None = _flag("max_model_len")
    hf_config_path: str | None = _flag("hf_config_path")
    # A dict of config attributes, or (from Python) a callable that edits the config.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = dataclasses.field(default_factory=dict)
    rope_scaling: dict[str, Any] = dataclasses.field(default_factory=dict)
    rope_theta: float | None = _flag("rope_theta")
    # [model] when empty.
    served_model_name: list[str] = dataclasses.field(default_factory=list)
    task: str = _flag("task")
    skip_tokenizer_init: bool = _flag("skip_tokenizer_init")
    max_logprobs: int = _flag("max_logprobs")
    disable_sliding_window: bool = _flag("disable_sliding_window")
    generation_config: str = _flag("generation_config")
    override_generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    logits_processor_pattern: str | None = _flag("logits_processor_pattern")
    config_format: str = _flag("config_format")
    enforce_eager: bool = _flag("enforce_eager")
    # --batch-invariant (or PAGEDLLM_BATCH_INVARIANT / VLLM_BATCH_INVARIANT=1).
    batch_invariant: bool = _flag("batch_invariant")
    quantization: str | None = _flag("quantization")
    model_impl: str = _flag("model_impl")
    runner: str = _flag("runner")
    convert: str = _flag("convert")
    override_pooler_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tokenizer:
            self.tokenizer = self.model
        if not self.served_model_name:
            self.served_model_name = [self.model]


@dataclasses.dataclass(slots=True)
class LoadConfig:
    load_format: str = _flag("load_format")
    download_dir: str | None = _flag("download_dir")
    # Skipped when --ignore-patterns is unset: the extra copies some repositories ship.
    ignore_patterns: list[str] = dataclasses.field(default_factory=lambda: ["original/**/*"])
    model_loader_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    use_tqdm_on_load: bool = _flag("use_tqdm_on_load")
    qlora_adapter_name_or_path: str | None = _flag("qlora_adapter_name_or_path")


@dataclasses.dataclass(slots=True)
class CacheConfig:
    # The Device ABC's default_block_size; the engine uses the chosen device's.
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = _flag("prefix_caching_hash_algo")
    gpu_memory_utilization: float = _flag("gpu_memory_utilization")
    swap_space_gib: float = _flag("swap_space")
    num_gpu_blocks_override: int | None = _flag("num_gpu_blocks_override")
    kv_cache_dtype: str = _flag("kv_cache_dtype")
    calculate_kv_scales: bool = _flag("calculate_kv_scales")
    # The KV-cache budget on devices without a memory fraction (the cpu).
    cpu_kvcache_space_gib: float = DEFAULT_CPU_KVCACHE_SPACE_GIB


@dataclasses.dataclass(slots=True)
class SchedulerConfig:
    # --max-num-batched-tokens depends on the entry point when unset (see
    # _DEFAULT_MAX_NUM_BATCHED_TOKENS); this is the engine's.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = _flag("max_num_partial_prefills")
    max_long_partial_prefills: int = _flag("max_long_partial_prefills")
    long_prefill_token_threshold: int = _flag("long_prefill_token_threshold")
    policy: str = _flag("scheduling_policy")
    preemption_mode: str = "recompute"
    delay_factor: float = _flag("scheduler_delay_factor")
    # None is the default scheduler; a class, or the dotted path to one.
    scheduler_cls: str | type | None = None
    # --step-extensions: plugins' step extensions to turn on, by registered name.
    step_extensions: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = _flag("tensor_parallel_size")
    pipeline_parallel_size: int = _flag("pipeline_parallel_size")
    data_parallel_size: int = _flag("data_parallel_size")
    # "uni" (one process), "mp" (worker processes: tensor-parallel ranks or pipeline
    # stages) or "ray" (the same as Ray actors).
    distributed_executor_backend: str = "uni"
    # MoE layers split by expert over the tensor-parallel ranks (not by rows).
    enable_expert_parallel: bool = _flag("enable_expert_parallel")
    # Data-parallel replicas over several nodes: how many run on this one (None: all),
    # and where the head node takes the others' registrations.
    data_parallel_size_local: int | None = _flag("data_parallel_size_local")
    data_parallel_address: str | None = _flag("data_parallel_address")
    data_parallel_rpc_port: int | None = _flag("data_parallel_rpc_port")
    # How many ranks load their weights at once (None: all).
    max_parallel_loading_workers: int | None = _flag("max_parallel_loading_workers")

    @property
    def local_replicas(self) -> int:
        """The data-parallel replicas this node runs (on the head node, those from 0)."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def multi_node(self) -> bool:
        """Whether some data-parallel replicas run on other nodes."""
        return self.local_replicas < self.data_parallel_size


@dataclasses.dataclass(slots=True, kw_only=True)
class DeviceConfig:
    # device.name when empty.
    name: str = ""
    device: Device

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.device.name

    @property
    def torch_device(self) -> Any:
        return self.device.torch_device()


@dataclasses.dataclass(slots=True)
class DecodingConfig:
    guided_decoding_backend: str = _flag("guided_decoding_backend")
    disable_fallback: bool = _flag("guided_decoding_disable_fallback")
    disable_any_whitespace: bool = _flag("guided_decoding_disable_any_whitespace")
    disable_additional_properties: bool = _flag("guided_decoding_disable_additional_properties")
    reasoning_parser: str | None = _flag("reasoning_parser")
    # --guided-decoding-compile-*: worker processes, and the bounds of one compile.
    compile_workers: int = _flag("guided_decoding_compile_workers")
    compile_timeout: float = _flag("guided_decoding_compile_timeout")
    compile_memory_mib: int = _flag("guided_decoding_compile_memory")
    compile_cache_size: int = _flag("guided_decoding_cache_size")
    compile_cache_memory_mib: float = _flag("guided_decoding_cache_memory")


@dataclasses.dataclass(slots=True)
class ObservabilityConfig:
    disable_log_stats: bool = _flag("disable_log_stats")


@dataclasses.dataclass(slots=True)
class LoRAConfig:
    """--enable-lora and its limits."""

    max_loras: int = _flag("max_loras")
    max_lora_rank: int = _flag("max_lora_rank")
    max_cpu_loras: int | None = _flag("max_cpu_loras")
    lora_dtype: str = _flag("lora_dtype")


@dataclasses.dataclass(slots=True, kw_only=True)
class PagedLLMConfig:
    """Everything the engine needs, validated."""

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
    # --speculative-config (a pagedllm.core.spec_decode.SpeculativeConfig), or None.
    speculative_config: Any = None
    # -O, --cuda-graph-sizes, --max-seq-len-to-capture, --enforce-eager.
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)


# Defaults that depend on who starts the engine (as in vLLM: the server keeps steps
# short for latency; the LLM class favours throughput).
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {
    UsageContext.LLM_CLASS: 8192,
    UsageContext.OPENAI_API_SERVER: 2048,
    UsageContext.ENGINE_CONTEXT: declared_default(SchedulerConfig, "max_num_batched_tokens"),
}


def _default_step_tokens(args: Any, usage_context: UsageContext, device: Any) -> int:
    """The token budget of a step where --max-num-batched-tokens is not given: the
    device's own for a server that chunks prompts (``Device.server_step_tokens``), else
    the entry point's."""
    chunked = _unset_or(args.enable_chunked_prefill, SchedulerConfig, "enable_chunked_prefill")
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


def _require(condition: bool, option: str, value: Any, why: str) -> None:
    if not condition:
        raise ConfigError(f"{option}={format_value(value)} is invalid: {why}")


def _unset_or(value: Any, config_cls: type, name: str) -> Any:
    """``value``, or the config's default for ``name`` when the option is unset."""
    return declared_default(config_cls, name) if value is None else value


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    _require(args.max_loras >= 1, "--max-loras", args.max_loras, "must be at least 1")
    _require(args.max_lora_rank >= 1, "--max-lora-rank", args.max_lora_rank, "must be positive")
    if args.max_cpu_loras is not None:
        _require(
            args.max_cpu_loras >= args.max_loras,
            "--max-cpu-loras",
            args.max_cpu_loras,
            f"must be at least --max-loras ({args.max_loras})",
        )
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_dtype=args.lora_dtype,
    )


def _parallel_config(args: EngineArgs, device: Any) -> ParallelConfig:
    """-tp, -pp and --distributed-executor-backend, checked against what runs with them."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    _require(tp >= 1, "--tensor-parallel-size", tp, "must be at least 1")
    _require(pp >= 1, "--pipeline-parallel-size", pp, "must be at least 1")
    ranks = tp * pp
    sizes = [f"--tensor-parallel-size {tp}"] if tp > 1 else []
    sizes += [f"--pipeline-parallel-size {pp}"] if pp > 1 else []
    flag = " with ".join(sizes)
    backend = args.distributed_executor_backend or ("mp" if ranks > 1 else "uni")
    if backend == "external_launcher":
        raise ConfigError(
            "--distributed-executor-backend external_launcher is not supported by pagedllm "
            "yet; use mp (worker processes), ray (Ray actors) or uni"
        )
    if backend == "uni" and ranks > 1:
        raise ConfigError(
            f"--distributed-executor-backend uni runs one process, which cannot hold the "
            f"{ranks} ranks of {flag}; use mp"
        )
    if ranks > 1:
        refused = {
            "--qlora-adapter-name-or-path": bool(args.qlora_adapter_name_or_path),
        }
        for option, given in refused.items():
            if given:
                raise ConfigError(f"{option} is not supported with {flag} yet")
        if device.name == "cuda":
            import torch

            if torch.cuda.device_count() < ranks:
                raise ConfigError(
                    f"{flag} needs {ranks} GPUs; {torch.cuda.device_count()} are visible"
                )
    loading = args.max_parallel_loading_workers
    if loading is not None:
        _require(loading >= 1, "--max-parallel-loading-workers", loading, "must be at least 1")
        if ranks == 1:
            raise ConfigError(
                "--max-parallel-loading-workers limits how many of the ranks of "
                "--tensor-parallel-size or --pipeline-parallel-size above 1 load at once; "
                "one process loads alone"
            )
        if backend != "mp":
            raise ConfigError(
                f"--max-parallel-loading-workers applies to the mp backend (worker "
                f"processes); --distributed-executor-backend {backend} loads every rank "
                "at once"
            )
    if args.enable_expert_parallel and args.data_parallel_size > 1:
        raise ConfigError(
            "--enable-expert-parallel with --data-parallel-size above 1 is not supported: "
            "the data-parallel replicas are separate engines, so the experts cannot be "
            "spread over them; each replica splits its experts over its own "
            "--tensor-parallel-size ranks with --enable-expert-parallel and one replica"
        )
    return ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=backend,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        max_parallel_loading_workers=loading,
    )


def _speculative_config(values: dict[str, Any] | None) -> Any:
    if not values:
        return None
    from pagedllm.core.spec_decode import SpeculativeConfig

    return SpeculativeConfig.from_dict(dict(values))


def create_engine_config(
    args: EngineArgs,
    pm: PluginManager,
    usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
) -> PagedLLMConfig:
    """Validate ``args`` and build the typed configuration.

    Raises :class:`ConfigError` for invalid values and for options whose feature pagedllm
    does not have (naming the option), never ignoring them.
    """
    device = validate_engine_args(args, pm)

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

    if args.calculate_kv_scales:
        _require(
            args.kv_cache_dtype in ("fp8", "fp8_e4m3"),
            "--calculate-kv-scales",
            True,
            "scales are for an fp8 (e4m3) KV cache: add --kv-cache-dtype fp8 "
            f"(the cache is {args.kv_cache_dtype!r}; fp8_e5m2 is stored without scales)",
        )

    ignore = args.ignore_patterns
    if isinstance(ignore, str):
        ignore = [ignore]
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
            batch_invariant=batch_invariant_setting(args),
            quantization=args.quantization,
            model_impl=args.model_impl,
            runner=args.runner,
            convert=args.convert,
            override_pooler_config=dict(args.override_pooler_config or {}),
        ),
        load_config=LoadConfig(
            load_format=args.load_format,
            download_dir=args.download_dir,
            ignore_patterns=list(_unset_or(ignore, LoadConfig, "ignore_patterns")),
            model_loader_extra_config=dict(args.model_loader_extra_config or {}),
            use_tqdm_on_load=args.use_tqdm_on_load,
            qlora_adapter_name_or_path=args.qlora_adapter_name_or_path,
        ),
        cache_config=CacheConfig(
            block_size=args.block_size or device.default_block_size,
            enable_prefix_caching=_unset_or(
                args.enable_prefix_caching, CacheConfig, "enable_prefix_caching"
            ),
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            gpu_memory_utilization=args.gpu_memory_utilization,
            swap_space_gib=float(args.swap_space),
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=bool(args.calculate_kv_scales),
            cpu_kvcache_space_gib=cpu_kvcache_space_gib(),
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=(
                args.max_num_batched_tokens or _default_step_tokens(args, usage_context, device)
            ),
            max_num_seqs=_unset_or(args.max_num_seqs, SchedulerConfig, "max_num_seqs"),
            enable_chunked_prefill=_unset_or(
                args.enable_chunked_prefill, SchedulerConfig, "enable_chunked_prefill"
            ),
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
            preemption_mode=_unset_or(args.preemption_mode, SchedulerConfig, "preemption_mode"),
            delay_factor=args.scheduler_delay_factor,
            scheduler_cls=args.scheduler_cls,
            step_extensions=tuple(args.step_extensions),
        ),
        parallel_config=_parallel_config(args, device),
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
            compile_cache_memory_mib=args.guided_decoding_cache_memory,
            reasoning_parser=args.reasoning_parser,
        ),
        observability_config=ObservabilityConfig(disable_log_stats=args.disable_log_stats),
        speculative_config=_speculative_config(args.speculative_config),
        lora_config=_lora_config(args),
    )
    config.compilation_config = compilation_config(args, config.scheduler_config.max_num_seqs)
    pm.hook.pagedllm_update_config(config=config)
    _check_data_parallel(config, usage_context)
    check_batch_invariant_options(config)
    return config


def _check_data_parallel(config: PagedLLMConfig, usage_context: UsageContext) -> None:
    """``--data-parallel-size``, checked against who starts the engine and the device.

    Replicas are engine processes behind the API server's front end (``pagedllm serve``,
    and ``run-batch``, which serves through the same front end); an ``LLM`` or an
    ``LLMEngine`` is one engine in the caller's process, so asking it for several would
    silently run one. On a GPU each replica takes its ranks' (``-tp`` x ``-pp``) devices."""
    parallel = config.parallel_config
    dp = parallel.data_parallel_size
    _require(dp >= 1, "--data-parallel-size", dp, "must be at least 1")
    local = parallel.data_parallel_size_local
    if local is not None:
        _require(1 <= local <= dp, "--data-parallel-size-local", local, f"must be 1 to {dp}")
    port = parallel.data_parallel_rpc_port
    if port is not None:
        _require(0 < port < 65536, "--data-parallel-rpc-port", port, "must be a TCP port")
    if dp == 1:
        for flag, value in (
            ("--data-parallel-size-local", local),
            ("--data-parallel-address", parallel.data_parallel_address),
            ("--data-parallel-rpc-port", port),
        ):
            if value is not None:
                raise ConfigError(f"{flag} applies with --data-parallel-size above 1")
        return
    if usage_context != UsageContext.OPENAI_API_SERVER:
        raise ConfigError(
            f"--data-parallel-size {dp}: the offline LLM class, LLMEngine and `pagedllm "
            f"bench throughput` run one engine in this process; serve {dp} replicas with "
            f"`pagedllm serve MODEL --data-parallel-size {dp}` instead"
        )
    device = config.device_config.device
    if device.name not in ("cpu", "cuda"):
        raise ConfigError(
            f"--data-parallel-size {dp}: data-parallel replicas run on the cpu and cuda "
            f"devices only, not --device {device.name}"
        )
    if device.name == "cuda":
        import torch

        ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        here = parallel.local_replicas
        if torch.cuda.device_count() < here * ranks:
            raise ConfigError(
                f"{here} data-parallel replicas on this node with {ranks} rank(s) per "
                f"replica (-tp x -pp) need {here * ranks} GPUs; "
                f"{torch.cuda.device_count()} are visible"
            )
    if parallel.multi_node:
        from pagedllm.distributed.replica_nodes import data_parallel_key

        data_parallel_key()  # (required: refused by name when unset)
