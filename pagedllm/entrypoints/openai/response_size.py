"""The bound on one non-streaming response (``--max-response-mb``), and its body made off
the event loop.

A non-streaming response is held whole in memory, and ``n`` choices of thousands of
tokens with 20 log probabilities each make hundreds of megabytes. So:

- before generating, a request whose smallest possible response is over the limit (its
  length fixed by ``ignore_eos`` or ``min_tokens``, each token's log probabilities at
  least their JSON skeleton) is refused;
- a request whose largest possible response is over the limit gets the engine's outputs
  as deltas, folded here into the whole outputs it would otherwise get at the end, while
  the response's size is estimated; once past the limit its engine requests are aborted
  (their KV blocks freed) and it is refused;
- the body is serialized on a worker thread (:mod:`.json_body`) and refused if over the
  limit after all.

The refusal is a 400 naming the limit and suggesting ``stream=true``: a stream holds no
more than one chunk at a time and has no such limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from pagedllm.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.core.sampling.params import RequestOutputKind
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.json_body import JSONBody, dumps, release_memory_soon
from pagedllm.entrypoints.openai.logprobs import prompt_logprobs_json

if TYPE_CHECKING:
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.entrypoints.openai.responses import Outputs

logger = logging.getLogger("pagedllm.server")

MIB = 1 << 20
# The log probability synthetic positions are written with: as long as a float's repr gets.
_LONG_LOGPROB = -1.2345678901234567e-05
_TYPICAL_LOGPROB = -1.2345678901234567
# Most JSON one character of token text can take: U+FFFD (a token that is part of a
# character) is 3 bytes, and 3 more numbers in chat's "bytes" list.
_WORST_CHAR = "\ufffd"
# Most JSON one character of generated text can take (a control character's \u escape).
_TEXT_BYTES_PER_CHAR = 6
# A growing response's estimate is within about 10% of its JSON's size: a generation is
# stopped once the estimate is clearly past the limit, and the body's exact size decides
# the rest (so that no response within the limit is refused).
_ESTIMATE_MARGIN = 1.1
# Tokens of the largest synthetic position actually written (see _position_size).
_SYNTHETIC_ENTRIES = 32
# The longest token's length assumed without a tokenizer (--skip-tokenizer-init).
_UNKNOWN_TOKEN_LENGTH = 16

FormatLogprobs = Callable[[list[int], list[Any]], Any]


def too_large(limit_mb: float) -> OpenAIError:
    return OpenAIError(
        400,
        f"The response to this request would be larger than {limit_mb:g} MiB, the "
        f"server's limit for one non-streaming response (--max-response-mb). Ask for it with "
        f"stream=true, or ask for fewer choices (n), tokens (max_tokens) or log "
        f"probabilities.",
        param="stream",
    )


def json_size(content: Any) -> int:
    return len(dumps(content))


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseShape:
    """How an endpoint writes a request's outputs, as far as their size goes.

    ``logprobs`` formats generated tokens' positions (token ids, position log
    probabilities) as the endpoint does, ``top`` per position (None: no log
    probabilities); each prompt's ``prompt_logprobs`` are written ``prompt_copies`` times,
    and its text (with its tokens' log probabilities) ``echo_copies`` times."""

    logprobs: FormatLogprobs | None
    top: int = 0
    prompt_copies: int = 0
    echo_copies: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class _PositionSize:
    """A position's JSON size as ``base + per_char * chars``, ``chars`` the length of its
    tokens' texts."""

    base: float
    per_char: float

    def of(self, position: dict[int, Logprob] | None) -> float:
        if not position:
            return self.base
        return self.base + self.per_char * sum(
            len(lp.decoded_token or "") for lp in position.values()
        )


def _synthetic(entries: int, text: Callable[[int], str], logprob: float) -> dict[int, Logprob]:
    return {i: Logprob(logprob, rank=i + 1, decoded_token=text(i)) for i in range(entries)}


def _one_position_size(format_fn: FormatLogprobs, position: dict[int, Logprob]) -> int:
    """The bytes one position adds to what ``format_fn`` writes."""
    return json_size(format_fn([0], [position])) - json_size(format_fn([], []))


def _position_size(
    format_fn: FormatLogprobs, entries: int, text: Callable[[int], str], logprob: float
) -> float:
    """The bytes a synthetic position of ``entries`` tokens adds (past a few dozen,
    extrapolated: a request may ask for any number, refused later by the engine)."""
    if entries <= _SYNTHETIC_ENTRIES:
        return _one_position_size(format_fn, _synthetic(entries, text, logprob))
    last = _one_position_size(format_fn, _synthetic(_SYNTHETIC_ENTRIES, text, logprob))
    before = _one_position_size(format_fn, _synthetic(_SYNTHETIC_ENTRIES - 1, text, logprob))
    return last + (entries - _SYNTHETIC_ENTRIES) * (last - before)


def _padded(width: int) -> Callable[[int], str]:
    # Distinct texts (completions key their top log probabilities by text).
    return lambda i: str(i).zfill(width)


def _linear_size(format_fn: FormatLogprobs, top: int) -> _PositionSize:
    """A position's size, fitted to synthetic positions of ``top`` tokens (the chosen
    one among them) with texts of two lengths."""
    entries = max(top, 1)
    short, long = 3, 11

    def size(width: int) -> float:
        return _position_size(format_fn, entries, _padded(width), _TYPICAL_LOGPROB)

    per_char = (size(long) - size(short)) / (entries * (long - short))
    return _PositionSize(size(short) - per_char * entries * short, per_char)


def _prompt_format(ids: list[int], positions: list[Any]) -> Any:
    return prompt_logprobs_json(_PromptPositions(positions))


@dataclasses.dataclass(slots=True)
class _PromptPositions:
    prompt_logprobs: list[Any]


class ResponseLimit:
    """``--max-response-mb`` of one server (0: no limit); ``tokenizer`` bounds the text a
    token can be."""

    def __init__(self, limit_mb: float, tokenizer: Any, max_logprobs: int = -1) -> None:
        self.limit_mb = limit_mb
        self.limit = int(limit_mb * MIB)
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs  # (--max-logprobs; -1: no limit)

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the longest token's text (in the vocabulary's spelling, which is
        no shorter than the decoded text)."""
        vocab = getattr(self.tokenizer, "get_vocab", None)
        if vocab is None:
            return _UNKNOWN_TOKEN_LENGTH
        return max((len(token) for token in vocab()), default=_UNKNOWN_TOKEN_LENGTH)

    def watch(
        self, prompt_lengths: list[int], params_list: list[SamplingParams], shape: ResponseShape
    ) -> Callable[[Outputs], Outputs]:
        """Check a request before generating (the 400 when even its smallest response is
        over the limit), and return what its outputs go through: unchanged when its
        largest response fits (or it streams), else folded from deltas while the response
        is estimated (``params_list`` then ask for deltas)."""
        if not self.limit or any(
            p.output_kind is not RequestOutputKind.FINAL_ONLY or self._refused(p)
            for p in params_list
        ):
            return _unchanged
        smallest = largest = 0.0
        sizes = _Sizes(shape, self.longest_token)
        for length, params in zip(prompt_lengths, params_list, strict=True):
            smallest += sizes.smallest(length, params)
            largest += sizes.largest(length, params)
        if smallest > self.limit:
            raise too_large(self.limit_mb)
        if largest <= self.limit or any(
            p.best_of is not None and p.best_of != p.n for p in params_list
        ):
            # (best_of > n keeps its n best only at the end: no deltas to fold.)
            return _unchanged
        for params in params_list:
            params.output_kind = RequestOutputKind.DELTA
        estimate = _Estimate(shape, params_list[0].prompt_logprobs or 0)
        return functools.partial(self._fold, estimate=estimate)

    def _refused(self, params: SamplingParams) -> bool:
        """Whether the engine refuses ``params``' log probabilities (with the error that
        names them, rather than this one)."""
        asked = max(params.logprobs or 0, params.prompt_logprobs or 0)
        return self.max_logprobs != -1 and asked > self.max_logprobs

    async def _fold(self, outputs: Outputs, estimate: _Estimate) -> Outputs:
        """The whole outputs of the prompts (each once finished, as ``FINAL_ONLY`` gives
        them) from their deltas; past the limit, the 400 (and the engine requests are
        aborted as ``outputs`` closes)."""
        folds: dict[int, _Fold] = {}
        size = 0.0
        async with contextlib.aclosing(outputs):
            async for index, output in outputs:
                first = index not in folds
                size += estimate.of(output, first)
                if size > self.limit * _ESTIMATE_MARGIN:
                    logger.info(
                        "a non-streaming response passed --max-response-mb (%g MiB) while "
                        "generating: its requests are stopped",
                        self.limit_mb,
                    )
                    release_memory_soon()
                    raise too_large(self.limit_mb)
                fold = folds.get(index)
                if fold is None:
                    fold = folds[index] = _Fold(output)
                fold.add(output)
                if output.finished:
                    yield index, fold.whole()
                    del folds[index]

    async def json_response(self, content: Any) -> Response:
        """``content`` as a JSON response, serialized on a worker thread; over the
        limit, the 400."""
        body = await asyncio.to_thread(dumps, content)
        if self.limit and len(body) > self.limit:
            logger.info("a %d-byte non-streaming response passed --max-response-mb", len(body))
            release_memory_soon()
            raise too_large(self.limit_mb)
        return JSONBody(body)


def _unchanged(outputs: Outputs) -> Outputs:
    return outputs


class _Sizes:
    """The smallest and largest response one prompt of a request can get."""

    def __init__(self, shape: ResponseShape, longest_token: int) -> None:
        self.shape = shape
        self.longest = max(longest_token, 1)
        entries = max(shape.top, 1)
        fmt = shape.logprobs
        if fmt is None:
            self.min_position = self.max_position = 0
        else:
            self.min_position = _position_size(fmt, entries, lambda i: "", 0.0)
            self.max_position = _position_size(fmt, shape.top + 1, self._worst_text, _LONG_LOGPROB)

    def _worst_text(self, i: int) -> str:
        text = str(i)
        return text + _WORST_CHAR * max(self.longest - len(text), 0)

    def _prompt_position(self, params: SamplingParams, smallest: bool) -> float:
        top = params.prompt_logprobs or 0
        if smallest:
            return _position_size(_prompt_format, max(top, 1), lambda i: "", 0.0)
        return _position_size(_prompt_format, top + 1, self._worst_text, _LONG_LOGPROB)

    def smallest(self, prompt_length: int, params: SamplingParams) -> float:
        tokens = _certain_tokens(params)
        size = float(params.n * tokens * self.min_position)
        if params.prompt_logprobs is not None and self.shape.prompt_copies:
            positions = max(prompt_length - 1, 0)
            size += self.shape.prompt_copies * positions * self._prompt_position(params, True)
        return size

    def largest(self, prompt_length: int, params: SamplingParams) -> float:
        text_per_token = _TEXT_BYTES_PER_CHAR * self.longest
        tokens = params.max_tokens or 0
        size = float(params.n * tokens * (text_per_token + self.max_position))
        if params.prompt_logprobs is not None and self.shape.prompt_copies:
            size += self.shape.prompt_copies * prompt_length * self._prompt_position(params, False)
        size += self.shape.echo_copies * prompt_length * (text_per_token + self.max_position)
        return size


def _certain_tokens(params: SamplingParams) -> int:
    """Tokens every sequence of the request is sure to generate."""
    if params.stop or params.guided_decoding is not None:
        return 0
    if params.ignore_eos and not params.stop_token_ids:
        return params.max_tokens or 0
    return min(params.min_tokens, params.max_tokens or 0)


class _Estimate:
    """The bytes each output delta adds to the response (text and log probabilities
    counted from what the delta holds, in the endpoint's formats)."""

    def __init__(self, shape: ResponseShape, prompt_top: int) -> None:
        self.shape = shape
        self.position = None
        if shape.logprobs is not None:
            self.position = _linear_size(shape.logprobs, shape.top)
        self.prompt_position = None
        if shape.prompt_copies:
            self.prompt_position = _linear_size(_prompt_format, prompt_top)

    def of(self, output: RequestOutput, first: bool) -> float:
        size = 0.0
        for completion in output.outputs:
            size += len(completion.text)
            if self.position is not None and completion.logprobs:
                size += sum(self.position.of(p) for p in completion.logprobs)
        if first:
            prompt = output.prompt_logprobs or []
            if self.prompt_position is not None:
                each = sum(self.prompt_position.of(p) for p in prompt)
                size += self.shape.prompt_copies * each
            if self.shape.echo_copies:
                echo = float(len(output.prompt or ""))
                if self.position is not None:
                    echo += sum(self.position.of(p) for p in prompt)
                size += self.shape.echo_copies * echo
        return size


class _Fold:
    """One prompt's output deltas added up into its whole output."""

    def __init__(self, first: RequestOutput) -> None:
        self.first = self.last = first
        self.completions: dict[int, CompletionOutput] = {}

    def add(self, output: RequestOutput) -> None:
        self.last = output
        for part in output.outputs:
            whole = self.completions.get(part.index)
            if whole is None:
                self.completions[part.index] = dataclasses.replace(
                    part,
                    token_ids=list(part.token_ids),
                    logprobs=list(part.logprobs) if part.logprobs is not None else None,
                )
                continue
            whole.text += part.text
            whole.token_ids.extend(part.token_ids)
            if whole.logprobs is not None and part.logprobs is not None:
                whole.logprobs.extend(part.logprobs)
            whole.cumulative_logprob = part.cumulative_logprob
            whole.finish_reason = part.finish_reason
            whole.stop_reason = part.stop_reason

    def whole(self) -> RequestOutput:
        return dataclasses.replace(
            self.last,
            prompt_logprobs=self.first.prompt_logprobs,
            outputs=[self.completions[i] for i in sorted(self.completions)],
        )
