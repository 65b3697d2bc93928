"""How the model runs: decoding, parallelism, KV cache, LoRA adapters, the device and
speculative decoding."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.core.configs.base import Config, require, setting
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.interfaces import Device

# KV-cache space on the cpu device, in GiB (the cpu has no --gpu-memory-utilization).
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0


NO_TYPICAL_ACCEPTANCE = (
    "pagedllm has no typical acceptance sampler: it accepts draft tokens by rejection "
    "sampling, which keeps the target model's distribution"
)

# --speculative-config key -> why pagedllm refuses it when set (to anything but None/false).
SPEC_KEYS_REFUSED: dict[str, str] = {
    "quantization": "pagedllm does not support a quantized draft model",
    "disable_logprobs": "pagedllm does not speculate for a request that asks for logprobs (it "
    "decodes it a token a step), so their log probabilities are always returned",
    "disable_mqa_scorer": "pagedllm scores a request's draft tokens in one step of the target "
    "model; it has no other scorer to choose",
    "posterior_threshold": NO_TYPICAL_ACCEPTANCE,
    "posterior_alpha": NO_TYPICAL_ACCEPTANCE,
}


@dataclasses.dataclass
class DecodingConfig(Config):
    guided_decoding_backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str | None = None
    # --guided-decoding-compile-*: worker processes, and the bounds of one compile.
    compile_workers: int = setting(2, min=0, range_hint="it must be 0 or more")
    compile_timeout: float = setting(
        5.0, min=0, min_exclusive=True, range_hint="it must be more than 0 seconds"
    )
    compile_memory_mib: int = setting(
        512, min=0, min_exclusive=True, range_hint="it must be more than 0 MiB"
    )
    compile_cache_size: int = setting(256, min=1, range_hint="it must be at least 1")
    compile_cache_memory_mib: float = setting(512.0, min=0, range_hint="it must be 0 MiB or more")

    arg_names: ClassVar[dict[str, str]] = {
        "disable_fallback": "guided_decoding_disable_fallback",
        "disable_any_whitespace": "guided_decoding_disable_any_whitespace",
        "disable_additional_properties": "guided_decoding_disable_additional_properties",
        "compile_workers": "guided_decoding_compile_workers",
        "compile_timeout": "guided_decoding_compile_timeout",
        "compile_memory_mib": "guided_decoding_compile_memory",
        "compile_cache_size": "guided_decoding_cache_size",
        "compile_cache_memory_mib": "guided_decoding_cache_memory",
    }


@dataclasses.dataclass
class ParallelConfig(Config):
    tensor_parallel_size: int = setting(1, min=1)
    pipeline_parallel_size: int = setting(1, min=1)
    data_parallel_size: int = setting(1, min=1)
    # "uni" (one process), "mp" (worker processes: tensor-parallel ranks or pipeline
    # stages) or "ray" (the same as Ray actors); unset: mp for several ranks, else uni.
    distributed_executor_backend: str | None = None
    # MoE layers split by expert over the tensor-parallel ranks (not by rows).
    enable_expert_parallel: bool = False
    # Data-parallel replicas over several nodes: how many run on this one (None: all),
    # and where the head node takes the others' registrations.
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = setting(
        None, min=0, min_exclusive=True, max=65535, range_hint="must be a TCP port"
    )
    # Who starts the replicas: "mp" (processes of each node) or "ray" (Ray actors placed
    # by a placement group, on the Ray cluster's nodes).
    data_parallel_backend: str = setting("mp", choices=("mp", "ray"))
    # Which data-parallel replica this engine is (its replica process sets it): e.g. the
    # rank its KV events carry.
    data_parallel_rank: int = 0
    # How many ranks load their weights at once (None: all).
    max_parallel_loading_workers: int | None = setting(None, min=1)

    @property
    def ranks(self) -> int:
        """The processes of one engine: -tp x -pp."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_replicas(self) -> int:
        """The data-parallel replicas this node runs (on the head node, those from 0)."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def multi_node(self) -> bool:
        """Whether some data-parallel replicas run on other nodes."""
        return self.local_replicas < self.data_parallel_size

    def sizes_flag(self) -> str:
        """The -tp/-pp flags above 1, as an error message names them."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        sizes = [f"--tensor-parallel-size {tp}"] if tp > 1 else []
        sizes += [f"--pipeline-parallel-size {pp}"] if pp > 1 else []
        return " with ".join(sizes)

    def check(self) -> None:
        ranks = self.ranks
        backend = self.distributed_executor_backend or ("mp" if ranks > 1 else "uni")
        self.distributed_executor_backend = backend
        if backend == "external_launcher":
            raise ConfigError(
                "--distributed-executor-backend external_launcher is not supported by pagedllm "
                "yet; use mp (worker processes), ray (Ray actors) or uni"
            )
        if "." in backend or ":" in backend:  # (a class path: an Executor subclass)
            from pagedllm.core.interfaces.executor import import_executor_class

            import_executor_class(backend)
        if backend == "uni" and ranks > 1:
            raise ConfigError(
                f"--distributed-executor-backend uni runs one process, which cannot hold the "
                f"{ranks} ranks of {self.sizes_flag()}; use mp"
            )
        loading = self.max_parallel_loading_workers
        if loading is not None:
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
        dp = self.data_parallel_size
        if self.enable_expert_parallel and dp > 1:
            raise ConfigError(
                "--enable-expert-parallel with --data-parallel-size above 1 is not supported: "
                "the data-parallel replicas are separate engines, so the experts cannot be "
                "spread over them; each replica splits its experts over its own "
                "--tensor-parallel-size ranks with --enable-expert-parallel and one replica"
            )
        local = self.data_parallel_size_local
        if local is not None:
            require(1 <= local <= dp, "--data-parallel-size-local", local, f"must be 1 to {dp}")
        port = self.data_parallel_rpc_port
        ray = self.data_parallel_backend == "ray"
        if dp == 1:
            for flag, value in (
                ("--data-parallel-size-local", local),
                ("--data-parallel-address", self.data_parallel_address),
                ("--data-parallel-rpc-port", port),
                ("--data-parallel-backend ray", "ray" if ray else None),
            ):
                if value is not None:
                    raise ConfigError(f"{flag} applies with --data-parallel-size above 1")
        elif ray:
            for flag, value in (
                ("--data-parallel-size-local", local),
                ("--data-parallel-address", self.data_parallel_address),
                ("--data-parallel-rpc-port", port),
            ):
                if value is not None:
                    raise ConfigError(
                        f"{flag}: with --data-parallel-backend ray, Ray places every replica "
                        "on the nodes of its cluster (RAY_ADDRESS); there are no --headless "
                        "nodes to register"
                    )


