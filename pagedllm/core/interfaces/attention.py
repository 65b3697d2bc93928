"""The attention-backend extension point: attention over the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class AttentionBackend(ABC):
    """Computes attention for every layer of one step.

    Contract: :meth:`build_metadata` runs once per step (on the runner's thread, before
    the model) and its result is passed to every layer; :meth:`forward` first writes the
    step's keys and values into ``kv_caches[layer.layer_index]`` at the step's slots, then
    attends each query token to its request's context (cached tokens and this step's, up to
    and including its own position, within ``layer.sliding_window`` when set).
    Devices name their backend (``Device.attention_backend``).
    """

    name: ClassVar[str]
    # The --kv-cache-dtype values this backend reads and writes (the engine refuses
    # others): the model's dtype only, unless a backend declares fp8 ones.
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # Whether forward soft-caps the scores of layers with ``layer.logits_soft_cap`` set
    # (``cap * tanh(score / cap)`` before the softmax, Gemma 2); the engine refuses
    # models with such layers on a backend that does not.
    logits_soft_cap: ClassVar[bool] = False
    # Whether :meth:`with_bidirectional_spans` is implemented; the engine refuses models
    # that need it (``attends_spans_bidirectionally``) on a backend that does not.
    bidirectional_spans: ClassVar[bool] = False

    def batch_invariant_refusal(
        self, layers: list[Any], kv_cache_dtype: torch.dtype | None
    ) -> str | None:
        """Why this backend cannot attend the query tokens of these attention ``layers``
        (over a KV cache of ``kv_cache_dtype``; before the model loads, no layers and None)
        the same way whatever else is in the step, as ``--batch-invariant`` asks, or None
        when it can: in that mode (``pagedllm.kernels.batch_invariant``), a query token's
        result depends only on its request's context, not on the step's other requests or
        on how its prompt was split into chunks. The default: no such promise."""
        return f"the {self.name} attention backend does not attend each request independently"

    @abstractmethod
    def build_metadata(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> Any:
        """Per-step data for requests adding ``query_lens[i]`` tokens to reach
        ``context_lens[i]`` tokens, whose KV blocks are ``block_tables[i]``."""

    @abstractmethod
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """``query`` ``[T, heads*d]``, ``key``/``value`` ``[T, kv_heads*d]`` -> ``[T, heads*d]``."""

    def with_bidirectional_spans(
        self, metadata: Any, spans: dict[int, tuple[tuple[int, int], ...]]
    ) -> Any:
        """``metadata`` (this backend's, of one step) where the query tokens of some
        requests also attend to later keys: ``spans`` maps a request's first token in the
        flat batch to context position ranges ``[start, end)`` (each within what the step
        makes its context); a query token inside a range sees the keys up to the range's
        end as well as the causal ones (within the layer's sliding window back). A model
        calls it in its forward pass (image tokens attending to their whole image)."""
        raise NotImplementedError(f"the {self.name} attention backend has no bidirectional spans")
