"""OpenAI's deprecated function calling (``functions`` / ``function_call``), as clients
written for it still send it: served as tools with one call per turn, and answered in its
own shape (``message.function_call``, ``delta.function_call``, finish reason
``function_call``). Its messages (an assistant turn's ``function_call``, a ``function``
role's result) are read as a tool call and its tool result.
"""

from __future__ import annotations

from typing import Any

LEGACY_FIELDS = ("functions", "function_call")


def uses_functions(data: dict[str, Any]) -> bool:
    """Whether a chat request body asks for calls the deprecated way."""
    return any(name in data for name in LEGACY_FIELDS)


def functions_as_tools(data: dict[str, Any]) -> dict[str, Any]:
    """The body with ``functions``/``function_call`` as ``tools``/``tool_choice`` (one
    call at most: the reply has room for one ``function_call``)."""
    if "tools" in data or "tool_choice" in data:
        raise ValueError("give either functions/function_call or tools/tool_choice, not both")
    if data.get("parallel_tool_calls"):
        raise ValueError(
            "parallel_tool_calls: functions/function_call make one call per turn; use tools "
            "for parallel calls"
        )
    data = dict(data, parallel_tool_calls=False)
    functions = data.pop("functions", None)
    if functions is not None:
        if not isinstance(functions, list):
            raise ValueError("functions must be a list of function definitions")
        data["tools"] = [{"type": "function", "function": f} for f in functions]
    choice = data.pop("function_call", None)
    if isinstance(choice, dict):
        choice = {"type": "function", "function": choice}
    if choice is not None:
        data["tool_choice"] = choice
    return data


def function_messages_as_tools(messages: Any) -> Any:
    """``messages`` with a deprecated ``function_call`` on an assistant turn as its
    ``tool_calls``, and a ``function`` role's result as the ``tool`` result of the latest
    call of that name (chat templates know only tools)."""
    if not isinstance(messages, list) or not any(
        isinstance(m, dict) and (m.get("role") == "function" or "function_call" in m)
        for m in messages
    ):
        return messages
    out: list[Any] = []
    call_ids: dict[str, str] = {}
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = dict(message)
        call = message.pop("function_call", None)
        if call is not None and message.get("role") == "assistant":
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"messages[{index}].function_call needs a 'name'")
            call_id = call_ids[call["name"]] = f"call_{index}"
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": call}]
        elif call is not None:
            raise ValueError(f"messages[{index}].function_call belongs on an assistant message")
        if message.get("role") == "function":
            name = message.get("name")
            if not isinstance(name, str):
                raise ValueError(f"messages[{index}] (role function) needs the function's 'name'")
            message["role"] = "tool"
            message["tool_call_id"] = call_ids.get(name, f"call_{index}")
        out.append(message)
    return out


def as_function_call(delta: dict[str, Any], finish_reason: str | None) -> tuple[dict, str | None]:
    """A chat delta and finish reason in the deprecated shape: the (one) tool call as
    ``function_call`` (its name, once, and the arguments' text), ``function_call`` for
    ``tool_calls``."""
    calls = delta.pop("tool_calls", None)
    if calls:
        function = calls[0].get("function") or {}
        delta["function_call"] = {k: function[k] for k in ("name", "arguments") if k in function}
    if finish_reason == "tool_calls":
        finish_reason = "function_call"
    return delta, finish_reason
