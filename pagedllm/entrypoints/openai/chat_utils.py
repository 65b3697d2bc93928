"""Rendering chat messages with a chat template (``--chat-template``,
``--chat-template-content-format``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.openai.chat_images import IMAGE_PART_TYPES

_ROLES = {"system", "user", "assistant", "tool", "developer"}
# A template that loops over a message's content expects OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"{%-?\s*for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content\b)")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, or the template itself in one line."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(token in value for token in ("{{", "{%")):
        # Inline templates written on one line use escaped newlines.
        return value.encode().decode("unicode_escape")
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a jinja template")


def detect_content_format(template: str | None) -> str:
    """``auto``: ``openai`` when the template iterates over message content, else
    ``string``."""
    if template and _LOOPS_OVER_CONTENT.search(template):
        return "openai"
    return "string"


def normalise_messages(messages: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """Validated copies of ``messages`` with content in the template's format."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(
                f"messages[{i}].role {role!r} is invalid (expected one of {sorted(_ROLES)})"
            )
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts: list[dict[str, str]] = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind in IMAGE_PART_TYPES:
                    if content_format == "string":
                        raise ValueError(
                            f"messages[{i}].content[{j}]: an image part needs a chat template "
                            "that takes a list of content parts (--chat-template-content-format "
                            "openai)"
                        )
                    # (what Hugging Face processors' chat templates expect)
                    parts.append({"type": "image"})
                    continue
                if kind != "text":
                    raise ValueError(
                        f"messages[{i}].content[{j}] of type {kind!r} is not supported "
                        f"(valid: text, {', '.join(IMAGE_PART_TYPES)})"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
                parts.append({"type": "text", "text": part["text"]})
            if content_format == "string":
                message["content"] = "\n".join(part["text"] for part in parts)
            else:
                message["content"] = parts
        elif isinstance(content, str):
            if content_format == "openai":
                message["content"] = [{"type": "text", "text": content}]
        elif content is not None:
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        elif role not in ("assistant",):
            raise ValueError(f"messages[{i}].content is required for role {role!r}")
        else:
            # An assistant turn that only called tools: templates expect a string.
            message["content"] = "" if content_format == "string" else []
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_tool_call(i, call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _template_tool_call(index: int, call: Any) -> dict[str, Any]:
    """A tool call as chat templates read it: JSON-string arguments become a dict (as
    Hugging Face templates expect), and ``name``/``arguments`` sit on ``function``."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"messages[{index}].tool_calls entries need a 'function' object")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(
                f"messages[{index}].tool_calls arguments are not valid JSON: {arguments!r}"
            ) from None
    return {**call, "function": function}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    template: str | None,
    content_format: str,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages``."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; the server runs with --skip-tokenizer-init")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model has no chat template; start the server with --chat-template, or use "
            "the completions API"
        )
    if content_format == "auto":
        content_format = detect_content_format(template or tokenizer.chat_template)
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"messages", "conversation", "chat_template", "tokenize"} & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {sorted(reserved)}")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message")
    try:
        return tokenizer.apply_chat_template(
            normalise_messages(messages, content_format),
            chat_template=template,
            tools=tools,
            documents=documents,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except ValueError:
        raise
    except Exception as exc:  # jinja errors: the request's messages do not fit the template
        raise ValueError(f"the chat template failed on these messages: {exc}") from exc
