"""From a validated config to a ready model: HF config, dtype, context length,
tokenizer, generation defaults, weights and the KV-cache size."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.default_model import DEFAULT_MODEL, embedded_generation_config
from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.rotary import rope_parameters
from pagedllm.core.loading import (
    get_model_loader,
    get_quantization_config,
    loader_for_quantization,
)
from pagedllm.core.model_files import resolve_model_path
from pagedllm.core.pooling import POOLING_TASKS, TASK_ALIASES
from pagedllm.core.sampling.defaults import SamplingDefaults
from pagedllm.distributed.parallel_state import building

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.interfaces import Device, ModelLoader, QuantizationConfig
    from pagedllm.core.plugins import PluginManager

# The model plugin that runs transformers' own implementation of any causal LM.
TRANSFORMERS = "TransformersForCausalLM"
logger = logging.getLogger("pagedllm.model")

_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


@dataclasses.dataclass(slots=True)
class LoadedModel:
    hf_config: Any
    model: torch.nn.Module
    tokenizer: Any
    dtype: torch.dtype
    max_model_len: int
    architecture: str
    eos_token_ids: tuple[int, ...]
    # The generation config's sampling defaults and output cap (max_new_tokens).
    sampling_defaults: SamplingDefaults
    load_seconds: float

    @property
    def text_config(self) -> Any:
        """The language model's part of ``hf_config`` (a multimodal model's
        ``text_config``; the whole config otherwise): its vocabulary and layers."""
        return text_config(self.hf_config)


def text_config(hf_config: Any) -> Any:
    """The language model's config within ``hf_config`` (itself for a text model)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def load_hf_config(config: PagedLLMConfig, loader: ModelLoader | None = None) -> Any:
    """The model's HF config: ``--hf-config-path`` when given, else the config the
    checkpoint carries (``loader.hf_config``: GGUF metadata, Mistral's ``params.json``),
    else ``config.json``."""
    mc = config.model_config
    hf_config = None
    if loader is not None and not mc.hf_config_path:
        hf_config = loader.hf_config(mc)
    if hf_config is None:
        path = resolve_model_path(
            mc.hf_config_path or mc.model,
            revision=mc.revision,
            download_dir=config.load_config.download_dir,
        )
        if mc.config_format not in ("auto", "hf"):
            # (a format of its own is read by the loader made for it, as its hf_config)
            raise ConfigError(
                f"--config-format {mc.config_format}: --load-format "
                f"{config.load_config.load_format} does not read it"
                + (" (nor is it read from --hf-config-path)" if mc.hf_config_path else "")
                + "; use the load format of that checkpoint layout, or --config-format hf"
            )
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=mc.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the model config of {mc.model!r}: {exc}") from exc
        if loader is not None and mc.hf_config_path:
            # The checkpoint may still say how its weights are stored (GGUF types), which
            # a config.json from elsewhere cannot know.
            carried = loader.hf_config(mc)
            storage = getattr(carried, "quantization_config", None)
            if storage and not getattr(hf_config, "quantization_config", None):
                hf_config.quantization_config = storage
    if callable(mc.hf_overrides):
        hf_config = mc.hf_overrides(hf_config) or hf_config
    for key, value in ({} if callable(mc.hf_overrides) else mc.hf_overrides).items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            value = {**current, **value}
        setattr(hf_config, key, value)
    if mc.rope_scaling or mc.rope_theta is not None:
        params = rope_parameters(hf_config)
        scaling = dict(mc.rope_scaling)
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        params.update(scaling)
        if mc.rope_theta is not None:
            params["rope_theta"] = mc.rope_theta
        hf_config.rope_parameters = params
    return hf_config


