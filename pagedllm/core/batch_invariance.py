"""``--batch-invariant``: its setting and what the mode cannot serve.

The mode itself lives where the numbers are computed (:mod:`pagedllm.kernels.batch_invariant`,
entered by the model runner for each step). Here: the option, also set by
``PAGEDLLM_BATCH_INVARIANT`` or vLLM's ``VLLM_BATCH_INVARIANT``, and the configurations
it refuses at start-up, each with the reason, rather than promising what it cannot keep.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.core.args.spec import is_default
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.interfaces import AttentionBackend

__all__ = [
    "ENV_BATCH_INVARIANT",
    "batch_invariant_setting",
    "check_batch_invariance",
    "check_batch_invariant_options",
]

# vLLM's variable is read too, as for the other settings pagedllm shares with it.
ENV_BATCH_INVARIANT = ("PAGEDLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def batch_invariant_setting(args: Any, env: Mapping[str, str] | None = None) -> bool:
    """On with ``--batch-invariant``, else as the first of :data:`ENV_BATCH_INVARIANT`
    that is set says (``1`` on, ``0`` off)."""
    if not is_default(args, "batch_invariant"):
        return bool(args.batch_invariant)
    env = os.environ if env is None else env
    for name in ENV_BATCH_INVARIANT:
        raw = env.get(name)
        if raw is None:
            continue
        value = raw.strip().lower()
        if value not in _ON + _OFF:
            raise ConfigError(f"{name}={raw!r} is invalid: use 1 (batch-invariant) or 0")
        return value in _ON
    return False


def check_batch_invariant_options(config: PagedLLMConfig) -> None:
    """Raise ``ConfigError`` when ``--batch-invariant`` is on beside options it cannot
    serve (checked with the configuration, before any process starts)."""
    problem = _options_problem(config) if config.model_config.batch_invariant else None
    if problem is not None:
        raise ConfigError(f"--batch-invariant: {problem}")


def check_batch_invariance(
    config: PagedLLMConfig,
    backend: AttentionBackend,
    model: torch.nn.Module | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ConfigError`` naming why ``--batch-invariant`` cannot hold on this machine
    and device (before the model loads: without ``model``), or for this model: its
    architecture, its layers' quantization, and the attention of its layers over a
    ``kv_cache_dtype`` cache. Nothing when the mode is off."""
    if not config.model_config.batch_invariant:
        return
    from pagedllm.kernels.batch_invariant import unavailable_reason

    problem = unavailable_reason()
    if problem is None and model is not None:
        problem = _model_problem(model)
    if problem is None:
        from pagedllm.core.attention.layer import Attention

        layers = [] if model is None else [m for m in model.modules() if isinstance(m, Attention)]
        problem = backend.batch_invariant_refusal(layers, kv_cache_dtype)
    if problem is not None:
        raise ConfigError(f"--batch-invariant: {problem}")


def _options_problem(config: PagedLLMConfig) -> str | None:
    parallel = config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        # (an all-reduce over more than two ranks sums each value in an order that depends
        # on the tensor's size, the batch's)
        return "one rank only: leave out --tensor-parallel-size and --pipeline-parallel-size"
    if config.lora_config is not None:
        return "LoRA adapters are not computed batch-invariantly: leave out --enable-lora"
    if config.speculative_config is not None:
        return "speculative decoding is not supported in this mode: leave out --speculative-config"
    level = config.compilation_config.level
    if level:
        return (
            f"torch.compile (compilation level {level}) generates its own kernels, which "
            "this mode does not control: use level 0"
        )
    return None


def _model_problem(model: torch.nn.Module) -> str | None:
    from pagedllm.core.layers.embedding import VocabEmbedding
    from pagedllm.core.layers.linear import Linear

    cls = type(model)
    if not getattr(cls, "supports_batch_invariance", False):
        return (
            f"{cls.__name__} does not support it (the Llama family does: Llama, Mistral, "
            "Qwen2, Qwen3, SmolLM2)"
        )
    for name, module in model.named_modules():
        method = getattr(module, "method", None)
        if isinstance(module, Linear | VocabEmbedding) and method is not None:
            if not getattr(method, "batch_invariant", False):
                return (
                    f"layer {name!r} is quantized with {type(method).__name__}, whose "
                    "products are not batch-invariant (unquantized and GGUF weights are)"
                )
    return None
