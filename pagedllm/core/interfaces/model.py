"""The model-architecture extension point, registered under Hugging Face names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class ModelArchitecture(ABC):
    """A causal language model implemented for pagedllm's flat, paged batches.

    Implementations are ``torch.nn.Module`` subclasses that also derive from this class
    and are registered under the ``architectures`` name found in a Hugging Face config
    (``LlamaForCausalLM``, ...).

    Contract:
    - ``__init__(config, quant_config=None, *, max_positions=None,
      disable_sliding_window=False)``: ``config`` is the model's Hugging Face config after
      overrides; ``quant_config`` a QuantizationConfig or ``None``; ``max_positions`` the
      context length the engine will use (size rotary tables for it);
      ``disable_sliding_window`` asks for full attention everywhere.
    - :meth:`forward` takes the flat token ids and positions of every scheduled token of
      every request, plus the attention metadata, and returns one hidden state per token.
    - :meth:`compute_logits` maps selected hidden states to vocabulary logits.
    - :meth:`load_weights` consumes ``(checkpoint_name, tensor)`` pairs and returns the
      parameter names it filled.
    """

    # Whether it generates text (``--task generate``), and the pooling tasks it serves
    # (``--task embed|classify|score|reward``); the first of these is its task under
    # ``--task auto`` (generation where it generates).
    supports_generation: ClassVar[bool] = True
    pooling_tasks: ClassVar[tuple[str, ...]] = ("embed",)

    def default_pooler_config(self, task: str) -> Any:
        """The pooler of ``task`` before ``--override-pooler-config`` (a
        ``pagedllm.core.pooling.PoolerConfig``). A generative model's embedding is its
        last token's final hidden state, normalized, as vLLM's."""
        from pagedllm.core.pooling import PoolerConfig

        return PoolerConfig(pooling_type="LAST", normalize=True, softmax=False)

    def pooling_head(self, rows: torch.Tensor, task: str) -> torch.Tensor:
        """What the head makes of the pooled hidden states: nothing for embeddings; a
        classifier's scores for classification models."""
        return rows

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        """Hidden states, one row per input token."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits, one row per hidden state."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; return the names filled."""

    def process_weights_after_loading(self) -> None:  # noqa: B027 - optional hook
        """Called once after the weights are loaded and the model moved to its device
        (repack them); optional. Layers computed together (Q/K/V, gate/up) are fused
        when the model is built (``LinearGroup``), not here."""
