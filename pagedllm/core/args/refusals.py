"""Every engine flag pagedllm accepts but does not honour, with the reason, in one place.

- :data:`UNSUPPORTED`: vLLM flags whose feature pagedllm does not have. Each stays in its
  config group (so ``--help=GROUP`` lists it) and is declared there with
  ``unbuilt=UNSUPPORTED[name]``: accepted by the parser, refused at start-up when set.
- :data:`NO_OP`: vLLM switches that turn off something pagedllm never does, declared with
  ``no_op=NO_OP[name]``: accepted, and logged when set, since "off" is what pagedllm does.
- :data:`SPEC_KEYS_REFUSED`: ``--speculative-config`` keys of vLLM's whose feature
  pagedllm does not have; the old flags that set them are refused with the same reason.
- :class:`DeprecatedArgs`: flags from older vLLM versions, the "Deprecated" group. A
  ``removed`` flag is refused with what replaced it; a ``deprecated`` one warns (and an
  ``alias_of`` one is copied onto the flag that replaced it).

Values a flag can take but pagedllm cannot honour (``--swap-space 8``) are declared with
the flag itself (``supported=``/``unsupported=``).
"""

from __future__ import annotations

import dataclasses

from pagedllm.core.args.spec import arg
from pagedllm.core.configs.runtime import NO_TYPICAL_ACCEPTANCE, SPEC_KEYS_REFUSED

_LEAVE_OUT = "; leave this flag out"
_ONE_WORKER = "pagedllm has a single built-in worker" + _LEAVE_OUT
_NO_PROMPT_ADAPTERS = "pagedllm does not support prompt adapters" + _LEAVE_OUT

# Flag (field name) -> why pagedllm refuses it when it is set to anything but its default.
UNSUPPORTED: dict[str, str] = {
    # ModelConfig
    "code_revision": "pagedllm does not run remote model code from the Hub" + _LEAVE_OUT,
    "hf_token": "pagedllm never downloads from the Hub; pass a local model path instead",
    "override_neuron_config": "pagedllm has no Neuron-specific configuration" + _LEAVE_OUT,
    "enable_prompt_embeds": "pagedllm accepts only text or token-id prompts" + _LEAVE_OUT,
    # LoadConfig
    "pt_load_map_location": "pagedllm loads PyTorch checkpoints on the CPU only" + _LEAVE_OUT,
    # ParallelConfig
    "enable_multimodal_encoder_data_parallel": "pagedllm runs a vision encoder the way it "
    "runs the rest of the model; encoder data parallelism is not supported" + _LEAVE_OUT,
    "ray_workers_use_nsight": "pagedllm does not profile its Ray workers with Nsight" + _LEAVE_OUT,
    "worker_cls": _ONE_WORKER,
    "worker_extension_cls": _ONE_WORKER,
    # CacheConfig
    "cpu_offload_gb": "pagedllm does not offload weights to the CPU; use a smaller or "
    "quantized model",
    # LoRAConfig
    "enable_lora_bias": "LoRA adapters with biases are not supported",
    "lora_extra_vocab_size": "LoRA adapters that add tokens are not supported",
    "long_lora_scaling_factors": "LongLoRA adapters (their own RoPE scaling) are not supported",
    "fully_sharded_loras": "with --tensor-parallel-size pagedllm splits each adapter as "
    "vLLM does by default (B by a layer's output rows, A by a row-parallel layer's input "
    "columns); fully sharded adapters are not supported" + _LEAVE_OUT,
    # PromptAdapterConfig
    "enable_prompt_adapter": _NO_PROMPT_ADAPTERS,
    "max_prompt_adapters": _NO_PROMPT_ADAPTERS,
    "max_prompt_adapter_token": _NO_PROMPT_ADAPTERS,
    # ObservabilityConfig
    "show_hidden_metrics_for_version": "pagedllm has not hidden any metrics, so there are "
    "none to bring back" + _LEAVE_OUT,
    # SchedulerConfig
    "num_scheduler_steps": "pagedllm schedules every step" + _LEAVE_OUT,
    "multi_step_stream_outputs": "pagedllm has no multi-step scheduling" + _LEAVE_OUT,
    "num_lookahead_slots": "the scheduler reserves the slots of draft tokens itself "
    "(--speculative-config)" + _LEAVE_OUT,
    # PagedLLMConfig
    "additional_config": "pagedllm has no platform-specific settings" + _LEAVE_OUT,
}

