"""Pieces the built-in guided-decoding backends share."""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _gpt2_unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character map (byte-level BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes_vocabulary(tokenizer: Any, skip: set[int]) -> dict[bytes, list[int]]:
    """Each token's text as bytes -> its ids, for regex-over-bytes indexes.

    Byte-level BPE tokens map back through GPT-2's byte alphabet; SentencePiece byte
    tokens (``<0xNN>``) are their byte, ``▁`` is a space; special tokens and ``skip``
    (the end-of-sequence ids, which the index adds itself) are left out."""
    unicode_to_bytes = _gpt2_unicode_to_bytes()
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = tokenizer.get_vocab()
    byte_level = _is_byte_level(tokenizer, vocab)
    vocabulary: dict[bytes, list[int]] = {}
    for token, token_id in vocab.items():
        if token_id in skip or token_id in specials:
            continue
        if _BYTE_TOKEN.match(token):
            data = bytes([int(token[3:5], 16)])
        elif byte_level and all(c in unicode_to_bytes for c in token):
            data = bytes(unicode_to_bytes[c] for c in token)
        else:
            data = token.replace(_SPIECE_SPACE, " ").encode("utf-8")
        if data:
            vocabulary.setdefault(data, []).append(token_id)
    return vocabulary


def _is_byte_level(tokenizer: Any, vocab: dict[str, int]) -> bool:
    """Whether tokens are spelled in GPT-2's byte alphabet (byte-level BPE)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        return "ByteLevel" in str(decoder)
    return any(token.startswith("\u0120") for token in vocab)


# The schema of OpenAI's ``response_format`` ``json_object``: any object (never an array
# or a scalar at the top).
JSON_OBJECT = {"type": "object"}


def choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


def without_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object that does not say otherwise forbids
    properties it does not list (``--guided-decoding-disable-additional-properties``)."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema
