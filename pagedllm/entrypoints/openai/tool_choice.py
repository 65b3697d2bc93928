"""``tool_choice`` ``"required"`` and a named function: enforced with guided decoding, so
the output always parses into calls of the offered tools.

A named function's output is its arguments object (its ``parameters`` schema); ``required``
outputs a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one of the offered
tools each (at most one when ``parallel_tool_calls`` is false).
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.core.interfaces import ToolCall, new_tool_call_id
from pagedllm.entrypoints.openai.errors import OpenAIError

_ANY_OBJECT = {"type": "object"}


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
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
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
                    "parameters": function.get("parameters", _ANY_OBJECT),
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
        return name, functions[name].get("parameters", _ANY_OBJECT)
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
