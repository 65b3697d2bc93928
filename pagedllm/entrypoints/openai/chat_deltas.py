"""A chat choice's output as OpenAI deltas, and the message those deltas add up to.

Both the stream and the full reply go through :class:`ChoiceDeltas`: a streamed reply
sends each delta as a chunk; a full reply gets the whole output as one step (``whole``:
the parsers' complete-output methods run, as their contract gives the same result as
streaming) and :class:`MessageBuilder` adds the deltas up into the choice's message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.interfaces import DeltaMessage, ReasoningParser
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_choice import ToolCallStream


@dataclasses.dataclass(frozen=True, slots=True)
class OutputStep:
    """One step of a choice's output: the text and token ids before it, after it, and
    new in it (what streaming parsers take)."""

    previous_text: str
    current_text: str
    delta_text: str
    previous_token_ids: Sequence[int]
    current_token_ids: Sequence[int]
    delta_token_ids: Sequence[int]


class ChoiceDeltas:
    """Turns one choice's new text and token ids into the delta to send: reasoning split
    off by the reasoning parser (if any), then tool calls found by ``tools`` (if any)."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        reasoning: ReasoningParser | None,
        tools: ToolCallStream | None,
    ) -> None:
        self.request = request
        self.reasoning = reasoning
        self.tools = tools
        self._text = ""
        self._token_ids: list[int] = []

    def step(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None, whole: bool
    ) -> tuple[dict[str, Any], str | None]:
        """The delta for ``text``/``token_ids`` (new since the last step, or the complete
        output when ``whole``) and the finish reason to report."""
        if self.reasoning is None and self.tools is None:
            return ({"content": text} if text else {}), finish_reason
        previous_ids = self._token_ids
        self._token_ids = [*previous_ids, *token_ids]
        step = OutputStep(
            self._text, self._text + text, text, previous_ids, self._token_ids, list(token_ids)
        )
        self._text = step.current_text
        delta = self._split_reasoning(step, finish_reason is not None, whole)
        if self.tools is not None:
            delta, finish_reason = self.tools.step(delta, step, finish_reason, whole)
        return delta, finish_reason

    def _split_reasoning(self, step: OutputStep, last: bool, whole: bool) -> dict[str, Any]:
        parser = self.reasoning
        if parser is None:
            return {"content": step.delta_text} if step.delta_text else {}
        if whole:
            thought, answer = parser.extract_reasoning_content(step.current_text, self.request)
            delta: dict[str, Any] = {}
            if thought:
                delta["reasoning_content"] = thought
            if answer:
                delta["content"] = answer
            return delta
        streamed = parser.extract_reasoning_content_streaming(
            step.previous_text,
            step.current_text,
            step.delta_text,
            step.previous_token_ids,
            step.current_token_ids,
            step.delta_token_ids,
        )
        # At the end, whatever the parser held back (a possible marker) is sent too.
        flushed = parser.flush_streaming(step.current_text) if last else None
        return _merge(streamed, flushed)


def _merge(*messages: DeltaMessage | None) -> dict[str, Any]:
    """One OpenAI delta from reasoning-parser DeltaMessages (None ones skipped)."""
    merged: dict[str, Any] = {}
    for message in messages:
        if message is None:
            continue
        for key in ("reasoning_content", "content"):
            value = getattr(message, key)
            if value:
                merged[key] = merged.get(key, "") + value
    return merged


class MessageBuilder:
    """Adds up one choice's streamed chunks (``{"index", "delta", "logprobs",
    "finish_reason", ...}``) into the choice of a full chat reply."""

    def __init__(self, index: int, with_reasoning: bool) -> None:
        self.index = index
        self.with_reasoning = with_reasoning
        self.role: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        # The deprecated function-calling shape (see .legacy_functions): one call.
        self.function_call: dict[str, str] | None = None
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def add(self, chunk: dict[str, Any]) -> None:
        delta = chunk["delta"]
        self.role = delta.get("role", self.role)
        self.content.append(delta.get("content") or "")
        self.reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls", ()):
            entry = self.calls.setdefault(
                call["index"],
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if call.get("id"):
                entry["id"], entry["type"] = call["id"], call.get("type") or "function"
            function = call.get("function", {})
            if function.get("name") is not None:
                entry["function"]["name"] = function["name"]
            entry["function"]["arguments"] += function.get("arguments") or ""
        function_call = delta.get("function_call")
        if function_call is not None:
            if self.function_call is None:
                self.function_call = {"name": "", "arguments": ""}
            self.function_call["name"] += function_call.get("name") or ""
            self.function_call["arguments"] += function_call.get("arguments") or ""
        if chunk.get("logprobs") is not None:
            if self.logprobs is None:
                self.logprobs = {"content": []}
            self.logprobs["content"].extend(chunk["logprobs"]["content"])
        if "stop_reason" in chunk:
            self.finish_reason = chunk["finish_reason"]
            self.stop_reason = chunk["stop_reason"]

    def choice(self) -> dict[str, Any]:
        tool_calls = [self.calls[i] for i in sorted(self.calls)]
        content: str | None = "".join(self.content)
        # An answer that is all reasoning or all tool calls has no content (null).
        if not content and (self.with_reasoning or tool_calls or self.function_call):
            content = None
        message: dict[str, Any] = {"role": self.role, "content": content, "tool_calls": tool_calls}
        if self.function_call is not None:
            message["function_call"] = self.function_call
        if self.with_reasoning:
            # vLLM's newer name, and the older one it still sends (the same text).
            message["reasoning"] = message["reasoning_content"] = "".join(self.reasoning) or None
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
