"""Tool calls in chat completions, all in one place: which ``tool_choice`` applies, and
each choice's tool calls as OpenAI deltas (streamed, or found in the whole output).

``"required"`` and a named function are enforced with guided decoding, so the output
always parses into calls of the offered tools: a named function's output is its arguments
object (its ``parameters`` schema); ``required`` outputs a JSON array of
``{"name": ..., "parameters": {...}}`` objects, one of the offered tools each (at most one
when ``parallel_tool_calls`` is false). ``"auto"`` (the default with tools when the server
runs with ``--enable-auto-tool-choice``) parses the model's own calls with the
``--tool-call-parser``; ``parallel_tool_calls=false`` keeps the first.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.interfaces import ToolCall, ToolParser, new_tool_call_id
from pagedllm.core.sampling import GuidedDecodingParams, SamplingParams
from pagedllm.entrypoints.openai.errors import OpenAIError

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.chat_deltas import OutputStep
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

# OpenAI reads a function without ``parameters`` (or with ``{}``) as one that takes no
# arguments: its forced call is ``{}``. (A bare ``{"type": "object"}`` would let a small
# model add keys until max_tokens.)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a function's arguments."""
    return function.get("parameters") or NO_ARGUMENTS


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function spec of the offered tools (validated)."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise OpenAIError(400, f"tools[{i}] must be a function tool", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, f"tools[{i}].function.name is missing", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError(
                400, f"tools[{i}].function.parameters must be a JSON schema", param="tools"
            )
        functions[name] = function
    return functions


def forced_tool_schema(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> tuple[str | None, dict[str, Any] | None]:
    """``(named function or None, JSON schema)`` when ``tool_choice`` forces a call,
    else ``(None, None)``."""
    if tool_choice in (None, "none", "auto"):
        return None, None
    functions = _functions(tools)
    if not functions:
        raise OpenAIError(400, f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "required":
        items = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": _parameters(function),
                },
                "required": ["name", "parameters"],
            }
            for name, function in functions.items()
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return None, schema
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError(
                400,
                "tool_choice must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in functions:
            raise OpenAIError(
                400,
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(functions)})",
                param="tool_choice",
            )
        return name, _parameters(functions[name])
    raise OpenAIError(400, f"tool_choice {tool_choice!r} is not valid", param="tool_choice")


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    """A tool call in the OpenAI response format."""
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.name, "arguments": call.arguments},
    }


def forced_calls(named: str | None, text: str) -> list[ToolCall]:
    """The calls in the constrained output (empty if it did not complete)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if named is not None:
        pairs = [(named, value)]
    else:
        pairs = [(item["name"], item["parameters"]) for item in value]
    return [
        ToolCall(new_tool_call_id(), name, json.dumps(arguments, ensure_ascii=False))
        for name, arguments in pairs
    ]


def delta_tool_call(index: int, call: ToolCall) -> dict[str, Any]:
    """A complete tool call in the OpenAI streaming (delta) format."""
    return dict(openai_tool_call(call), index=index)


# ------------------------------------------------------------------ per choice


class ToolCallStream(ABC):
    """One chat choice's tool calls: takes the choice's delta (``content`` and maybe
    ``reasoning_content``) and returns it with the calls found in it as ``tool_calls``,
    and the finish reason (``"tool_calls"`` once a call was made, where the model stopped
    on its own)."""

    @abstractmethod
    def step(
        self, delta: dict[str, Any], step: OutputStep, finish_reason: str | None, whole: bool
    ) -> tuple[dict[str, Any], str | None]:
        """``whole``: ``step`` is the complete output (a reply that is not streamed)."""


class ForcedToolCalls(ToolCallStream):
    """``tool_choice`` ``required`` or a named function (the output is guided JSON): a
    named function's arguments stream as they are generated; ``required`` calls are sent
    once the array is complete."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self.text = ""
        self.started = False

    def step(
        self, delta: dict[str, Any], step: OutputStep, finish_reason: str | None, whole: bool
    ) -> tuple[dict[str, Any], str | None]:
        text = delta.get("content") or ""
        self.text += text
        out = {k: v for k, v in delta.items() if k != "content"}
        if whole:
            calls = forced_calls(self.named, self.text)
            if not calls:  # the output did not complete (max_tokens): it stays content
                return delta, finish_reason
            out["tool_calls"] = [delta_tool_call(i, call) for i, call in enumerate(calls)]
        elif self.named is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.started:
                self.started = True
                call.update(id=new_tool_call_id(), type="function")
                call["function"]["name"] = self.named
            if text or len(call) > 2:
                out["tool_calls"] = [call]
            return out, finish_reason
        elif finish_reason is not None:
            calls = forced_calls(None, self.text)
            if calls:
                out["tool_calls"] = [delta_tool_call(i, call) for i, call in enumerate(calls)]
        if self.named is None and "tool_calls" in out and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason


