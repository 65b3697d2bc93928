"""Prompt forms accepted by ``LLM.generate`` and the engine."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
