"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per sequence."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence, else None.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Tokens of the request's longest sequence (for the inter-token latency).
    num_generation_tokens: int = 0
    # The request's n and max_tokens (the metrics' request_params_* histograms).
    n: int = 1
    max_tokens: int | None = None
    # --collect-detailed-traces: seconds in the model's forward passes ("model") and in
    # the runner's whole steps ("worker") of the steps that computed this request.
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
