"""Requests to prompts: chat templates rendered and text tokenized on worker threads,
never on the event loop, within limits checked before the work starts.

A prompt longer than ``max_model_len`` tokens is refused anyway; one of more than
``max_model_len`` times the longest token's length in characters cannot be shorter, so
it is refused by its length alone, before any tokenizing. A chat template renders
within the same number of characters and a time limit (see :mod:`.template_guard`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pagedllm.entrypoints.media import LoadedImage
from pagedllm.entrypoints.openai.chat_images import IMAGE_PART_TYPES
from pagedllm.entrypoints.openai.chat_utils import render_chat
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")

logger = logging.getLogger("pagedllm.server")

# How long a chat template may take to render, in seconds.
TEMPLATE_TIMEOUT = 5.0
# Threads preparing prompts (work holds the GIL only in part: tokenizers run in Rust).
PREPARE_WORKERS = 4


@dataclasses.dataclass(slots=True)
class PreparedPrompt:
    text: str | None
    token_ids: list[int]
    # The prompt's images, in order, and their content hashes (engine prompt keys
    # multi_modal_data and multi_modal_uuids, as vLLM's).
    images: list[LoadedImage] = dataclasses.field(default_factory=list)
    # The multimodal processor's options (engine prompt key mm_processor_kwargs).
    mm_processor_kwargs: dict[str, Any] | None = None

    def engine_prompt(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids, "prompt": self.text}
        if self.images:
            prompt["multi_modal_data"] = {"image": [item.image for item in self.images]}
            prompt["multi_modal_uuids"] = {"image": [item.hash for item in self.images]}
        if self.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = self.mm_processor_kwargs
        return prompt


class PromptPreparer:
    """Renders, tokenizes and checks prompts for the OpenAI handlers."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        *,
        chat_template: str | None,
        content_format: str,
        template_timeout: float = TEMPLATE_TIMEOUT,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self.content_format = content_format
        self.template_timeout = template_timeout
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=PREPARE_WORKERS, thread_name_prefix="pagedllm-prompt"
        )

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt of ``max_model_len`` tokens can have. Worked out
        on first use (the warm-up's, off the start: listing the vocabulary takes 25 ms)."""
        longest_token = 1
        if self.tokenizer is not None:
            longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return self.max_model_len * max(longest_token, 1)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a prompt thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ checks

    def check_text_size(self, size: int, param: str) -> None:
        if size > self.max_prompt_chars:
            raise OpenAIError(
                400,
                f"the {param} is {size} characters long: longer than this model's maximum "
                f"context ({self.max_model_len} tokens of at most "
                f"{self.max_prompt_chars // self.max_model_len} characters) could hold",
                param=param,
            )

    def check_token_ids(self, token_ids: list[Any], param: str) -> None:
        # Checked before decoding: the tokenizer overflows on ids beyond a C long.
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(
                400,
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )

    # ------------------------------------------------------------------ prompts

    def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, "the server runs with --skip-tokenizer-init: send token ids")
        self.check_text_size(len(text), param)
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def completion_prompts(self, request: CompletionRequest) -> list[PreparedPrompt]:
        """The request's prompts (one or several), tokenized and truncated."""
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        for item in items:  # every prompt is checked before any is tokenized
            if isinstance(item, str):
                self.check_text_size(len(item), "prompt")
            else:
                self.check_token_ids(item, "prompt")
        keep = request.truncate_prompt_tokens
        self._check_truncation(keep)
        prepared = []
        for item in items:
            if isinstance(item, str):
                token_ids = self.tokenize(item, request.add_special_tokens)
                prepared.append(self._truncate(PreparedPrompt(item, token_ids), keep))
            else:
                token_ids = list(item)[-keep:] if keep else list(item)
                prepared.append(PreparedPrompt(self._decode(token_ids), token_ids))
        return prepared

    def warm_up(self) -> concurrent.futures.Future[None]:
        """Render the served chat template once, for a one-message chat, on a prompt
        thread; the server starts this once it listens. The template engine (jinja2 and the
        guard) is imported on first use, which keeps it off the start of the server; this
        keeps it off the first chat request too. A template that cannot render that chat
        is left for a request to report."""
        return self._executor.submit(self._warm_up)

    def _warm_up(self) -> None:
        if self.tokenizer is None:
            return
        try:
            self._render(
                [{"role": "user", "content": "Hello"}],
                self.chat_template,
                add_generation_prompt=True,
                continue_final_message=False,
            )
        except Exception as exc:  # (the template's own errors: a request reports them)
            logger.debug("the chat template did not render a one-message chat: %s", exc)

    def _render(self, messages: list[Any], template: str | None, **options: Any) -> str:
        """``messages`` through the chat template, within the template limits."""
        # (imported here, not at the top: it imports jinja2; see warm_up)
        from pagedllm.entrypoints.openai.template_guard import bounded

        with bounded(self.max_prompt_chars, self.template_timeout):
            return render_chat(
                self.tokenizer,
                messages,
                template=template,
                content_format=self.content_format,
                **options,
            )

    def chat_prompt(self, request: ChatCompletionRequest) -> PreparedPrompt:
        """The rendered and tokenized prompt of a chat request."""
        size = sum(
            _text_size(part)
            for part in (
                request.messages,
                request.tools,
                request.documents,
                request.chat_template_kwargs,
            )
        )
        self.check_text_size(size, "messages")
        self._check_truncation(request.truncate_prompt_tokens)
        try:
            text = self._render(
                request.messages,
                request.chat_template or self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
                documents=request.documents,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        token_ids = self.tokenize(text, request.add_special_tokens, "messages")
        return self._truncate(PreparedPrompt(text, token_ids), request.truncate_prompt_tokens)

    def _decode(self, token_ids: list[int]) -> str | None:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else None

    def _check_truncation(self, keep: int | None) -> None:
        if keep is not None and keep > self.max_model_len:
            raise OpenAIError(
                400,
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size.",
                param="truncate_prompt_tokens",
            )

    def _truncate(self, prompt: PreparedPrompt, keep: int | None) -> PreparedPrompt:
        """``truncate_prompt_tokens``: keep the last ``keep`` tokens (as the engine does),
        so that the length checks and the echo see the prompt that is actually run."""
        if keep is None or len(prompt.token_ids) <= keep:
            return prompt
        token_ids = prompt.token_ids[-keep:]
        return PreparedPrompt(self._decode(token_ids), token_ids)


def _text_size(value: Any) -> int:
    """Characters of text in a JSON-like value (what a template could print of it; not
    an image part's URL, which templates see as ``{"type": "image"}``)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict) and item.get("type") in IMAGE_PART_TYPES:
            continue
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
