"""Chat templates rendered without transformers.

Renders a Hugging Face chat template (Jinja) the way transformers' ``apply_chat_template``
does (transformers 5): the same sandboxed environment (``trim_blocks``, ``lstrip_blocks``,
loop controls, the ``generation`` block tag, a ``tojson`` that keeps non-ASCII text,
``raise_exception``, ``strftime_now``, a ``namespace`` that refuses underscore names),
messages normalised the same way (``None`` fields dropped, reasoning aliased as
``reasoning_content`` and ``thinking``, everything rebuilt from plain JSON types), the
tokenizer's named special tokens as variables, and ``continue_final_message`` cutting the
text after the final message. :class:`pagedllm.core.tokenizer.JSONTokenizer` renders
with it; tests compare it with transformers on real templates.

The server bounds rendering in size and time: :mod:`pagedllm.entrypoints.openai.template_guard`
installs a :data:`guard` that compiles into its checked environment while a request renders.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["build_environment", "compile_template", "render_chat_template", "select_template"]

# Set by the server's template guard: ``guard(source)`` returns the template compiled in
# its checked environment while the calling thread renders within limits, else None.
guard: Callable[[str], Any] | None = None

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message's text to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
    masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # (Jinja's own tojson escapes HTML characters; templates expect plain JSON.)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without the dict type's own attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names (no way to CPython's
    internals through attribute names)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # (Namespace's own signature)
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace "
                f"({name!r})"
            )


def build_environment(
    cls: type[ImmutableSandboxedEnvironment] = ImmutableSandboxedEnvironment,
    wrap_filter: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None,
) -> ImmutableSandboxedEnvironment:
    """The chat-template environment, of class ``cls``; ``wrap_filter(name, fn)``, if
    given, wraps every filter (the guard's size checks)."""
    env = cls(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    if wrap_filter is not None:
        env.filters.update({name: wrap_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=64)
def _compile_plain(source: str) -> jinja2.Template:
    return _plain_environment().from_string(source)


@functools.cache
def _plain_environment() -> ImmutableSandboxedEnvironment:
    return build_environment()


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled (cached), in the guard's environment when one applies."""
    if guard is not None:
        guarded = guard(source)
        if guarded is not None:
            return guarded
    return _compile_plain(source)


def select_template(
    own: str | dict[str, str] | None, requested: str | None, tools: list | None
) -> str:
    """The template to render: ``requested`` (a template, or the name of one of the
    tokenizer's named templates), else the tokenizer's own (its ``tool_use`` template
    when there are tools and it has one, else ``default``)."""
    if isinstance(own, dict):
        if requested is not None:
            return own.get(requested, requested)
        if tools is not None and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(
            f"the tokenizer has several chat templates and none is the default; name one "
            f"of {sorted(own)}"
        )
    if requested is not None:
        return requested
    if own is None:
        raise ValueError("the tokenizer has no chat template; pass one")
    return own


def _as_dicts(value: Any) -> Any:
    """Message objects (pydantic models, dataclasses) as dicts, recursively."""
    if isinstance(value, Mapping):
        return {key: _as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (what a sandboxed template may see);
    anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if callable(getattr(value, "item", None)) and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: list[Any],
    *,
    special_tokens: Mapping[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The text of ``messages`` under ``template`` (a template's source).

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are template variables, which
    ``kwargs`` may override. ``continue_final_message`` (or the name of the final
    message's field to continue) ends the text where that message's text ends.
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    chat = []
    for message in _as_dicts(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat.append({key: value for key, value in message.items() if value is not None})
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be set: one "
            "continues the final message, the other starts a new assistant message"
        )
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError(f"tools must be JSON schemas (dicts), got {tool!r}")
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("documents must be dicts with 'title' and 'text' keys")
    variables = _plain({**(special_tokens or {}), **kwargs})
    chat = _alias_reasoning(_plain(chat))
    final_text = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = chat[-1].get(field)
        if final_text is None:
            raise ValueError(
                f"continue_final_message: the final message has no {field!r} to continue"
            )
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_text]
        if not any(f in template for f in fields):
            raise ValueError(
                f"continue_final_message: the chat template never reads the field {field!r}"
            )
        if isinstance(final_text, (list, tuple)):
            for block in reversed(final_text):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message: the final message has no text to continue"
                )
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = compile_template(template).render(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if final_text is not None:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in text or tag not in text:
            raise ValueError(
                "continue_final_message: the final message does not appear in the text the "
                "chat template made (the template removes part of it)"
            )
        at = text.rindex(tag)
        if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            text = text[:at]
        else:  # the template trimmed the message's trailing spaces
            text = text[:at].rstrip()
    return text
