"""``EngineClient``: what the OpenAI server asks of an engine, whether the engine runs in
its own process's thread (:class:`~pagedllm.core.async_engine.AsyncLLMEngine`) or as
data-parallel replica processes behind a front end
(:class:`~pagedllm.entrypoints.data_parallel.replica_client.DataParallelClient`).

The server reaches nothing else, so that anything it needs from the model (the tokenizer,
the context length, the generation defaults) is in :class:`EngineInfo`, which a front end
without a model can hold as well.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.engine import NewRequest
    from pagedllm.core.outputs import RequestOutput
    from pagedllm.lora.request import LoRARequest


class EngineInfo(Protocol):
    """The model facts the server reads (an ``LLMEngine`` has them all)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    task: str
    # The request tasks the engine serves beside generation (each pooling task the model
    # serves; empty for generation)
    served_tasks: tuple[str, ...]
    # sampling_defaults, eos_token_ids and hf_config
    loaded: Any


class EngineClient(Protocol):
    config: PagedLLMConfig
    # Set once the engine can serve no more (the server then exits non-zero).
    dead: threading.Event

    @property
    def engine(self) -> EngineInfo: ...

    @property
    def is_healthy(self) -> bool: ...

    def wait_built(self) -> None:
        """Wait until the engine can take requests; raise what starting it raised."""

    def generate_many(
        self, requests: Sequence[NewRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests, interleaved, tagged with their request's index;
        one invalid request (``ValueError``) queues none; leaving early aborts them."""

    def load_lora(self, request: LoRARequest) -> concurrent.futures.Future[None]:
        """Load the adapter (every replica); ``InvalidRequestError`` when it cannot."""

    def unload_lora(self, lora_int_id: int) -> concurrent.futures.Future[None]: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (``--enable-sleep-mode``; ``mode``: abort or wait)."""

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake what ``tags`` name (None: everything); whether fully awake."""

    async def is_sleeping(self) -> bool: ...

    def stop_compiling(self) -> None:
        """Stop every guided-decoding compile now (from a signal's thread)."""

    def shutdown(self, timeout: float = 10.0) -> None: ...
