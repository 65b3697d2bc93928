"""Engine options for how the model runs: decoding, parallelism, KV cache, adapters,
device and speculative decoding (most of them vLLM features pagedllm refuses)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.core.args.parsers import json_or_key_values
from pagedllm.core.args.refusals import NO_OP, UNSUPPORTED
from pagedllm.core.args.spec import arg
from pagedllm.core.configs.multimodal import DEFAULT_IMAGES_PER_PROMPT, MultiModalConfig
from pagedllm.core.configs.runtime import CacheConfig, DecodingConfig, LoRAConfig, ParallelConfig


@dataclasses.dataclass
class RuntimeArgs:
    """Where and with what the model runs, and which request features it offers."""

    # --------------------------------------------------------------- DecodingConfig
    guided_decoding_backend: str = arg(
        DecodingConfig.guided_decoding_backend,
        group="DecodingConfig",
        registry="guided_backends",
        extra_choices=("auto",),
        help="Default backend for guided decoding (JSON schema, regex, ...). 'auto' chooses "
        "one per request based on what each backend supports.",
    )
    guided_decoding_disable_fallback: bool = arg(
        DecodingConfig.disable_fallback,
        group="DecodingConfig",
        help="Fail instead of falling back to another guided-decoding backend on error.",
    )
    guided_decoding_disable_any_whitespace: bool = arg(
        DecodingConfig.disable_any_whitespace,
        group="DecodingConfig",
        help="Forbid whitespace the grammar does not require during guided decoding.",
    )
    guided_decoding_disable_additional_properties: bool = arg(
        DecodingConfig.disable_additional_properties,
        group="DecodingConfig",
        help="Do not allow additionalProperties in JSON schemas during guided decoding.",
    )
    guided_decoding_compile_timeout: float = arg(
        of=DecodingConfig.option("compile_timeout"),
        group="DecodingConfig",
        help="Seconds one guided-decoding constraint may take to compile; a longer compile is "
        "stopped and its request refused (or, with fallback, tried on the next backend).",
    )
    guided_decoding_compile_memory: int = arg(
        of=DecodingConfig.option("compile_memory_mib"),
        group="DecodingConfig",
        help="MiB of memory one guided-decoding compile may use beyond its worker's own; a "
        "compile that needs more is stopped like one past the time limit.",
    )
    guided_decoding_compile_workers: int = arg(
        of=DecodingConfig.option("compile_workers"),
        group="DecodingConfig",
        help="Worker processes compiling guided-decoding constraints at once. 0 compiles in "
        "threads of the engine's process, without the time limit and memory budget.",
    )
    guided_decoding_cache_size: int = arg(
        of=DecodingConfig.option("compile_cache_size"),
        group="DecodingConfig",
        help="Compiled guided-decoding constraints kept for reuse; the least recently used "
        "are dropped first.",
    )
    guided_decoding_cache_memory: float = arg(
        of=DecodingConfig.option("compile_cache_memory_mib"),
        group="DecodingConfig",
        help="MiB of memory the compiled guided-decoding constraints kept for reuse may hold "
        "(each as its backend measures or estimates it); the least recently used are "
        "dropped first, and one larger than this is used but not kept.",
    )
    reasoning_parser: str | None = arg(
        None,
        group="DecodingConfig",
        registry="reasoning_parsers",
        help="Parser that splits the model's reasoning from its answer in API responses; "
        "setting it enables reasoning output.",
    )

    # --------------------------------------------------------------- ParallelConfig
    tensor_parallel_size: int = arg(
        of=ParallelConfig.option("tensor_parallel_size"),
        group="ParallelConfig",
        aliases=("-tp",),
        help="Number of tensor-parallel ranks: the model's layers split across this many "
        "processes (devices), which exchange partial results with torch.distributed.",
    )
    pipeline_parallel_size: int = arg(
        of=ParallelConfig.option("pipeline_parallel_size"),
        group="ParallelConfig",
        aliases=("-pp",),
        help="Number of pipeline stages: the model's layers split across this many "
        "processes (devices), each step's requests in micro-batches that overlap on the "
        "stages.",
    )
    data_parallel_size: int = arg(
        of=ParallelConfig.option("data_parallel_size"),
        group="ParallelConfig",
        aliases=("-dp",),
        help="Number of data-parallel replicas of the engine (pagedllm serve): each an "
        "engine process with its own copy of the model and KV cache (and -tp ranks), "
        "requests going to the least loaded one.",
    )
    data_parallel_size_local: int | None = arg(
        None,
        group="ParallelConfig",
        aliases=("-dpl",),
        help="Number of the --data-parallel-size replicas that run on this node (all of "
        "them by default; on a --headless node, the rest from --data-parallel-start-rank). "
        "Fewer than all on the head node: the others register from --headless nodes.",
    )
    data_parallel_address: str | None = arg(
        None,
        group="ParallelConfig",
        aliases=("-dpa",),
        help="Address of the data-parallel head node: where --headless nodes register "
        "their replicas (and where the head listens for them; all interfaces if unset).",
    )
    data_parallel_rpc_port: int | None = arg(
        of=ParallelConfig.option("data_parallel_rpc_port"),
        group="ParallelConfig",
        aliases=("-dpp",),
        help="Port of the head node where --headless nodes register their replicas "
        "(default 29550).",
    )
    data_parallel_backend: str = arg(
        of=ParallelConfig.option("data_parallel_backend"),
        group="ParallelConfig",
        aliases=("-dpb",),
        help="Who starts the data-parallel replicas: 'mp', processes of this node (and of "
        "--headless nodes); 'ray', Ray actors placed by a placement group on the Ray "
        "cluster at RAY_ADDRESS (or a Ray instance started on this machine), each with "
        "its share of the CPUs.",
    )
    distributed_executor_backend: str | None = arg(
        None,
        group="ParallelConfig",
        registry="executors",
        extra_choices=("external_launcher",),
        validate_after_parse=True,
        class_path=True,
        help="How distributed model workers are run: 'mp' (worker processes, the default "
        "with -tp above 1), 'ray' (Ray actors, on the cluster at RAY_ADDRESS or a local Ray "
        "instance; pip install 'pagedllm[ray]') or 'uni' (this process alone, the default "
        "otherwise), an installed plugin's executor, or the class path of an Executor "
        "subclass (package.module.Class); 'external_launcher' is not supported yet.",
    )
    enable_expert_parallel: bool = arg(
        ParallelConfig.enable_expert_parallel,
        group="ParallelConfig",
        help="Split the experts of MoE layers over the tensor-parallel ranks, each rank "
        "holding whole experts, instead of splitting every expert's rows (the number of "
        "experts must divide by --tensor-parallel-size).",
    )
    enable_multimodal_encoder_data_parallel: bool = arg(
        False,
        group="ParallelConfig",
        help="Run the vision encoder data-parallel instead of tensor-parallel.",
        unbuilt=UNSUPPORTED["enable_multimodal_encoder_data_parallel"],
    )
    max_parallel_loading_workers: int | None = arg(
        of=ParallelConfig.option("max_parallel_loading_workers"),
        group="ParallelConfig",
        help="Load the model's weights in at most this many ranks (processes) at once, to "
        "limit the RAM used while loading with --tensor-parallel-size or "
        "--pipeline-parallel-size (mp backend).",
    )
    ray_workers_use_nsight: bool = arg(
        False,
        group="ParallelConfig",
        help="Profile Ray workers with Nsight.",
        unbuilt=UNSUPPORTED["ray_workers_use_nsight"],
    )
    disable_custom_all_reduce: bool = arg(
        False,
        group="ParallelConfig",
        help="Use NCCL instead of the custom all-reduce kernel.",
        no_op=NO_OP["disable_custom_all_reduce"],
    )
    worker_cls: str = arg(
        "auto",
        group="ParallelConfig",
        help="Full name of the worker class; 'auto' picks one for the platform.",
        unbuilt=UNSUPPORTED["worker_cls"],
    )
    worker_extension_cls: str = arg(
        "",
        group="ParallelConfig",
        help="Full name of a class mixed into the worker to add methods for collective_rpc.",
        unbuilt=UNSUPPORTED["worker_extension_cls"],
    )

    # ------------------------------------------------------------------ CacheConfig
    block_size: int | None = arg(
        None,
        of=CacheConfig.option("block_size"),
        group="CacheConfig",
        help="Number of tokens per KV-cache block. If unset, the device picks a size.",
    )
    enable_prefix_caching: bool | None = arg(
        None,
        group="CacheConfig",
        help="Reuse the KV cache of prompt prefixes shared between requests. If unset, "
        "pagedllm decides.",
    )
    prefix_caching_hash_algo: str = arg(
        of=CacheConfig.option("prefix_caching_hash_algo"),
        group="CacheConfig",
        help="Hash used to identify cached prefix blocks: Python's 'builtin' hash, or "
        "'sha256', collision resistant but slower.",
    )
    gpu_memory_utilization: float = arg(
        of=CacheConfig.option("gpu_memory_utilization"),
        group="CacheConfig",
        help="Fraction (0 to 1) of the accelerator's memory this engine instance may use for "
        "weights, activations and KV cache.",
    )
    num_gpu_blocks_override: int | None = arg(
        of=CacheConfig.option("num_gpu_blocks_override"),
        group="CacheConfig",
        help="Use exactly this many KV-cache blocks instead of the profiled number (useful "
        "for testing preemption).",
    )
    swap_space: float = arg(
        of=CacheConfig.option("swap_space_gib"),
        group="CacheConfig",
        supported=(0,),
        unsupported="{option}={value}: pagedllm never swaps: it preempts by recomputation and "
        "needs no swap space; use 0 or leave it out",
        help="CPU swap space per device, in GiB, for preempted requests. pagedllm preempts by "
        "recomputation and never swaps, so it needs none: 0 and the default are accepted, "
        "other values refused.",
    )
    kv_cache_dtype: str = arg(
        of=CacheConfig.option("kv_cache_dtype"),
        group="CacheConfig",
        help="Data type of the KV cache. 'auto' uses the model's data type; 'fp8' (= "
        "'fp8_e4m3') stores keys and values as float8_e4m3fn divided by a per-layer scale "
        "(the checkpoint's k_scale/v_scale, else 1.0, or computed with "
        "--calculate-kv-scales), 'fp8_e5m2' as float8_e5m2 without "
        "scales: half the memory of a bfloat16 cache, so twice the blocks. Attention "
        "reads it back in the model's dtype.",
    )
    calculate_kv_scales: bool = arg(
        CacheConfig.calculate_kv_scales,
        group="CacheConfig",
        help="With --kv-cache-dtype fp8: compute each layer's key and value scales from the "
        "first batch it sees (the largest magnitude over 200 for keys, over 100 for values, "
        "as vLLM does) instead of the checkpoint's scales or 1.0.",
    )
    cpu_offload_gb: float = arg(
        0.0,
        group="CacheConfig",
        help="GiB of model weights per device to keep in CPU memory and stream in on each "
        "forward pass.",
        unbuilt=UNSUPPORTED["cpu_offload_gb"],
    )

    # ------------------------------------------------------------- MultiModalConfig
    limit_mm_per_prompt: dict[str, Any] = arg(
        {},
        group="MultiModalConfig",
        parse=json_or_key_values,
        help='Largest number of images per prompt, e.g. {"image": 16} (or the older form '
        "image=16); a request with more is refused. pagedllm takes images only: a video or "
        f"audio limit is accepted only as 0. If unset, {DEFAULT_IMAGES_PER_PROMPT}.",
    )
    mm_processor_kwargs: dict[str, Any] | None = arg(
        MultiModalConfig.mm_processor_kwargs,
        group="MultiModalConfig",
        help="JSON object of options for the model's multi-modal processor: pagedllm passes "
        'them to its image processor\'s call for every image, e.g. {"do_normalize": false}; '
        "a processor that takes none refuses them.",
    )
    disable_mm_preprocessor_cache: bool = arg(
        MultiModalConfig.disable_mm_preprocessor_cache,
        group="MultiModalConfig",
        help="Do not let one request reuse another's encoded images (the encoder-output "
        "cache, by image hash, then serves only the chunks of the request that made them).",
    )

    # ------------------------------------------------------------------- LoRAConfig
    enable_lora: bool | None = arg(
        None,
        group="LoRAConfig",
        help="Serve LoRA adapters (peft's format): offline with LoRARequest, on the "
        "server with --lora-modules or the runtime load/unload endpoints.",
    )
    enable_lora_bias: bool = arg(
        False,
        group="LoRAConfig",
        help="Allow bias terms in LoRA adapters.",
        unbuilt=UNSUPPORTED["enable_lora_bias"],
    )
    max_loras: int = arg(
        of=LoRAConfig.option("max_loras"),
        group="LoRAConfig",
        help="Largest number of LoRA adapters in one batch.",
    )
    max_lora_rank: int = arg(
        of=LoRAConfig.option("max_lora_rank"),
        group="LoRAConfig",
        help="Largest LoRA rank.",
    )
    lora_extra_vocab_size: int = arg(
        256,
        group="LoRAConfig",
        help="Largest number of tokens a LoRA adapter may add to the vocabulary.",
        unbuilt=UNSUPPORTED["lora_extra_vocab_size"],
    )
    lora_dtype: str = arg(
        of=LoRAConfig.option("lora_dtype"),
        group="LoRAConfig",
        help="Data type of LoRA weights; 'auto' uses the model's.",
    )
    long_lora_scaling_factors: list[float] | None = arg(
        None,
        group="LoRAConfig",
        help="RoPE scaling factors of LoRA adapters trained with a scaling different from the "
        "model's.",
        unbuilt=UNSUPPORTED["long_lora_scaling_factors"],
    )
    max_cpu_loras: int | None = arg(
        of=LoRAConfig.option("max_cpu_loras"),
        group="LoRAConfig",
        help="Largest number of LoRA adapters kept in CPU memory (at least --max-loras).",
    )
    fully_sharded_loras: bool = arg(
        False,
        group="LoRAConfig",
        help="Shard all of the LoRA computation across tensor-parallel ranks, not half.",
        unbuilt=UNSUPPORTED["fully_sharded_loras"],
    )

    # ---------------------------------------------------------- PromptAdapterConfig
    enable_prompt_adapter: bool | None = arg(
        None,
        group="PromptAdapterConfig",
        help="Serve prompt adapters.",
        unbuilt=UNSUPPORTED["enable_prompt_adapter"],
    )
    max_prompt_adapters: int = arg(
        1,
        group="PromptAdapterConfig",
        help="Largest number of prompt adapters in one batch.",
        unbuilt=UNSUPPORTED["max_prompt_adapters"],
    )
    max_prompt_adapter_token: int = arg(
        0,
        group="PromptAdapterConfig",
        help="Largest number of prompt-adapter tokens.",
        unbuilt=UNSUPPORTED["max_prompt_adapter_token"],
    )

    # ----------------------------------------------------------------- DeviceConfig
    device: str = arg(
        "auto",
        group="DeviceConfig",
        registry="devices",
        extra_choices=("auto",),
        help="Device to run on; 'auto' picks the best available. Installed device plugins "
        "add names.",
    )

    # ------------------------------------------------------------ SpeculativeConfig
    speculative_config: dict[str, Any] | None = arg(
        None,
        group="SpeculativeConfig",
        help='Speculative decoding as a JSON object: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} '
        '(prompt lookup), or {"model": DRAFT, "num_speculative_tokens": 3} (a draft '
        'model sharing the tokenizer); "disable_by_batch_size": N stops speculating '
        "while N or more requests run.",
    )
