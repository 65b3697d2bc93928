"""Reasoning parsers for models that put their reasoning between two markers:
``<think> ... </think>`` (DeepSeek-R1, Qwen3) or Granite's "Here is my thought
process: ... Here is my response:".

One splitting function serves both ways of parsing: a complete output is split once; a
stream is split again at each delta and what grew is sent, holding back a tail that may
be the start of a marker, so the concatenated deltas equal the complete result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pagedllm.core.interfaces import DeltaMessage, ReasoningParser


class MarkerReasoningParser(ReasoningParser):
    """Reasoning opens with one of ``start_markers`` and ends with one of
    ``end_markers``. ``starts_in_reasoning``: the output begins inside the reasoning (the
    chat template wrote the opening marker into the prompt), so no opening marker is
    expected; ``starts_after_reasoning``: the template wrote a closed section (thinking
    off), so the output is all content. :meth:`for_prompt` sets both from the prompt."""

    start_markers: ClassVar[tuple[str, ...]] = ()
    end_markers: ClassVar[tuple[str, ...]] = ()
    # Whether an output with no marker at all is reasoning (R1 always reasons).
    unmarked_is_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._sent_reasoning = ""
        self._sent_content = ""

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether ``prompt`` ends inside an opened reasoning section."""
        tail = prompt.rstrip()
        return any(tail.endswith(m) for m in self.start_markers)

    def prompt_closes_reasoning(self, prompt: str) -> bool:
        """Whether ``prompt`` ends just after a closing marker."""
        tail = prompt.rstrip()
        return any(tail.endswith(m) for m in self.end_markers)

    def opening_token_sequences(self) -> tuple[tuple[int, ...], ...] | None:
        """Each opening marker's tokens (``<think>`` is one token in the models that use
        it, several in others: SmolLM2 reads ``<``, ``think``, ``>``); None when the
        output's role is known from the prompt, or when any output opens the reasoning
        (``unmarked_is_reasoning``)."""
        if self.starts_in_reasoning or self.starts_after_reasoning or self.unmarked_is_reasoning:
            return None
        encoded = {
            tuple(self.tokenizer.encode(marker, add_special_tokens=False))
            for marker in self.start_markers
        }
        return tuple(sorted(s for s in encoded if s)) or None

    # ------------------------------------------------------------------ splitting

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text``. With ``final`` False, a tail that could
        still become a marker is left out of both."""
        if self.starts_after_reasoning:
            return "", text
        in_reasoning = self.starts_in_reasoning or self.unmarked_is_reasoning
        body_start = 0
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        for marker in self.start_markers:
            if stripped.startswith(marker):
                in_reasoning, body_start = True, lead + len(marker)
                break
        else:
            if not final and stripped and any(m.startswith(stripped) for m in self.start_markers):
                return "", ""  # may still become an opening marker
        if not in_reasoning:
            return "", text
        end, end_marker = _first(text, self.end_markers, body_start)
        if end < 0:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - _partial_suffix(body, self.end_markers)]
            if self.unmarked_is_reasoning or self.starts_in_reasoning or body_start:
                return body, ""
            return "", body
        return text[body_start:end], text[end + len(end_marker) :]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        if self.starts_after_reasoning:
            return True
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        reasoning, _content = self.split(text, final=False)
        in_reasoning = self.starts_in_reasoning or self.unmarked_is_reasoning
        if not in_reasoning and not reasoning:
            # The prompt says nothing and no reasoning so far: it has "ended" once the
            # output cannot be an opening marker (never for an empty output).
            stripped = text.lstrip()
            return bool(stripped) and not any(m.startswith(stripped) for m in self.start_markers)
        return _first(text, self.end_markers, 0)[0] >= 0

    def extract_reasoning_content(
        self, model_output: str, request: Any
    ) -> tuple[str | None, str | None]:
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        return self._advance(*self.split(current_text, final=False))

    def flush_streaming(self, final_text: str) -> DeltaMessage | None:
        """At the end of a stream: what was held back as a possible marker."""
        return self._advance(*self.split(final_text, final=True))

    def _advance(self, reasoning: str, content: str) -> DeltaMessage | None:
        new_reasoning = reasoning[len(self._sent_reasoning) :]
        new_content = content[len(self._sent_content) :]
        self._sent_reasoning = max(reasoning, self._sent_reasoning, key=len)
        self._sent_content = max(content, self._sent_content, key=len)
        if not new_reasoning and not new_content:
            return None
        return DeltaMessage(content=new_content or None, reasoning_content=new_reasoning or None)


def _first(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str]:
    """The earliest occurrence of any marker at or after ``start``: (index, marker)."""
    best, found = -1, ""
    for marker in markers:
        index = text.find(marker, start)
        if index >= 0 and (best < 0 or index < best):
            best, found = index, marker
    return best, found


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                longest = max(longest, size)
                break
    return longest


class DeepSeekR1ReasoningParser(MarkerReasoningParser):
    """DeepSeek-R1: its template opens ``<think>`` in the prompt, so an output with no
    marker is all reasoning."""

    start_markers = ("<think>",)
    end_markers = ("</think>",)
    unmarked_is_reasoning = True


class Qwen3ReasoningParser(MarkerReasoningParser):
    """Qwen3: ``<think> ... </think>`` when thinking; plain content when thinking is off
    (``enable_thinking=False``), unless the prompt already opened ``<think>``."""

    start_markers = ("<think>",)
    end_markers = ("</think>",)


class GraniteReasoningParser(MarkerReasoningParser):
    """IBM Granite 3.x with ``thinking=True``: plain-text section headers."""

    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
