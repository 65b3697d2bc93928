"""Parsers of option values given on the command line (``arg(parse=...)``)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_HUMAN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600; plain integers as they are."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected an integer, optionally with a k/m/g/K/M/G suffix, got {text!r}"
        )
    number, suffix = match.groups()
    value = float(number) * _HUMAN_SUFFIXES.get(suffix, 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def json_or_key_values(text: str) -> dict[str, Any]:
    """A JSON object, or the older ``image=16,video=2`` form (integer values)."""
    if text.lstrip().startswith("{") or "=" not in text:
        return json_dict(text)
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a JSON object or KEY=INTEGER items separated by commas, got {text!r}"
            ) from None
        if not key.strip():
            raise argparse.ArgumentTypeError(f"an item of {text!r} has no key")
    return out


def optional_str(text: str) -> str | None:
    """``None``/``none`` on the command line means no value."""
    return None if text in ("None", "none", "") else text


def optional_int(text: str) -> int | None:
    return None if text in ("None", "none") else int(text)
