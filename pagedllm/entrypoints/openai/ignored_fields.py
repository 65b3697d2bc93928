"""Unknown request fields: ignored, as vLLM does, but never silently. The log warns of
each field name once; the server names a response's ignored fields in a header."""

from __future__ import annotations

import logging

from pagedllm.entrypoints.openai.protocol import IGNORED_FIELD_NOTES, OpenAIModel
from pagedllm.entrypoints.openai.request_log import for_log

# Names the unknown (ignored) top-level fields of a request body, comma-separated.
IGNORED_FIELDS_HEADER = "x-pagedllm-ignored-fields"
# Bounds on what clients' field names can make the server remember and send.
_MAX_WARNED_NAMES = 1024
_MAX_HEADER_CHARS = 2048

_warned: set[str] = set()


def warn_ignored(body: OpenAIModel, logger: logging.Logger) -> list[str]:
    """The body's ignored fields (sorted); the first time a name is seen it is warned of."""
    ignored = body.ignored_fields()
    new = [name for name in ignored if name not in _warned]
    if new and len(_warned) < _MAX_WARNED_NAMES:
        _warned.update(new)
        described = ", ".join(
            for_log(name)
            + (f" ({IGNORED_FIELD_NOTES[name]})" if name in IGNORED_FIELD_NOTES else "")
            for name in new
        )
        logger.warning(
            "ignored request fields pagedllm does not support: %s (each is warned of once; "
            "responses name them in the %s header)",
            described,
            IGNORED_FIELDS_HEADER,
        )
    return ignored


def header_value(names: list[str]) -> str:
    """``names`` as a header value: ASCII without controls or commas inside a name, and
    bounded in length."""
    escaped = [for_log(name).replace(",", "\\x2c") for name in names]
    value = ",".join(name.encode("ascii", "backslashreplace").decode() for name in escaped)
    if len(value) > _MAX_HEADER_CHARS:
        value = value[:_MAX_HEADER_CHARS].rpartition(",")[0] + ",..."
    return value
