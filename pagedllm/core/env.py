"""Numbers that environment variables set (``PAGEDLLM_*`` limits and sizes): a value that
does not parse, or is out of range, is a :class:`ConfigError` naming the variable."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from pagedllm.core.errors import ConfigError

N = TypeVar("N", int, float)


def env_number(
    name: str,
    default: N,
    expected: str,
    *,
    parse: Callable[[str], N],
    minimum: N,
    exclusive: bool = False,
    env: Mapping[str, str] = os.environ,
) -> N:
    """The number ``name`` sets in ``env`` (``default`` where unset or blank): at least
    ``minimum`` (above it when ``exclusive``), else a ConfigError saying to give
    ``expected`` (e.g. "a number of seconds above 0")."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    # (written so that NaN, which compares false, is refused)
    if value is None or not (value > minimum if exclusive else value >= minimum):
        raise ConfigError(f"{name}={text!r}: give {expected}")
    return value
