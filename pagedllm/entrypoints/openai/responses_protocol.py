"""The Responses API's request (``POST /v1/responses``) and its translation into the chat
request it is served as: ``input`` items into messages, Responses-style function tools and
``tool_choice`` into chat ones, ``text.format`` into ``response_format``.

Output items (reasoning, message, function call) are built by :mod:`.serving_responses`;
a stored response's output becomes messages again with :func:`output_messages`, so that
``previous_response_id`` continues the conversation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIModel,
    check_request_id,
)

# OpenAI's limits on ``metadata``.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(OpenAIModel):
    """``POST /v1/responses``. Fields of the OpenAI API that pagedllm cannot honour are
    refused by name (hosted tools, ``truncation="auto"``, ``include``); unknown ones are
    ignored and named, as on the other routes."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0)
    # vLLM's extras
    request_id: str | None = None
    priority: int = 0
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: str | None) -> str | None:
        return check_request_id(value, "request_id")

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters")
            if len(item) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE} characters"
                )
        return value

    @model_validator(mode="after")
    def _refuse_unserved(self) -> ResponsesRequest:
        if self.truncation == "auto":
            raise ValueError(
                'truncation="auto" (dropping the start of the conversation) is not supported; '
                'a conversation longer than the context is refused with truncation="disabled"'
            )
        if self.include:
            raise ValueError(
                f"include: {self.include} is not supported (pagedllm returns no extra output "
                f"data in responses)"
            )
        if self.top_logprobs:
            raise ValueError("top_logprobs: log probabilities are not returned by /v1/responses")
        if self.background and not self.store:
            raise ValueError("background responses need store=true (they are fetched by id)")
        if self.background and self.stream:
            raise ValueError("background: streaming a background response is not supported")
        return self

    def ignored_fields(self) -> list[str]:
        ignored = super().ignored_fields()
        if isinstance(self.text, dict):
            ignored += [f"text.{key}" for key in sorted(self.text) if key != "format"]
        return ignored

    def text_format(self) -> dict[str, Any]:
        """``text.format``, OpenAI's default (plain text) when not given."""
        text_format = (self.text or {}).get("format")
        if text_format is None:
            return {"type": "text"}
        if not isinstance(text_format, dict):
            raise ValueError("text.format must be an object")
        return text_format

    def chat_request(
        self, history: list[dict[str, Any]], auto_tools: bool
    ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this response is served as, and the conversation's messages
        (``history`` from ``previous_response_id``, then this input; without the
        ``instructions``, which apply to this response only)."""
        conversation = [*history, *input_messages(self.input)]
        messages = list(conversation)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        tools = chat_tools(self.tools)
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": tools,
            "tool_choice": chat_tool_choice(self.tool_choice, tools, auto_tools),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": chat_response_format(self.text_format()),
            "stream": self.stream,
            "user": self.user,
            "priority": self.priority,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        request = ChatCompletionRequest.model_validate(
            {key: value for key, value in fields.items() if value is not None}
        )
        return request, conversation


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}[{j}] of type {kind!r} is not supported (text parts only: "
                f"{', '.join(_TEXT_PARTS)})"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``: a string is one user message; items are
    messages, function calls (the assistant's tool calls) and their outputs (tool
    messages). Reasoning items are dropped, as chat templates drop past reasoning."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValueError(f"{where}.role {role!r} is invalid (expected one of {_ROLES})")
            messages.append(
                {"role": role, "content": _text_of(item.get("content"), where + ".content")}
            )
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.call_id is missing")
            output = _text_of(item.get("output"), where + ".output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise ValueError(
                f"{where}: item type {kind!r} is not supported (use message, function_call, "
                f"function_call_output or reasoning)"
            )
    if not messages:
        raise ValueError("input holds no message")
    return messages


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ValueError(f"{where}.{key} must be a string")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) as
    chat tools; hosted tools (web search, file search, ...) are refused."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ValueError(
                f"tools[{i}]: tool type {kind!r} is not supported (only function tools; "
                f"hosted tools such as web_search run nowhere here)"
            )
        function = {
            key: tool[key]
            for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None
        }
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None, auto_tools: bool) -> Any:
    """``tool_choice`` as chat spells it. Unset, it is OpenAI's default (``auto``) where the
    server parses the model's own calls (``--enable-auto-tool-choice``), else none."""
    if choice is None:
        return "auto" if tools and auto_tools else None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError(
                'tool_choice must be none, auto, required or {"type": "function", "name": ...}'
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text_format: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = text_format.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("text.format json_schema needs a 'schema' object")
        spec = {"name": text_format.get("name") or "response", "schema": schema}
        if text_format.get("strict") is not None:
            spec["strict"] = text_format["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise ValueError(
        f"text.format type {kind!r} is not supported (use text, json_object or json_schema)"
    )


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the messages that continue its conversation."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            messages.extend(input_messages([item]))
    # (A message and calls from one reply are one assistant turn.)
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if (
            previous is not None
            and previous["role"] == "assistant"
            and message["role"] == "assistant"
        ):
            calls = [*previous.get("tool_calls", []), *message.get("tool_calls", [])]
            if calls:
                previous["tool_calls"] = calls
            if message.get("content"):
                previous["content"] = (previous.get("content") or "") + message["content"]
        else:
            merged.append(dict(message))
    return merged
