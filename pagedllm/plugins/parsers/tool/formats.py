"""The built-in tool parsers: each model family's call syntax (see each class), all
described through :class:`~pagedllm.plugins.parsers.tool.base.DescribedToolParser`."""

# DeepSeek's markers use full-width bars on purpose.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import ast
import json
import random
import re
import string
from typing import Any

from pagedllm.plugins.parsers.tool.base import (
    DescribedToolParser,
    Description,
    call_from_json,
    calls_from_json_text,
    describe_blocks,
    partial_marker,
)

_DECODER = json.JSONDecoder()


def describe_leading(text: str, final: bool, openers: tuple[str, ...], parse: Any) -> Description:
    """Calls that make up the whole output when it (after whitespace) starts with one of
    ``openers``; otherwise the output is content."""
    description = Description()
    stripped = text.lstrip()
    if not any(stripped.startswith(o) for o in openers):
        if not final and stripped and any(o.startswith(stripped) for o in openers):
            return description  # may still become a call
        description.add_text(text)
        return description
    if not final:
        return description  # calls are complete only at the end of the output
    calls = parse(stripped)
    if calls is None:
        description.add_text(text)
    else:
        description.items.extend(calls)
    return description


def describe_runs(text: str, final: bool, marker: str, parse: Any) -> Description:
    """Calls each introduced by ``marker`` and running to the next one (or the end)."""
    description = Description()
    first = text.find(marker)
    if first < 0:
        tail = text if final else text[: len(text) - partial_marker(text, [marker])]
        description.add_text(tail)
        return description
    description.add_text(text[:first])
    bodies = text[first + len(marker) :].split(marker)
    complete = bodies if final else bodies[:-1]
    for body in complete:
        calls = parse(body.strip())
        if calls is None:
            description.add_text(marker + body)
        else:
            description.items.extend(calls)
    return description


def json_sequence(text: str, separators: str = ";") -> list[tuple[str, str]] | None:
    """JSON call objects one after another (optionally separated, e.g. by ';')."""
    calls, position = [], 0
    while position < len(text):
        try:
            value, end = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        call = call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        position = end
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
    return calls or None


def python_calls(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g(b="x")]`` (or one call without brackets): keyword arguments that
    are Python literals become a JSON object."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        if None in arguments:
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


class HermesToolParser(DescribedToolParser):
    """Hermes 2 Pro, Qwen2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks; the text around them is content."""

    def describe(self, text, final):
        return describe_blocks(text, final, "<tool_call>", "</tool_call>")


class MistralToolParser(DescribedToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls, or (newer tokenizers)
    ``[TOOL_CALLS]name[ARGS]{...}`` per call. Call ids are 9 alphanumeric characters, as
    Mistral's chat templates require."""

    MARKER = "[TOOL_CALLS]"

    def make_call_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def describe(self, text, final):
        first = text.find(self.MARKER)
        if first >= 0 and text[first + len(self.MARKER) :].lstrip().startswith("["):
            return describe_blocks(text, final, self.MARKER, None)
        return describe_runs(text, final, self.MARKER, _mistral_named_call)


def _mistral_named_call(body: str) -> list[tuple[str, str]] | None:
    name, sep, arguments = body.partition("[ARGS]")
    if not sep:
        brace = body.find("{")
        if brace <= 0:
            return None
        name, arguments = body[:brace], body[brace:]
    call = call_from_json({"name": name.strip(), "arguments": _json_or_none(arguments)})
    return None if call is None or not name.strip() else [call]


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class Llama3JsonToolParser(DescribedToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole output is ``{"name": ...,
    "parameters": {...}}`` (several separated by ``;``), optionally after
    ``<|python_tag|>``."""

    OPENERS: tuple[str, ...] = ("{", "<|python_tag|>")
    TAGS: tuple[str, ...] = ("<|python_tag|>",)

    def describe(self, text, final):
        return describe_leading(text, final, self.OPENERS, self._parse)

    def _parse(self, text: str):
        for tag in self.TAGS:
            text = text.replace(tag, "")
        return json_sequence(text.strip())


class Llama4JsonToolParser(Llama3JsonToolParser):
    """Llama 4 with JSON tool calling: as Llama 3, also wrapped in
    ``<|python_start|> ... <|python_end|>``."""

    OPENERS = ("{", "<|python_tag|>", "<|python_start|>")
    TAGS = ("<|python_tag|>", "<|python_start|>", "<|python_end|>")


class PythonicToolParser(DescribedToolParser):
    """Pythonic calls (Llama 3.2, ToolACE): the whole output is
    ``[get_weather(city="Paris"), get_time(zone="UTC")]``."""

    OPENERS: tuple[str, ...] = ("[",)

    def describe(self, text, final):
        return describe_leading(text, final, self.OPENERS, self._parse)

    def _parse(self, text: str):
        return python_calls(text)


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4: pythonic calls, possibly inside ``<|python_start|> ... <|python_end|>``."""

    OPENERS = ("[", "<|python_start|>")

    def _parse(self, text: str):
        text = text.replace("<|python_start|>", "").replace("<|python_end|>", "")
        return python_calls(text)


class GraniteToolParser(DescribedToolParser):
    """IBM Granite 3.x: ``<|tool_call|>`` (or ``<tool_call>``) then a JSON list of calls
    to the end of the output."""

    MARKERS = ("<|tool_call|>", "<tool_call>")

    def describe(self, text, final):
        for marker in self.MARKERS:
            if marker in text:
                return describe_blocks(text, final, marker, None)
        description = Description()
        description.add_text(
            text if final else text[: len(text) - partial_marker(text, self.MARKERS)]
        )
        return description


class Granite20bFCToolParser(DescribedToolParser):
    """Granite 20B function calling: ``<function_call> {"name": ..., "arguments": ...}``
    per call."""

    def describe(self, text, final):
        return describe_runs(text, final, "<function_call>", calls_from_json_text)


class InternLMToolParser(DescribedToolParser):
    """InternLM2: ``<|action_start|><|plugin|>{"name": ..., "parameters": ...}
    <|action_end|>``."""

    def describe(self, text, final):
        return describe_blocks(text, final, "<|action_start|><|plugin|>", "<|action_end|>")


class JambaToolParser(DescribedToolParser):
    """AI21 Jamba: ``<tool_calls>[{"name": ..., "arguments": ...}]</tool_calls>``."""

    def describe(self, text, final):
        return describe_blocks(text, final, "<tool_calls>", "</tool_calls>")


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n"
    r"```(?:json)?\n(?P<arguments>.*?)\n```\s*<｜tool▁call▁end｜>",
    re.S,
)


def _deepseek_calls(body: str) -> list[tuple[str, str]] | None:
    calls = []
    rest = _DEEPSEEK_CALL.sub("", body).strip()
    for match in _DEEPSEEK_CALL.finditer(body):
        call = call_from_json(
            {"name": match["name"].strip(), "arguments": _json_or_none(match["arguments"])}
        )
        if call is None:
            return None
        calls.append(call)
    return calls if calls and not rest else None


class DeepSeekV3ToolParser(DescribedToolParser):
    """DeepSeek-V3: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>
    function<｜tool▁sep｜>NAME`` and the arguments in a fenced json block, closed by
    ``<｜tool▁call▁end｜>``, and ``<｜tool▁calls▁end｜>``."""

    def describe(self, text, final):
        return describe_blocks(
            text, final, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek_calls
        )


class Phi4MiniJsonToolParser(DescribedToolParser):
    """Phi-4-mini: ``functools[{"name": ..., "arguments": {...}}, ...]``."""

    def describe(self, text, final):
        return describe_blocks(text, final, "functools", None)