class ParsedToolCalls(ToolCallStream):
    """``tool_choice`` ``auto``: the model's own calls, found by the tool parser; text
    around them stays content."""

    def __init__(self, parser: ToolParser, request: ChatCompletionRequest) -> None:
        self.parser = parser
        self.request = request
        self.text = ""
        self.called = False

    def step(
        self, delta: dict[str, Any], step: OutputStep, finish_reason: str | None, whole: bool
    ) -> tuple[dict[str, Any], str | None]:
        piece = delta.get("content") or ""
        previous = self.text
        self.text = current = previous + piece
        out = {k: v for k, v in delta.items() if k != "content"}
        if whole:
            found = self.parser.extract_tool_calls(current, self.request) if current else None
            if found is None or not found.tools_called:
                return delta, finish_reason
            if found.content:
                out["content"] = found.content
            calls = found.tool_calls[:1] if self._one_call else found.tool_calls
            out["tool_calls"] = [delta_tool_call(i, call) for i, call in enumerate(calls)]
            self.called = True
        else:
            messages = []
            if piece:
                messages.append(
                    self.parser.extract_tool_calls_streaming(
                        previous,
                        current,
                        piece,
                        step.previous_token_ids,
                        step.current_token_ids,
                        step.delta_token_ids,
                        self.request,
                    )
                )
            if finish_reason is not None:
                messages.append(self.parser.flush_streaming(current))
            for message in messages:
                if message is not None:
                    self._add(out, message)
        if finish_reason == "stop" and self.called:
            finish_reason = "tool_calls"
        return out, finish_reason

    @property
    def _one_call(self) -> bool:
        return self.request.parallel_tool_calls is False

    def _add(self, out: dict[str, Any], message: Any) -> None:
        if message.content:
            out["content"] = out.get("content", "") + message.content
        for call in message.tool_calls:
            if call.index > 0 and self._one_call:
                continue  # one call per turn, as asked
            self.called = True
            entry: dict[str, Any] = {"index": call.index, "function": {}}
            if call.id:
                entry.update(id=call.id, type=call.type or "function")
            if call.name is not None:
                entry["function"]["name"] = call.name
            if call.arguments is not None:
                entry["function"]["arguments"] = call.arguments
            out.setdefault("tool_calls", []).append(entry)


# ----------------------------------------------------------------- per request


@dataclasses.dataclass(slots=True)
class ToolCallPlan:
    """How a chat request's tool calls are handled: ``request`` as the tool parser
    adjusted it, and ``for_choice(index)`` the handler of each choice (None: no tool
    calls are looked for)."""

    request: ChatCompletionRequest
    for_choice: Callable[[int], ToolCallStream] | None = None


def plan_tool_calls(
    request: ChatCompletionRequest,
    params: SamplingParams,
    tool_parser: type[ToolParser] | None,
    auto_enabled: bool,
    tokenizer: Any,
) -> ToolCallPlan:
    """Check ``tool_choice`` against the tools and the server's options, and prepare the
    generation: a guided-decoding schema for a forced call (``params`` is changed), or one
    ``tool_parser`` per choice for ``auto``."""
    named, schema = forced_tool_schema(
        request.tools, request.tool_choice, request.parallel_tool_calls
    )
    if schema is not None:
        if params.guided_decoding is not None:
            raise OpenAIError(
                400,
                f"tool_choice={request.tool_choice!r} cannot be combined with "
                f"response_format or guided decoding",
                param="tool_choice",
            )
        params.guided_decoding = GuidedDecodingParams(json=schema)
    enabled = tool_parser is not None and auto_enabled
    if request.tool_choice == "auto" and not enabled:
        raise OpenAIError(
            400,
            'tool_choice="auto" needs the server started with --enable-auto-tool-choice '
            "and --tool-call-parser; use none, required or a named function",
            param="tool_choice",
        )
    if schema is not None:
        return ToolCallPlan(request, lambda _: ForcedToolCalls(named))
    if tool_parser is None or not enabled or not request.tools:
        return ToolCallPlan(request)
    if request.tool_choice not in (None, "auto"):  # "none"
        return ToolCallPlan(request)
    parsers = [tool_parser(tokenizer) for _ in range(params.n)]
    for parser in parsers:
        request = parser.adjust_request(request)
    params.skip_special_tokens = False  # call markers are often special tokens
    adjusted = request
    return ToolCallPlan(adjusted, lambda index: ParsedToolCalls(parsers[index], adjusted))
