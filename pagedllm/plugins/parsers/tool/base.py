"""What the built-in tool parsers share: one description of an output (content pieces
and complete calls) that serves both complete and streamed parsing.

Streaming re-describes the text so far at each delta and sends what grew: content as it
comes (a tail that may open a call is held back), each call once its syntax is complete
(id, name and arguments in one delta). Content is the text outside the calls, leaving out
whitespace-only pieces; a call that does not parse stays in the content as written.
Because both ways use the same description, the concatenated deltas equal the complete
result for any chunking.
"""

from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from pagedllm.core.interfaces import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)


@dataclasses.dataclass(slots=True)
class Description:
    """The output in order: text pieces (``str``) and complete calls (``(name,
    arguments JSON)``)."""

    items: list[str | tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [item for item in self.items if isinstance(item, tuple)]

    def add_text(self, text: str) -> None:
        if text:
            self.items.append(text)

    def text(self, final: bool) -> str:
        """The content: text pieces, without whitespace-only ones next to a call (the
        separators around calls); while the output goes on, a whitespace-only last piece
        is held back, since a call may follow it."""
        items = self.items
        kept = []
        for i, item in enumerate(items):
            if isinstance(item, tuple) or item.strip():
                if not isinstance(item, tuple):
                    kept.append(item)
                continue
            before = i > 0 and isinstance(items[i - 1], tuple)
            after = i + 1 < len(items) and isinstance(items[i + 1], tuple)
            last = i + 1 == len(items)
            if before or after or (last and not final):
                continue
            kept.append(item)
        return "".join(kept)


def call_from_json(value: Any) -> tuple[str, str] | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> (name, arguments JSON)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def calls_from_json_text(text: str) -> list[tuple[str, str]] | None:
    """One call object or a list of them, as JSON text; None if it does not parse."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                longest = max(longest, size)
                break
    return longest


def describe_blocks(
    text: str,
    final: bool,
    start: str,
    end: str | None,
    parse: Any = calls_from_json_text,
) -> Description:
    """Calls written as ``start BODY end`` blocks (``end`` None: the body runs to the end
    of the output); ``parse(body)`` gives the calls or None."""
    description = Description()
    position = 0
    while True:
        index = text.find(start, position)
        if index < 0:
            tail = text[position:]
            if not final:
                tail = tail[: len(tail) - partial_marker(tail, [start])]
            description.add_text(tail)
            return description
        description.add_text(text[position:index])
        body_start = index + len(start)
        close = text.find(end, body_start) if end is not None else -1
        if close < 0:
            if not final:
                return description  # the block goes on: nothing more to say yet
            body, position_after = text[body_start:], len(text)
        else:
            body, position_after = text[body_start:close], close + len(end)
        calls = parse(body.strip())
        if calls is None:
            description.add_text(text[index:position_after])
        else:
            description.items.extend(calls)
        if position_after >= len(text):
            return description
        position = position_after


class DescribedToolParser(ToolParser):
    """A tool parser given by :meth:`describe`."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._sent_content = ""
        self._sent_calls = 0

    @abstractmethod
    def describe(self, text: str, final: bool) -> Description:
        """Content and complete calls of ``text``; with ``final`` False the output may
        go on (hold back what may still become a call)."""

    def make_call_id(self) -> str:
        return new_tool_call_id()

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        try:
            description = self.describe(model_output, final=True)
        except Exception:  # never fail a request on odd model output
            return ExtractedToolCalls(False, [], model_output)
        calls = [
            ToolCall(id=self.make_call_id(), name=name, arguments=arguments)
            for name, arguments in description.calls
        ]
        if not calls:
            return ExtractedToolCalls(False, [], model_output)
        return ExtractedToolCalls(True, calls, description.text(final=True) or None)

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
        return self._advance(current_text, final=False)

    def flush_streaming(self, final_text: str) -> DeltaMessage | None:
        """At the end of a stream: what was held back."""
        return self._advance(final_text, final=True)

    def _advance(self, text: str, final: bool) -> DeltaMessage | None:
        try:
            description = self.describe(text, final=final)
        except Exception:
            description = Description([text] if final else [])
        delta = DeltaMessage()
        content = description.text(final)
        if final and not description.calls:
            content = text  # no calls at all: the output is content, as it is
        if content.startswith(self._sent_content) and len(content) > len(self._sent_content):
            delta.content = content[len(self._sent_content) :]
            self._sent_content = content
        for index in range(self._sent_calls, len(description.calls)):
            name, arguments = description.calls[index]
            delta.tool_calls.append(
                DeltaToolCall(
                    index=index,
                    id=self.make_call_id(),
                    name=name,
                    arguments=arguments,
                    type="function",
                )
            )
        self._sent_calls = max(self._sent_calls, len(description.calls))
        if delta.content is None and not delta.tool_calls:
            return None
        return delta