@dataclasses.dataclass
class CacheConfig(Config):
    # The Device ABC's default_block_size; the engine arguments leave it to the device.
    block_size: int = setting(16, choices=(1, 8, 16, 32, 64, 128))
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = setting("builtin", choices=("builtin", "sha256"))
    gpu_memory_utilization: float = setting(0.9, min=0, min_exclusive=True, max=1)
    # (pagedllm never swaps: the engine arguments refuse any other size than 0 or this)
    swap_space_gib: float = setting(4.0, min=0, range_hint="must be >= 0 GiB")
    num_gpu_blocks_override: int | None = setting(None, min=1)
    kv_cache_dtype: str = setting("auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    calculate_kv_scales: bool = False
    # The KV-cache budget on devices without a memory fraction (the cpu).
    cpu_kvcache_space_gib: float = DEFAULT_CPU_KVCACHE_SPACE_GIB

    arg_names: ClassVar[dict[str, str]] = {"swap_space_gib": "swap_space"}

    def check(self) -> None:
        self.swap_space_gib = float(self.swap_space_gib)
        if self.calculate_kv_scales:
            require(
                self.kv_cache_dtype in ("fp8", "fp8_e4m3"),
                "--calculate-kv-scales",
                True,
                "scales are for an fp8 (e4m3) KV cache: add --kv-cache-dtype fp8 "
                f"(the cache is {self.kv_cache_dtype!r}; fp8_e5m2 is stored without scales)",
            )


@dataclasses.dataclass
class LoRAConfig(Config):
    """--enable-lora and its limits."""

    max_loras: int = setting(1, min=1)
    max_lora_rank: int = setting(16, min=1, range_hint="must be positive")
    max_cpu_loras: int | None = setting(None, min="max_loras")
    lora_dtype: str = setting("auto", choices=("auto", "bfloat16", "float16"))


@dataclasses.dataclass(kw_only=True)
class DeviceConfig(Config):
    # device.name when empty.
    name: str = ""
    device: Device

    def check(self) -> None:
        if not self.name:
            self.name = self.device.name

    @property
    def torch_device(self) -> Any:
        return self.device.torch_device()


# The --speculative-config keys pagedllm reads.
_SPECULATIVE_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
    "max_model_len",
    "quantization",
    "acceptance_method",
}


@dataclasses.dataclass
class SpeculativeConfig(Config):
    """--speculative-config: prompt lookup (``ngram``) or a draft model."""

    # "ngram" or "draft_model"; unset: draft_model when a model is given.
    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    # Sequences this long (with their drafts) are not speculated; None: no limit.
    max_model_len: int | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """The config of a ``--speculative-config`` JSON object (null values mean the
        default, as absent keys do)."""
        unknown = sorted(set(values) - _SPECULATIVE_KEYS - SPEC_KEYS_REFUSED.keys())
        if unknown:
            raise _fail(f"unknown key(s) {unknown} (known: {sorted(_SPECULATIVE_KEYS)})")
        for key, why in SPEC_KEYS_REFUSED.items():
            if values.get(key) is not None and values[key] is not False:
                raise _fail(f"{key}={values[key]!r} is not supported: {why}")
        if values.get("draft_tensor_parallel_size", 1) != 1:
            raise _fail("draft_tensor_parallel_size must be 1")
        method_name = values.get("acceptance_method", "rejection_sampler")
        if method_name != "rejection_sampler":
            raise _fail(f"acceptance_method={method_name!r}: {NO_TYPICAL_ACCEPTANCE}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in fields and v is not None})

    def check(self) -> None:
        method = self.method or ("draft_model" if self.model else None)
        if method == "[ngram]":
            method = "ngram"
        if method not in ("ngram", "draft_model"):
            raise _fail(
                f"method {method!r} is not supported (use 'ngram', or a draft 'model'); "
                "EAGLE and MTP heads are not implemented"
            )
        self.method = method
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise _fail(f"num_speculative_tokens must be a positive integer, not {k!r}")
        if method == "ngram":
            if self.model:
                raise _fail("method 'ngram' takes no model")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                value = getattr(self, key)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise _fail(f"{key} must be an integer, not {value!r}")
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise _fail("prompt_lookup_min must be between 1 and prompt_lookup_max")
        elif not self.model:
            raise _fail("a draft model needs 'model'")
        for key in ("max_model_len", "disable_by_batch_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise _fail(f"{key} must be a positive integer, not {value!r}")


def _fail(message: str) -> ConfigError:
    return ConfigError(f"--speculative-config: {message}")
