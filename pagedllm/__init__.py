"""pagedllm: LLM inference and serving with a paged KV cache, where every variable part
(devices, load formats, quantization, model architectures, parsers, guided decoding) is
a plugin."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# GNU OpenMP (torch's and our kernels') lets a thread that has finished its share spin
# ~300k iterations before sleeping. When the cores are shared with other processes the
# spinning thread holds the core its partner waits for: a decode step took 4-16x as long.
# 10k spins keep a quiet machine's speed. libgomp reads this once, when torch loads it, so
# it is set before torch is imported; a user's GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "torch" not in sys.modules and not (
    "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
):
    os.environ["GOMP_SPINCOUNT"] = "10000"

from pagedllm.core.hookspecs import hookimpl

__version__ = "0.1.0"

# Heavy names are imported on first use so that ``pagedllm --help`` stays fast.
_LAZY = {
    "CompletionOutput": "pagedllm.core.outputs",
    "EngineArgs": "pagedllm.core.engine_args",
    "GuidedDecodingParams": "pagedllm.core.sampling",
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.core.engine",
    "RequestOutput": "pagedllm.core.outputs",
    "SamplingParams": "pagedllm.core.sampling",
    "TextPrompt": "pagedllm.inputs",
    "TokensPrompt": "pagedllm.inputs",
    "make_plugin_manager": "pagedllm.core.plugins",
    "LoRARequest": "pagedllm.lora.request",
    "BeamSearchParams": "pagedllm.core.beam_search",
    "BeamSearchOutput": "pagedllm.core.beam_search",
    "BeamSearchSequence": "pagedllm.core.beam_search",
    "PoolingParams": "pagedllm.core.pooling",
    "PoolingRequestOutput": "pagedllm.core.pooling",
    "EmbeddingRequestOutput": "pagedllm.core.pooling",
    "ClassificationRequestOutput": "pagedllm.core.pooling",
    "ScoringRequestOutput": "pagedllm.core.pooling",
}

if TYPE_CHECKING:
    from pagedllm.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pagedllm.core.engine import LLMEngine
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.outputs import CompletionOutput, RequestOutput
    from pagedllm.core.plugins import make_plugin_manager
    from pagedllm.core.pooling import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingParams,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )
    from pagedllm.core.sampling import GuidedDecodingParams, SamplingParams
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.inputs import TextPrompt, TokensPrompt
    from pagedllm.lora.request import LoRARequest


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "GuidedDecodingParams",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
    "hookimpl",
    "make_plugin_manager",
]
