"""Tool-call and reasoning parser extension points and the data they produce."""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(slots=True)
class ToolCall:
    """A complete function call found in model output; ``arguments`` is a JSON string."""

    id: str
    name: str
    arguments: str
    type: str = "function"


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool-call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass(slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    # Text around the calls that is meant for the user, if any.
    content: str | None = None


@dataclasses.dataclass(slots=True)
class DeltaToolCall:
    """A streamed piece of the tool call at ``index`` (OpenAI's delta format)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None


@dataclasses.dataclass(slots=True)
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = dataclasses.field(default_factory=list)


class ToolParser(ABC):
    """Turns a model's tool-call syntax into OpenAI tool calls.

    Contract: never raises on malformed model output: what does not parse is returned as
    ``content``. Streaming receives the text so far and the new delta, and returns what
    to send now (or ``None``); the concatenated deltas must equal the non-streaming result.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        """Parse a complete output."""

    @abstractmethod
    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """Parse the output incrementally."""

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation (e.g. keep special tokens); optional."""
        return request

    def flush_streaming(self, final_text: str) -> DeltaMessage | None:
        """At the end of a stream: anything held back (optional)."""
        return None


class ReasoningParser(ABC):
    """Separates a model's reasoning from its answer.

    Contract: never raises on model output; an output whose reasoning never closes is all
    reasoning. :meth:`is_reasoning_end` lets guided decoding start its constraint only
    after the reasoning ends. One instance serves one output: :meth:`for_prompt` tells it
    what the prompt's end already did (opened the reasoning, or closed it).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # The output begins inside the reasoning (the prompt opened it).
        self.starts_in_reasoning = False
        # The output begins after the reasoning (the prompt closed it: a chat template
        # with thinking turned off writes an empty section, e.g. "<think>\n\n</think>").
        self.starts_after_reasoning = False

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt: str | None) -> ReasoningParser:
        """A parser for one output of ``prompt`` (told whether the prompt's end opened
        or closed the reasoning)."""
        parser = cls(tokenizer)
        if prompt is not None:
            parser.starts_in_reasoning = parser.prompt_opens_reasoning(prompt)
            parser.starts_after_reasoning = parser.prompt_closes_reasoning(prompt)
        return parser

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether ``prompt`` ends inside an opened reasoning section (optional)."""
        return False

    def prompt_closes_reasoning(self, prompt: str) -> bool:
        """Whether ``prompt`` ends just after a closed reasoning section, so the output
        is all answer (optional)."""
        return False

    def flush_streaming(self, final_text: str) -> DeltaMessage | None:
        """At the end of a stream: anything held back (optional)."""
        return None

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over after the output tokens ``token_ids``: guided
        decoding constrains what follows the shortest output for which this is True.

        Contract: once True for an output, True for every longer one. For an empty
        output it is True exactly when this output holds no reasoning: the prompt closed
        it (``starts_after_reasoning``), or the parser's models reason only when the
        prompt opens it; then the answer's very first token is constrained. It is False
        while the output reasons (``starts_in_reasoning``) or may still open its
        reasoning itself; then see :meth:`opening_token_sequences`.
        """

    def opening_token_sequences(self) -> tuple[tuple[int, ...], ...] | None:
        """The token sequences that open a reasoning section at the start of the output,
        when the prompt neither opened nor closed it; None when the first tokens' role is
        already known, or cannot be told from them (the default).

        Guided decoding then lets the output go on with one of these (the model reasons,
        unconstrained once a whole sequence is out, until :meth:`is_reasoning_end`) or
        with a token the constraint allows (the answer starts at the first token): a
        marker of several tokens is allowed as a whole, never in part. With None the
        output is free until :meth:`is_reasoning_end` first holds.

        The default reads the older hook ``opening_token_ids()`` (single opening tokens)
        where a parser written for it still defines it.
        """
        legacy = getattr(self, "opening_token_ids", None)
        if callable(legacy):
            tokens = legacy()
            if tokens is not None:
                return tuple((int(token),) for token in sorted(tokens))
        return None

    @abstractmethod
    def extract_reasoning_content(
        self, model_output: str, request: Any
    ) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a complete output."""

    @abstractmethod
    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What to send for this delta."""