def resolve_dtype(requested: str, hf_config: Any, device: Device | None = None) -> torch.dtype:
    """``--dtype``; ``auto`` is FP16 for FP32 and FP16 checkpoints, BF16 for BF16 ones,
    unless the device has no fast arithmetic in that type (``Device.auto_dtype``)."""
    if requested != "auto":
        return _DTYPES[requested]
    # (``torch_dtype`` read from the instance dict: the attribute warns in transformers 5.)
    stored = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    dtype = torch.bfloat16 if stored == torch.bfloat16 else torch.float16
    if device is not None:
        chosen = device.auto_dtype(dtype)
        if chosen != dtype:
            logger.info(
                "--dtype auto: %s instead of %s, which this %s has no fast arithmetic for",
                str(chosen).removeprefix("torch."),
                str(dtype).removeprefix("torch."),
                device.name,
            )
        dtype = chosen
    return dtype


def derive_max_model_len(
    hf_config: Any, requested: int | None, disable_sliding_window: bool
) -> int:
    derived = None
    # (a multimodal model's context is its language model's)
    text = text_config(hf_config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    if derived is None:
        if requested is not None:
            return requested
        raise ConfigError(
            f"the model config ({getattr(hf_config, 'model_type', None) or 'no model_type'}) "
            "states no context length; pass --max-model-len"
        )
    params = rope_parameters(hf_config)
    if params.get("rope_type") == "linear":
        derived = int(derived * params.get("factor", 1.0))
    window = getattr(hf_config, "sliding_window", None)
    if disable_sliding_window and window:
        derived = min(derived, window)
    if requested is None:
        return derived
    if requested > derived:
        raise ConfigError(
            f"--max-model-len={requested} is larger than the model's context length "
            f"({derived}{', capped to the sliding window' if disable_sliding_window else ''})"
        )
    return requested


def load_tokenizer(config: PagedLLMConfig, loader: ModelLoader | None = None) -> Any:
    """``--tokenizer`` when given, else the tokenizer the checkpoint carries
    (``loader.load_tokenizer``, e.g. GGUF metadata), else the model directory's."""
    mc = config.model_config
    if mc.skip_tokenizer_init:
        return None
    tokenizer = None
    if loader is not None and mc.tokenizer == mc.model:
        tokenizer = loader.load_tokenizer(
            mc,
            revision=mc.tokenizer_revision,
            use_fast=mc.tokenizer_mode != "slow",
            trust_remote_code=mc.trust_remote_code,
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        path = resolve_model_path(
            mc.tokenizer,
            revision=mc.tokenizer_revision,
            download_dir=config.load_config.download_dir,
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                path,
                revision=mc.tokenizer_revision,
                use_fast=mc.tokenizer_mode != "slow",
                trust_remote_code=mc.trust_remote_code,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the tokenizer from {mc.tokenizer!r}: {exc}") from exc
    if mc.tokenizer_mode == "slow" and getattr(tokenizer, "is_fast", False):
        # transformers gives a fast tokenizer when the model has no slow one (and
        # transformers 5 builds slow ones only for the few classes that still have one).
        raise ConfigError(
            f"--tokenizer-mode slow: this model has no slow (Python) tokenizer (its "
            f"tokenizer is the fast {type(tokenizer).__name__} of {mc.tokenizer!r}); use "
            f"--tokenizer-mode auto"
        )
    return tokenizer


def generation_config(
    config: PagedLLMConfig, loader: ModelLoader | None = None
) -> tuple[SamplingDefaults, dict[str, Any]]:
    """``(sampling defaults, generation-config dict)`` as ``--generation-config`` says:
    with ``auto`` the model's own, layered: the embedded default model's recommended
    settings, then what the checkpoint carries (``loader.generation_config``, e.g. GGUF
    metadata), then the model folder's ``generation_config.json``; with a folder path
    that folder's file; with ``vllm`` none. ``--override-generation-config`` comes last."""
    mc = config.model_config
    raw: dict[str, Any] = {}
    sources: list[str] = []

    def add(layer: dict[str, Any] | None, source: str) -> None:
        if layer:
            raw.update(layer)
            sources.append(source)

    if mc.generation_config == "auto":
        try:
            path = resolve_model_path(
                mc.model, revision=mc.revision, download_dir=config.load_config.download_dir
            )
        except ConfigError:  # a location only its loader reads (a streamed checkpoint)
            path = None
        if path is not None:
            add(embedded_generation_config(path), f"the recommended settings of {DEFAULT_MODEL}")
        if loader is not None:
            add(loader.generation_config(mc), f"the metadata of {mc.model}")
        if path is not None:
            folder = path.parent if path.is_file() else path  # a GGUF file: look beside it
            try:
                add(_read_generation_config(folder), str(folder / "generation_config.json"))
            except ConfigError as exc:  # (as vLLM: a model's unreadable file is skipped)
                logger.warning("%s; sampling without it", exc)
    elif mc.generation_config not in ("vllm", "pagedllm"):
        folder = Path(mc.generation_config).expanduser()
        read = _read_generation_config(folder)
        if read is None:
            raise ConfigError(
                f"--generation-config {mc.generation_config}: no generation_config.json there "
                f"(the choices are auto, vllm or a folder holding one)"
            )
        add(read, str(folder / "generation_config.json"))
    add(mc.override_generation_config, "--override-generation-config")
    defaults = SamplingDefaults.from_generation_config(raw, " + ".join(sources))
    return defaults, raw


def _read_generation_config(folder: Path) -> dict[str, Any] | None:
    """The non-default values of ``folder/generation_config.json``, or ``None``."""
    if not (folder / "generation_config.json").is_file():
        # (Checked first: a model without one needs no transformers import.)
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {folder / 'generation_config.json'}: {exc}") from exc


def _eos_ids(tokenizer: Any, hf_config: Any, generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id")
    if value is None:
        value = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _return_freed_memory() -> None:
    """Hand the heap pages freed while loading (checkpoint copies) back to the OS, so
    resident memory shows what the model keeps."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclasses.dataclass(slots=True)
class BuiltModel:
    """A model built for its config with the checkpoint's weights in its parameters, not
    yet processed (quantization methods' and the model's ``process_weights_after_loading``
    not run): the parameters have the names and layouts the model loads into."""

    hf_config: Any
    model: torch.nn.Module
    tokenizer: Any
    dtype: torch.dtype
    max_model_len: int
    architecture: str
    quant: QuantizationConfig | None
    sampling_defaults: SamplingDefaults
    # The generation config as read (its eos_token_id, ...).
    generation: dict[str, Any]


def choose_implementation(
    architectures: list[str], model_impl: str, registry: Any
) -> tuple[str, str]:
    """``(architecture, registered model to build)`` for ``--model-impl``: the native
    implementation of the first architecture that has one; with ``transformers`` (or
    ``auto`` where none has), transformers' own model on pagedllm's attention
    (``TransformersForCausalLM``)."""
    native = next((a for a in architectures if a in registry and a != TRANSFORMERS), None)
    if model_impl in ("vllm", "pagedllm") or (model_impl == "auto" and native is not None):
        if native is None:
            raise ConfigError(
                f"model architecture {architectures or '(none in config)'} has no native "
                f"implementation; native ones: "
                f"{', '.join(n for n in registry.names() if n != TRANSFORMERS)} "
                "(--model-impl transformers runs others)"
            )
        return native, native
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = [a for a in architectures if isinstance(getattr(transformers, a, None), type)]
    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    causal = [a for a in known if a in causal_lms or a.endswith(("ForCausalLM", "LMHeadModel"))]
    if not causal or TRANSFORMERS not in registry:
        native_names = ", ".join(n for n in registry.names() if n != TRANSFORMERS)
        raise ConfigError(
            f"model architecture {architectures or '(none in config)'} is not supported: "
            f"{'transformers has no such class' if not known else 'not a causal LM'} for "
            f"--model-impl transformers, and the native implementations are {native_names}"
        )
    return causal[0], TRANSFORMERS


def build_model(config: PagedLLMConfig, pm: PluginManager) -> BuiltModel:
    """The model of ``config``, built on its device, with the weights that
    ``--load-format`` reads loaded (see :class:`BuiltModel`)."""
    mc = config.model_config
    loader = get_model_loader(config.load_config, pm)
    hf_config = load_hf_config(config, loader)
    dtype = resolve_dtype(mc.dtype, hf_config, config.device_config.device)
    max_model_len = derive_max_model_len(hf_config, mc.max_model_len, mc.disable_sliding_window)
    sched = config.scheduler_config
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"--max-num-batched-tokens={sched.max_num_batched_tokens} is smaller than "
            f"--max-model-len={max_model_len}: a long prompt could never be scheduled "
            f"without --enable-chunked-prefill"
        )
    registry = pm.registry("models")
    architectures = list(getattr(hf_config, "architectures", None) or [])
    architecture, model_name = choose_implementation(architectures, mc.model_impl, registry)
    quant = get_quantization_config(
        mc.quantization, pm, getattr(hf_config, "quantization_config", None)
    )
    loader = loader_for_quantization(loader, config.load_config, quant, pm)
    loader.download_model(mc)
    # The tokenizer comes before the weights, so that a tokenizer the options refuse
    # (--tokenizer-mode slow without a slow one) or cannot find fails before the long part.
    tokenizer = load_tokenizer(config, loader)
    sampling_defaults, generation = generation_config(config, loader)
    model_cls = registry.load(model_name)
    # (With several ranks the engine checked model_cls.check_tensor_parallel before any
    # rank started: its layers shard themselves as they are built.)
    tp = config.parallel_config.tensor_parallel_size
    stages = config.parallel_config.pipeline_parallel_size
    device = config.device_config.device
    device.prepare_process()
    torch.set_num_threads(device.num_threads())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built where it runs: fused layers share storage with the layers loaded by name
        # (views), which moving the model afterwards would split into copies.
        with torch.device(config.device_config.torch_device), building(tp, stages):
            model = model_cls(
                hf_config,
                quant,
                max_positions=max_model_len,
                disable_sliding_window=mc.disable_sliding_window,
            )
    finally:
        torch.set_default_dtype(previous)
    _check_attention_backend(model, architecture, config, pm)
    loader.load_weights(model, mc)
    return BuiltModel(
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        architecture=architecture,
        quant=quant,
        sampling_defaults=sampling_defaults,
        generation=generation,
    )


def _check_attention_backend(
    model: torch.nn.Module, architecture: str, config: PagedLLMConfig, pm: PluginManager
) -> None:
    """A model whose attention soft-caps its scores, or attends some of its tokens both ways,
    needs a backend that computes it; refused by name before the weights load."""
    from pagedllm.core.args.validate import attention_backend_name
    from pagedllm.core.attention import Attention

    capped = any(
        isinstance(m, Attention) and m.logits_soft_cap is not None for m in model.modules()
    )
    both_ways = bool(getattr(model, "attends_items_bidirectionally", False))
    if not capped and not both_ways:
        return
    backend = pm.load("attention_backends", attention_backend_name(config.device_config.device, pm))
    if both_ways and not backend.bidirectional_spans:
        raise ConfigError(
            f"{architecture} attends within each of a prompt's items (images) both ways, "
            f"which the {backend.name} attention backend does not compute (no bidirectional "
            "spans)"
        )
    if capped and not backend.logits_soft_cap:
        raise ConfigError(
            f"{architecture} soft-caps its attention scores (attn_logit_softcapping), which "
            f"the {backend.name} attention backend does not compute"
        )


def load_model(config: PagedLLMConfig, pm: PluginManager) -> LoadedModel:
    start = time.perf_counter()
    mc = config.model_config
    built = build_model(config, pm)
    model = built.model
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    model = model.to(config.device_config.torch_device).eval()
    model.process_weights_after_loading()
    _return_freed_memory()
    seconds = time.perf_counter() - start
    logger.info(
        "loaded %s (%s, %s%s) in %.2f s: %.0f MiB of weights; context length %d",
        mc.model,
        built.architecture,
        str(built.dtype).removeprefix("torch."),
        f", {built.quant.name} weights" if built.quant is not None else "",
        seconds,
        sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        built.max_model_len,
    )
    if built.sampling_defaults.values or built.sampling_defaults.max_tokens is not None:
        logger.info("%s", built.sampling_defaults.describe())
    return LoadedModel(
        hf_config=built.hf_config,
        model=model,
        tokenizer=built.tokenizer,
        dtype=built.dtype,
        max_model_len=built.max_model_len,
        architecture=built.architecture,
        eos_token_ids=_eos_ids(built.tokenizer, built.hf_config, built.generation),
        sampling_defaults=built.sampling_defaults,
        load_seconds=seconds,
    )


def num_kv_blocks(
    config: PagedLLMConfig,
    bytes_per_block: int,
    max_model_len: int,
    reserved: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """``--num-gpu-blocks-override``, else what the device's KV-cache budget holds once
    ``reserved_bytes`` (what step extensions will hold beside it) and ``reserved`` blocks
    (the model runner's, for padding) are set aside."""
    cache = config.cache_config
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    budget, source = config.device_config.device.kv_cache_memory(cache)
    if reserved_bytes:
        source = f"{source}, less {reserved_bytes / 2**20:.1f} MiB for step extensions"
    blocks = max(0, int(max(0, budget - reserved_bytes) // bytes_per_block) - reserved)
    needed = -(-max_model_len // cache.block_size)
    # More blocks than max_num_seqs full-length requests can hold would only keep extra
    # prefix-cache entries, at the cost of bookkeeping for each block.
    blocks = min(blocks, config.scheduler_config.max_num_seqs * needed)
    if blocks < needed:
        raise ConfigError(
            f"the KV cache ({source}) holds {blocks * cache.block_size} tokens, fewer than "
            f"one request of --max-model-len={max_model_len}; give it more space or lower "
            f"--max-model-len"
        )
    return blocks


def resolve_task(task: str, model: Any, runner: str = "auto", convert: str = "auto") -> str:
    """The task one engine serves for ``--task`` (``auto``: generation where the model
    generates, else its first pooling task), or for vLLM's newer ``--runner`` /
    ``--convert``; a task the model cannot serve is refused."""
    task = TASK_ALIASES.get(task, task)
    generates = getattr(model, "supports_generation", True)
    tasks = tuple(getattr(model, "pooling_tasks", ()))
    if runner != "auto":
        wanted = "generate"
        if runner == "pooling":
            wanted = convert if convert not in ("auto", "none") else (tasks or ("embed",))[0]
            if convert in ("auto", "none") and generates:
                wanted = "embed" if "embed" in tasks else (tasks or ("embed",))[0]
        if task not in ("auto", wanted):
            raise ConfigError(f"--task {task} contradicts --runner {runner}")
        task = wanted
    elif convert not in ("auto", "none"):
        raise ConfigError("--convert goes with --runner pooling")
    if task == "auto":
        return "generate" if generates or not tasks else tasks[0]
    if task == "generate" and not generates:
        raise ConfigError(
            f"--task generate: {type(model).__name__} does not generate text; it serves "
            f"{', '.join(tasks)}"
        )
    if task in POOLING_TASKS and task not in tasks:
        raise ConfigError(
            f"--task {task}: {type(model).__name__} serves "
            f"{', '.join((*(('generate',) if generates else ()), *tasks))}"
        )
    if task != "generate" and task not in POOLING_TASKS:
        raise ConfigError(f"--task {task} is not supported by pagedllm")
    return task
