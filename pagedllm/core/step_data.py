"""What one engine step hands from stage to stage, in one direction only:
the scheduler's :class:`SchedulerOutput` to the model runner, the runner's
:class:`RunnerOutput` back to the scheduler's update and on to the output processor.

Nothing here imports torch: the scheduler and its tests stay torch-free.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagedllm.core.request import Request


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: which tokens to compute and where their KV goes."""

    request: Request
    num_new_tokens: int
    # num_computed_tokens when the step starts (cached prefix included).
    num_computed_tokens: int
    # The request's block table after this step's allocation: physical block ids in
    # token order (the runner reads it; it never asks the KV-cache manager).
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens a step extension computes after the request's known ones (speculative
    # decoding's drafts), counted in num_new_tokens; the extension verifies them.
    extra_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        """The new tokens that are the request's own (the rest are extra tokens to verify)."""
        return self.num_new_tokens - len(self.extra_token_ids)

    @property
    def reaches_end(self) -> bool:
        """Whether this step computes the request's last known token, so it samples."""
        # (num_known_tokens inlined: read for every request several times a step)
        known = self.num_new_tokens - len(self.extra_token_ids)
        return self.num_computed_tokens + known == self.request.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the step samples the request's next token: it reaches the end, with no
        extra tokens, and its request samples tokens (else a step extension reads its
        rows)."""
        return self.reaches_end and not self.extra_token_ids and self.request.samples_tokens


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]
    # Requests the scheduler gave up on before running them (their guided-decoding
    # constraint failed to compile), with the error; already finished as aborted.
    aborted: list[tuple[Request, BaseException]] = dataclasses.field(default_factory=list)
    scheduled_time: float = dataclasses.field(default_factory=time.monotonic)
    # (source, destination) KV blocks the runner copies before the step: shared partial
    # tails continued by a request that writes into its own copy (copy-on-write).
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests that sample a token this step, in batch order: the rows of the
        logits and of a guided-decoding token mask."""
        return [item.request for item in self.scheduled if item.samples]


@dataclasses.dataclass(slots=True)
class RunnerOutput:
    # request id -> sampled token
    sampled_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    # request id -> the sampler's logprobs row for that token (None when not asked)
    logprobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # request id -> prompt logprobs computed this step, in prompt order
    prompt_logprobs: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    # request id -> the tokens a speculative step appends (kept drafts, then one more)
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # request id -> the pooled result of a pooling request whose prompt ended this step
    pooled: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A plugin's step extension's results, by its name (its runner side writes them, its
    # read_outputs reads them).
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Seconds of the step's forward pass and of the runner's whole step, measured only
    # when the runner times its steps (--collect-detailed-traces).
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    # Set when computing the step failed: every scheduled request fails with it.
    error: Exception | None = None