# Flag (field name) -> why setting it changes nothing (what it turns off, pagedllm never does).
NO_OP: dict[str, str] = {
    "disable_custom_all_reduce": "pagedllm has no custom all-reduce kernel: its tensor-parallel "
    "ranks always all-reduce with torch.distributed (NCCL on NVIDIA GPUs)",
    "disable_async_output_proc": "pagedllm always processes a step's outputs before the next "
    "step starts",
    "disable_cascade_attn": "pagedllm never uses cascade attention",
    "disable_hybrid_kv_cache_manager": "pagedllm gives every attention layer the same KV-cache "
    "size already (sliding-window layers included)",
}


_GROUP = "Deprecated"
_SPEC_CONFIG = "use --speculative-config '{{\"{key}\": ...}}'"
_IMAGE_FLAGS_REMOVED = (
    "vLLM replaced the image flags by each model's own multi-modal processor; "
    "--mm-processor-kwargs overrides its settings"
)
_TOKENIZER_POOL_REMOVED = (
    "the asynchronous tokenizer pool was removed; tokenization always runs in the frontend"
)


@dataclasses.dataclass
class DeprecatedArgs:
    """The "Deprecated" group: flags from older vLLM versions (mixed into EngineArgs last)."""

    use_v2_block_manager: bool = arg(
        True,
        group=_GROUP,
        help="Only one block manager exists.",
        deprecated="block manager v1 was removed; this flag has no effect.",
    )
    enable_reasoning: bool | None = arg(
        None,
        group=_GROUP,
        help="Used to turn on reasoning output, with --reasoning-parser.",
        deprecated="reasoning output is on whenever --reasoning-parser is set; this flag "
        "changes nothing",
    )
    max_context_len_to_capture: int | None = arg(
        None,
        group=_GROUP,
        help="Longest context covered by CUDA graphs.",
        deprecated="use --max-seq-len-to-capture instead.",
        alias_of="max_seq_len_to_capture",
    )
    worker_use_ray: bool = arg(
        False,
        group=_GROUP,
        bool_style="store_true",
        help="Used to run the model workers with Ray.",
        removed="use --distributed-executor-backend ray",
    )
    engine_use_ray: bool = arg(
        False,
        group=_GROUP,
        bool_style="store_true",
        help="Used to run the engine in a separate Ray process.",
        removed="pagedllm runs the engine on a thread of the API server's process (each "
        "--data-parallel-size replica in a process of its own), never as a Ray actor; "
        "--distributed-executor-backend ray runs the model's workers on Ray",
    )
    max_paddings: int | None = arg(
        None,
        group=_GROUP,
        help="Used to cap the padding tokens in a batch.",
        removed="batches are no longer padded; --max-num-batched-tokens bounds a step",
    )
    tokenizer_pool_size: int = arg(
        0,
        group=_GROUP,
        help="Used to set the size of the asynchronous tokenizer pool.",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    tokenizer_pool_type: str = arg(
        "ray",
        group=_GROUP,
        help="Used to set the type of the asynchronous tokenizer pool.",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    tokenizer_pool_extra_config: str | None = arg(
        None,
        group=_GROUP,
        help="Used to configure the asynchronous tokenizer pool (JSON).",
        removed=_TOKENIZER_POOL_REMOVED,
    )
    quantization_param_path: str | None = arg(
        None,
        group=_GROUP,
        help="Used to name a JSON file of fp8 KV-cache scaling factors.",
        removed="KV-cache scales are read from the checkpoint or computed with "
        "--calculate-kv-scales",
    )
    image_input_type: str | None = arg(
        None,
        group=_GROUP,
        help="Used to set the kind of image input (pixel_values or image_features).",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_token_id: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set the token id of the image placeholder.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_input_shape: str | None = arg(
        None,
        group=_GROUP,
        help="Used to set the largest image input shape, for memory profiling.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_feature_size: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set the image feature size along the context dimension.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_processor: str | None = arg(
        None,
        group=_GROUP,
        help="Used to name the Hugging Face image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    image_processor_revision: str | None = arg(
        None,
        group=_GROUP,
        help="Used to set the revision of the Hugging Face image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    disable_image_processor: bool = arg(
        False,
        group=_GROUP,
        bool_style="store_true",
        help="Used to skip the model's image processor.",
        removed=_IMAGE_FLAGS_REMOVED,
    )
    mm_cache_preprocessor: bool = arg(
        False,
        group=_GROUP,
        bool_style="store_true",
        help="Used to cache the multi-modal preprocessor output.",
        removed="vLLM replaced it by --disable-mm-preprocessor-cache (the cache is on "
        "unless that flag is set)",
    )
    speculative_model: str | None = arg(
        None,
        group=_GROUP,
        help="Used to name the draft model for speculative decoding.",
        removed=_SPEC_CONFIG.format(key="model"),
    )
    speculative_model_quantization: str | None = arg(
        None,
        group=_GROUP,
        help="Used to set the draft model's quantization method.",
        removed=SPEC_KEYS_REFUSED["quantization"],
    )
    num_speculative_tokens: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set how many tokens the draft model proposes per step.",
        removed=_SPEC_CONFIG.format(key="num_speculative_tokens"),
    )
    speculative_draft_tensor_parallel_size: int | None = arg(
        None,
        group=_GROUP,
        aliases=("-spec-draft-tp",),
        help="Used to set the draft model's tensor-parallel size.",
        removed=_SPEC_CONFIG.format(key="draft_tensor_parallel_size"),
    )
    speculative_max_model_len: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set the longest sequence the draft model handles.",
        removed=_SPEC_CONFIG.format(key="max_model_len"),
    )
    speculative_disable_by_batch_size: int | None = arg(
        None,
        group=_GROUP,
        help="Used to stop speculating when more than this many requests were queued.",
        removed=_SPEC_CONFIG.format(key="disable_by_batch_size"),
    )
    speculative_disable_mqa_scorer: bool = arg(
        False,
        group=_GROUP,
        bool_style="store_true",
        help="Used to score draft tokens by batch expansion instead of the MQA scorer.",
        removed=SPEC_KEYS_REFUSED["disable_mqa_scorer"],
    )
    ngram_prompt_lookup_max: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set the largest n-gram window for prompt-lookup speculation.",
        removed=_SPEC_CONFIG.format(key="prompt_lookup_max"),
    )
    ngram_prompt_lookup_min: int | None = arg(
        None,
        group=_GROUP,
        help="Used to set the smallest n-gram window for prompt-lookup speculation.",
        removed=_SPEC_CONFIG.format(key="prompt_lookup_min"),
    )
    spec_decoding_acceptance_method: str = arg(
        "rejection_sampler",
        group=_GROUP,
        help="Used to choose rejection_sampler or typical_acceptance_sampler for draft tokens.",
        removed=NO_TYPICAL_ACCEPTANCE,
    )
    typical_acceptance_sampler_posterior_threshold: float | None = arg(
        None,
        group=_GROUP,
        help="Used to set the lowest posterior probability to accept a draft token.",
        removed=SPEC_KEYS_REFUSED["posterior_threshold"],
    )
    typical_acceptance_sampler_posterior_alpha: float | None = arg(
        None,
        group=_GROUP,
        help="Used to scale the entropy-based acceptance threshold.",
        removed=SPEC_KEYS_REFUSED["posterior_alpha"],
    )
    disable_logprobs_during_spec_decoding: bool | None = arg(
        None,
        group=_GROUP,
        help="Used to skip log probabilities during speculative decoding.",
        removed=SPEC_KEYS_REFUSED["disable_logprobs"],
    )
