"""The scheduler contract (``--scheduler-cls``): what the engine, the stat logger and the
output processor call on a scheduler, and how the engine constructs one.

Construction (the engine does it once, after the KV-cache manager)::

    scheduler_cls(config, kv_manager, max_model_len, extensions=[...])

- ``config``: the :class:`~pagedllm.core.config.SchedulerConfig` (token budget, batch size,
  policy, chunked prefill, partial-prefill limits, delay factor);
- ``kv_manager``: the :class:`~pagedllm.core.kv_cache.KVCacheManager` that owns the blocks;
- ``max_model_len``: the longest sequence (prompt and output) the model takes;
- ``extensions``: the :class:`~pagedllm.core.interfaces.extension.StepExtension` objects the
  configuration turned on (LoRA, speculative decoding, pooling, guided decoding, a
  plugin's), which the scheduler calls at the moments their interface names. A scheduler
  that ignores them silently breaks those features: refuse the ones you do not support.

:class:`pagedllm.core.scheduler.Scheduler` (registered as ``default``) is the built-in
implementation; subclassing it is the easy way to write another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.step_data import RunnerOutput, SchedulerOutput


class SchedulerInterface(ABC):
    """Decides, step by step, which tokens of which requests the model computes.

    One step is ``schedule()`` → (``token_mask()``) → the runner → ``update_from_output()``
    → ``finish_requests()`` for what the output processor stopped or aborted. Everything is
    called from the engine's thread, never concurrently.
    """

    #: Unfinished requests (waiting or running) by request id.
    requests: dict[str, Request]
    #: How many times a running request was preempted, since the start.
    num_preemptions: int

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new (WAITING) request. A request id already in use is a ``ValueError``."""

    @abstractmethod
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish the requests with ``status`` (a finished one: aborted, or stopped on a stop
        string) and free their KV blocks; ids unknown or already finished are skipped.
        Returns the requests finished now."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """The next step: each scheduled request's new tokens, its block table after this
        step's allocations (already made), the requests preempted and those aborted before
        running (with their error), and the KV blocks to copy first."""

    @abstractmethod
    def token_mask(self, output: SchedulerOutput) -> Any:
        """The allowed tokens of the step's sampling rows (``output.sampling_requests``): a
        bool tensor ``[rows, vocab]`` (True = allowed), or None when nothing is masked."""

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's result: advance computed tokens, append the new tokens and apply
        the stop conditions that need no text (EOS, stop token ids, max_tokens, the model
        length). Returns the requests that got a new token or finished, and those the step
        failed on (finished as aborted, with ``failure`` set)."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted)."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Requests running (holding KV blocks)."""

    def extension_stats(self) -> dict[str, int]:
        """The counters of the step extensions, as ``{"<extension>_<counter>": value}``
        (e.g. ``spec_draft_tokens``), for the stat logger; none by default."""
        return {}
