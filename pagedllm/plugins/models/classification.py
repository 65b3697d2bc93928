"""Sequence classification and reward heads on the native decoders
(``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``, ...): the
decoder of the causal LM of the same family, with transformers' ``score`` layer
(``num_labels`` outputs, no bias) in place of the vocabulary head.

transformers scores the last token of a prompt; so does the default pooler here
(``LAST``), with a softmax for ``classify`` (a sigmoid for a single label under
``score``). ``reward`` returns every token's scores (``ALL``, no activation), as vLLM's
reward models do.

With tensor parallelism the decoder is split as the causal LM's; every rank holds the
whole ``score`` layer (small), which rank 0 applies to the gathered hidden states."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.layers.linear import Linear
from pagedllm.core.pooling import PoolerConfig
from pagedllm.plugins.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


class SequenceClassifierMixin:
    """Turns a causal LM class into its sequence classifier (mixed in first)."""

    supports_generation = False
    pooling_tasks = ("classify", "score", "reward")

    def __init__(self, config: Any, quant_config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, quant_config, **kwargs)
        del self.lm_head
        self.tie_word_embeddings = False
        self.score = Linear(config.hidden_size, config.num_labels, False, quant_config, "score")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} classifies; it does not generate")

    def default_pooler_config(self, task: str) -> PoolerConfig:
        if task == "reward":
            return PoolerConfig(pooling_type="ALL", normalize=False, softmax=False)
        return PoolerConfig(pooling_type="LAST", normalize=False, softmax=True)

    def pooling_head(self, rows: torch.Tensor, task: str) -> torch.Tensor:
        return self.score(rows)


class LlamaForSequenceClassification(SequenceClassifierMixin, LlamaForCausalLM):
    supports_tensor_parallel = True


class MistralForSequenceClassification(SequenceClassifierMixin, MistralForCausalLM):
    supports_tensor_parallel = True


class Qwen2ForSequenceClassification(SequenceClassifierMixin, Qwen2ForCausalLM):
    supports_tensor_parallel = True


class Qwen3ForSequenceClassification(SequenceClassifierMixin, Qwen3ForCausalLM):
    supports_tensor_parallel = True
