"""Incremental, UTF-8 safe detokenization for streaming, and stop-string matching.

The engine owns one ``IncrementalDetokenizer`` per request and calls ``decode_next`` with
the tokens each step produced; the text it returns is safe to stream: it never ends in the
middle of a character. Each call decodes only a short window of tokens (the
prefix_offset/read_offset technique of HF's ``TextStreamer`` and vLLM), so its cost does
not grow with the length of the output.

Decisions the caller relies on:

- Decoding never applies ``clean_up_tokenization_spaces``: that clean-up rewrites text
  already streamed (" ." -> "."), so vLLM skips it too. For a tokenizer whose
  ``clean_up_tokenization_spaces`` is off, the concatenated deltas equal
  ``tokenizer.decode(output_ids, skip_special_tokens=..., spaces_between_special_tokens=...)``
  for byte-level BPE tokenizers. For SentencePiece-style tokenizers they differ from that
  on purpose in one place: the first output token keeps its leading space, which a
  decode of the output ids alone drops.
- A trailing U+FFFD (an incomplete UTF-8 sequence) is held back, with the text after it,
  until later tokens complete the character; text before it is emitted at once. When the
  request ends, ``flush()`` returns whatever is still held (then as U+FFFD).
- Fast tokenizers ignore ``spaces_between_special_tokens``; it is passed through to
  ``tokenizer.decode`` for the slow ones that honour it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first output token, so that its leading space
# (dropped by SentencePiece decoders when a token is decoded alone) comes out right.
INITIAL_PROMPT_WINDOW = 5
# Settled tokens kept before the window are dropped once there are more than this many.
_TRIM_AFTER = 64


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, one step at a time.

    ``decode_next(ids)`` appends ``ids`` and returns the text they complete;
    ``output_text`` is the concatenation of every delta returned so far (``decode_next``
    and ``flush``). The prompt is not part of the output; only its last
    ``INITIAL_PROMPT_WINDOW`` tokens are kept, as decoding context.
    """

    __slots__ = (
        "_decode_ids",
        "_held_chars",
        "_prefix_len",
        "_prefix_offset",
        "_read_offset",
        "_token_ids",
        "output_text",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = _make_decode(
            tokenizer, skip_special_tokens, spaces_between_special_tokens
        )
        self.output_text = ""
        # _token_ids[_prefix_offset:_read_offset] is context whose text (of length
        # _prefix_len) was already emitted; tokens from _read_offset on are not settled.
        # _held_chars counts characters past the context emitted while the rest of the
        # window still ended in an incomplete character.
        self._token_ids = list(prompt_token_ids[-INITIAL_PROMPT_WINDOW:])
        self._read_offset = len(self._token_ids)
        self._prefix_offset = 0
        prompt_text = self._decode(self._token_ids)
        self._prefix_len = len(prompt_text)
        self._held_chars = 0
        if prompt_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output tokens cannot be aligned after it,
            # so decode them on their own, exactly as decode(output_ids) would.
            self._prefix_offset = self._read_offset
            self._prefix_len = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""

    def decode_next(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the text they complete (possibly "").

        The returned delta never ends inside a character: an incomplete UTF-8 sequence at
        the end of the window is held back until later tokens complete it.
        """
        self._token_ids.extend(new_token_ids)
        text = self._decode(self._token_ids[self._prefix_offset :])
        start = self._prefix_len + self._held_chars
        if text.endswith(REPLACEMENT_CHAR):
            end = len(text.rstrip(REPLACEMENT_CHAR))
            if end <= start:
                return ""
            delta = text[start:end]
            self._held_chars += len(delta)
            self.output_text += delta
            return delta
        if len(text) <= start:
            # Nothing new (e.g. a skipped special token); keep the window so the next
            # token still decodes with its context.
            return ""
        delta = text[start:]
        self._advance()
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Return the text still held back (ending in U+FFFD); call when the request ends."""
        text = self._decode(self._token_ids[self._prefix_offset :])
        delta = text[self._prefix_len + self._held_chars :]
        if delta:
            self._advance()
            self.output_text += delta
        return delta

    def _advance(self) -> None:
        """Make everything decoded so far the new context window."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_len = len(self._decode(self._token_ids[self._prefix_offset :]))
        self._held_chars = 0
        # Tokens before the context are never decoded again; drop them so memory stays
        # bounded by the window rather than the output length.
        if self._prefix_offset > _TRIM_AFTER:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


def _make_decode(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with these options and no clean-up, as one cheap callable.

    A fast tokenizer that keeps transformers' own decode gets the Rust decoder directly
    (what that decode calls, minus ~5 us of Python per call); any other tokenizer, or
    one whose class overrides decoding, goes through ``tokenizer.decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _has_stock_fast_decode(tokenizer):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def _has_stock_fast_decode(tokenizer: Any) -> bool:
    from pagedllm.core.tokenizer import JSONTokenizer

    if type(tokenizer) is JSONTokenizer:  # its decode is the Rust decoder's
        return True
    if "transformers" not in sys.modules:  # (no transformers tokenizer, then)
        return False
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    )


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that the last ``new_char_count`` characters completed.

    A match counts when its end lies within the last ``new_char_count`` characters of
    ``output_text`` (it may start earlier, in text an earlier step added). Among matches
    the one that starts first wins, then the one that ends first, then list order.
    Returns ``(stop_string, length)`` where ``output_text[:length]`` is the text to keep:
    up to the start of the stop string, or up to its end when
    ``include_stop_str_in_output``. Returns None when nothing matched. Empty stop strings
    are ignored.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None
    for stop_str in stop:
        if not stop_str:
            continue
        search_from = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        index = output_text.find(stop_str, search_from)
        if index == -1:
            continue
        candidate = (index, index + len(stop_str), stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    start, end, stop_str = best
    return stop_str, end if include_stop_str_in_output else start


def convert_ids_to_tokens_for_logprobs(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text of each token decoded on its own, for logprobs output (as vLLM shows it).

    Special tokens are shown (not skipped); no clean-up is applied. A token that is only
    part of a UTF-8 character decodes to the tokenizer's replacement, U+FFFD, for byte-level
    BPE tokenizers. SentencePiece decoders drop a lone token's leading space; that is
    what vLLM shows too.
    """
    if not token_ids:
        return []
    singles = [[token_id] for token_id in token_ids]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _has_stock_fast_decode(tokenizer):
        return backend.decode_batch(singles, skip_special_tokens=False)
    return tokenizer.batch_decode(
        singles, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
