"""The model-architecture extension point, registered under Hugging Face names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.core.errors import ConfigError

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
    - With ``supports_tensor_parallel``, a model built after
      ``pagedllm.distributed.parallel_state.set_tensor_parallel(rank, size)`` holds
      ``rank``'s shard of every split layer, loads it from the full checkpoint tensors,
      and returns the full hidden states and full logits on every rank (each rank runs
      the same steps; the collectives join them). :meth:`check_tensor_parallel` says
      before the build whether a config splits over ``size`` ranks.
    - With ``supports_pipeline_parallel``, a model built after
      ``set_pipeline_parallel(rank, size)`` holds stage ``rank``'s decoder layers
      (``stage_layers``), stage 0 the embedding and the head, the last stage the final
      norm; the parts it does not hold are ``HeldElsewhere`` modules and their
      checkpoint tensors are skipped. :meth:`forward` then takes ``intermediate``: the
      previous stage's hidden states in place of the token ids (None on stage 0), and
      returns this stage's output (final hidden states on the last stage).
    """

    # Whether it generates text (``--task generate``), and the pooling tasks it serves
    # (``--task embed|classify|score|reward``); the first of these is its task under
    # ``--task auto`` (generation where it generates).
    supports_generation: ClassVar[bool] = True
    pooling_tasks: ClassVar[tuple[str, ...]] = ("embed",)
    # Whether it can be split over tensor-parallel ranks (``--tensor-parallel-size``).
    # Not inherited: a subclass may change the layers, so each class that supports it
    # says so in its own body (``__init_subclass__`` resets it otherwise).
    supports_tensor_parallel: ClassVar[bool] = False
    # Whether its layers can be split over pipeline stages (``--pipeline-parallel-size``):
    # inherited, as the decoder that holds a stage's layers is shared by the subclasses.
    supports_pipeline_parallel: ClassVar[bool] = False
    # Whether every product of its forward pass goes through pagedllm's layers (``Linear``,
    # ``LinearGroup``, ``VocabEmbedding``) and every other op works row by row, so that
    # ``--batch-invariant`` holds for it. Not inherited either (a subclass may add
    # mixture-of-experts layers, whose products group the batch's rows by expert).
    supports_batch_invariance: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("supports_tensor_parallel", "supports_batch_invariance"):
            if name not in cls.__dict__:
                setattr(cls, name, False)

    @classmethod
    def check_tensor_parallel(cls, config: Any, size: int, *, experts: bool = False) -> None:
        """Raise ``ConfigError`` unless a model of Hugging Face ``config`` can be split
        over ``size`` tensor-parallel ranks (any model runs on one). Architectures that
        support it extend this with their own divisibility conditions. ``experts``: with
        ``--enable-expert-parallel`` its MoE layers split by expert, not by rows (the
        engine passes it only then)."""
        if size > 1 and not cls.supports_tensor_parallel:
            raise ConfigError(
                f"{cls.__name__} does not support tensor parallelism "
                f"(--tensor-parallel-size {size}); use --tensor-parallel-size 1"
            )

    @classmethod
    def check_pipeline_parallel(cls, config: Any, size: int) -> None:
        """Raise ``ConfigError`` unless a model of Hugging Face ``config`` can be split
        over ``size`` pipeline stages: it supports it and has a layer for each."""
        if size == 1:
            return
        if not cls.supports_pipeline_parallel:
            raise ConfigError(
                f"{cls.__name__} does not support pipeline parallelism "
                f"(--pipeline-parallel-size {size}); use --pipeline-parallel-size 1"
            )
        layers = getattr(config, "num_hidden_layers", 0)
        if layers < size:
            raise ConfigError(
                f"{cls.__name__} has {layers} layers: too few for --pipeline-parallel-size "
                f"{size} (a stage holds at least one)"
            )
        from pagedllm.distributed.parallel_state import layer_partition

        try:
            layer_partition(layers, size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

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

    def kv_cache_shape(self) -> tuple[int, int, int] | None:
        """``(layers, KV heads, head size)`` of this rank's KV cache, where the config's
        attributes (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``) do not
        say them; optional (None: they do)."""
        return None

    def process_weights_after_loading(self) -> None:  # noqa: B027 - optional hook
        """Called once after the weights are loaded and the model moved to its device
        (repack them); optional. Layers computed together (Q/K/V, gate/up) are fused
        when the model is built (``LinearGroup``), not here."""
