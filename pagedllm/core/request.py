"""The engine's state for one request (one sequence)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.sampling.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    ``all_token_ids`` is the prompt followed by the output so far. The engine's invariant:
    ``num_computed_tokens`` tokens have their KV in the cache, and each step schedules
    tokens so that it catches up with ``num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    # Extra keys mixed into prefix-cache hashes (e.g. a LoRA id); empty when none.
    cache_salt: str | None = None
    # Token ranges ``(start, end, key)`` whose content is more than their token ids (an
    # image's placeholder tokens, keyed by the image's content hash): a block of the
    # prefix cache that overlaps one mixes its key into its hash. Empty when none.
    range_keys: tuple[tuple[int, int, Any], ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    all_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was (re)scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Chain hashes of the full blocks of all_token_ids, filled by the KV-cache manager.
    block_hashes: list[Any] = dataclasses.field(default_factory=list)
    # Per-request state of the sampler (seeded generator, guided-decoding matcher, ...).
    sampler_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The user's request this is one sequence of (its id; ``n`` > 1 gives several), and
    # this sequence's index among them.
    parent_id: str = ""
    sequence_index: int = 0
    # The error that made the engine give up on this request (it is then aborted).
    failure: BaseException | None = None
    # The state of the step extensions this request uses, by extension name (see
    # pagedllm.core.interfaces.extension): e.g. "lora" (its LoRARequest), "pooling" (its
    # PoolingParams), "guided" (the future of its compiled constraint). Empty when none.
    features: dict[str, Any] = dataclasses.field(default_factory=dict)
    # False: the request never samples a token; a step extension reads its result from
    # the hidden states (a pooling request).
    samples_tokens: bool = True
    # How many tokens the last step appended (several when speculative drafts were kept).
    num_new_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.parent_id:
            self.parent_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
