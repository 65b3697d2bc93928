"""Pieces every OpenAI response is made of: server-sent events and the ``usage`` count."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.core.outputs import RequestOutput

# The engine's outputs of one request's prompts, each tagged with its prompt's index.
Outputs = AsyncIterator[tuple[int, RequestOutput]]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def sse_stream(
    choices: AsyncIterator[dict[str, Any]],
    envelope: Callable[[list[dict[str, Any]]], dict[str, Any]],
    usage: Usage,
    stream_options: Any,
) -> AsyncIterator[str]:
    """A streamed response: one chunk per choice delta (``envelope`` wraps them), the
    usage per chunk and/or at the end as ``stream_options`` asks, then ``[DONE]``."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)
    async for choice in choices:
        chunk = envelope([choice])
        if include_usage and continuous:
            chunk["usage"] = usage.json()
        yield sse(chunk)
    if include_usage:
        yield sse(dict(envelope([]), usage=usage.json()))
    yield sse("[DONE]")


class Usage:
    """The ``usage`` of one response, counted from the engine's outputs as they come."""

    def __init__(self, prompt_tokens: dict[int, int], details: bool) -> None:
        self._prompt = dict(prompt_tokens)
        self._cached: dict[int, int] = {}
        self._completion = 0
        self._details = details

    def add_output(self, prompt_index: int, output: RequestOutput) -> None:
        self._prompt[prompt_index] = len(output.prompt_token_ids)
        self._cached[prompt_index] = output.num_cached_tokens

    def add_completion_tokens(self, count: int) -> None:
        self._completion += count

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt.values())

    @property
    def completion_tokens(self) -> int:
        return self._completion

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def json(self) -> dict[str, Any]:
        prompt = self.prompt_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": self._completion,
            "total_tokens": prompt + self._completion,
        }
        if self._details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage
