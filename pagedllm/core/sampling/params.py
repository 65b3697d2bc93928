"""``SamplingParams``: how one request samples, with vLLM's fields, defaults and checks."""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
from collections.abc import Iterable
from typing import Any

from pagedllm.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Temperatures in (0, MIN_TEMPERATURE) overflow the softmax; vLLM raises them to this.
MIN_TEMPERATURE = 1e-2
# logit_bias values are clamped to +-this (OpenAI's documented range).
MAX_LOGIT_BIAS = 100.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Fields that must be finite numbers (NaN or infinity would poison the logits).
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a streaming request holds."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """vLLM's ``SamplingParams``. ``__post_init__`` normalises and validates:

    - ``stop`` becomes a list of strings; ``stop_token_ids`` and ``bad_words`` lists.
    - ``top_k``: 0 means disabled; -1 and ``None`` (vLLM's older spelling) become 0.
    - ``seed=-1`` means no seed (as vLLM); ``logprobs=True`` means 1.
    - ``logit_bias`` keys become ``int`` (JSON gives strings); values are clamped to
      [-100, 100], as vLLM's server does.
    - temperature below ``SAMPLING_EPS`` is greedy: top_p/top_k/min_p are reset to
      neutral; a temperature in (0, 0.01) is raised to 0.01 with a warning.
    - ``n`` is left as asked; the engine generates ``best_of or n`` sequences.

    Invalid values raise :class:`InvalidRequestError` (a ``ValueError``) whose ``param``
    is the field and whose message names the field and the value.
    The engine calls :meth:`update_from_tokenizer` once per request before scheduling.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: Any = None
    # pagedllm: keep the KV of this request's partial last block in the prefix cache when
    # it finishes, for requests that continue its tokens (set by beam search's steps).
    keep_kv_tail: bool = False
    # Filled by update_from_tokenizer (and __post_init__ for the stop ids).
    all_stop_token_ids: set[int] = dataclasses.field(init=False, repr=False)
    bad_words_token_ids: list[list[int]] = dataclasses.field(init=False, repr=False)
    eos_token_ids: tuple[int, ...] = dataclasses.field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self._normalise()
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.best_of is not None and self.best_of > 1:
                raise InvalidRequestError(
                    "best_of", f"best_of must be 1 when using greedy sampling, got {self.best_of}."
                )
            if self.n > 1:
                raise InvalidRequestError(
                    "n", f"n must be 1 when using greedy sampling, got {self.n}."
                )
        elif self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors (nan or "
                "inf); raised to %s.",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        self.bad_words_token_ids = []
        self._update_stop_ids()

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = [] if self.bad_words is None else list(self.bad_words)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = _int_keyed(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)

    def _verify_args(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise InvalidRequestError("n", f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise InvalidRequestError(
                    "best_of",
                    "best_of must be greater than or equal to n, "
                    f"got n={self.n} and best_of={self.best_of}.",
                )
            if self.best_of != self.n and self.output_kind == RequestOutputKind.DELTA:
                raise InvalidRequestError(
                    "best_of", "best_of must equal n to use output_kind=DELTA"
                )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise InvalidRequestError(name, f"{name} must be a finite number, got {value}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"{name} must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(
                "repetition_penalty",
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
            )
        if not self.temperature >= 0.0:
            raise InvalidRequestError(
                "temperature", f"temperature must be non-negative, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidRequestError(
                "top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                raise InvalidRequestError(
                    "seed", f"seed must fit in a signed 64-bit integer, got {self.seed}."
                )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidRequestError(
                    "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}."
                )
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < -1:
                    raise InvalidRequestError(
                        name, f"{name} must be non-negative or -1, got {value}."
                    )
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1:
                raise InvalidRequestError(
                    "truncate_prompt_tokens",
                    f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}.",
                )
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids",
                f"stop_token_ids must contain only non-negative integers, "
                f"got {self.stop_token_ids}.",
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(
                "stop", f"stop must be a string or a list of strings, got {self.stop}."
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise InvalidRequestError(
                "stop",
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop.",
            )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError(
                    "allowed_token_ids", "allowed_token_ids must not be empty when given."
                )
            if not all(isinstance(t, int) for t in self.allowed_token_ids):
                raise InvalidRequestError(
                    "allowed_token_ids",
                    f"allowed_token_ids must contain only integers, got {self.allowed_token_ids}.",
                )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError(
                "output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}."
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine generates (``best_of`` when set, else ``n``)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer holds back so that a stop string is never streamed."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> SamplingParams:
        """A deep copy; ``guided_decoding`` is shared (treated as an immutable spec)."""
        return copy.deepcopy(self, memo={id(self.guided_decoding): self.guided_decoding})

    def update_from_tokenizer(
        self,
        eos_token_id: int | Iterable[int] | None,
        tokenizer: Any = None,
        vocab_size: int | None = None,
    ) -> None:
        """Bind the request to a model: eos ids, ``bad_words`` token ids, vocabulary checks.

        ``eos_token_id`` (one id or several, e.g. a generation config's list) joins
        ``all_stop_token_ids`` unless ``ignore_eos``. ``tokenizer`` needs
        ``encode(text, add_special_tokens=False)`` and is required only when ``bad_words``
        is set. With ``vocab_size``, out-of-vocabulary ids in ``allowed_token_ids``,
        ``logit_bias`` and the bad words raise :class:`InvalidRequestError`. Idempotent.
        """
        if eos_token_id is None:
            self.eos_token_ids = ()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = (eos_token_id,)
        else:
            self.eos_token_ids = tuple(eos_token_id)
        self._update_stop_ids()
        self.bad_words_token_ids = []
        if self.bad_words:
            if tokenizer is None:
                raise InvalidRequestError(
                    "bad_words", "bad_words needs a tokenizer; this model has none."
                )
            self.bad_words_token_ids = _encode_bad_words(self.bad_words, tokenizer)
        if vocab_size is not None:
            self._check_vocab(vocab_size)

    def _update_stop_ids(self) -> None:
        self.all_stop_token_ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            self.all_stop_token_ids.update(self.eos_token_ids)

    def _check_vocab(self, vocab_size: int) -> None:
        groups = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
            "bad_words": [t for ids in self.bad_words_token_ids for t in ids],
        }
        for name, ids in groups.items():
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            if bad:
                raise InvalidRequestError(
                    name,
                    f"{name} contains out-of-vocabulary token id(s) {bad[:10]}; "
                    f"token ids must be in [0, {vocab_size}).",
                )


def _check_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(name, f"{name} must be an integer, got {value!r}.")


def _int_keyed(logit_bias: dict[Any, Any]) -> dict[int, float]:
    result: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
            bias = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                "logit_bias", f"logit_bias must map token ids to numbers, got {key!r}: {value!r}."
            ) from None
        if not math.isfinite(bias):
            raise InvalidRequestError(
                "logit_bias", f"logit_bias values must be finite numbers, got {key!r}: {value!r}."
            )
        # Clamped as OpenAI documents and vLLM does: a bias past float32's range would be an
        # infinity in the logits, and softmax turns a row holding one into NaNs.
        result[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))
    return result


def _encode_bad_words(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word as at the start of a text and, when that gives another token sequence of
    the same length, after a space (vLLM's rule: ban it both at the start and mid-text)."""
    result: list[list[int]] = []
    for position, word in enumerate(bad_words):
        if not isinstance(word, str) or not word.strip():
            raise InvalidRequestError(
                "bad_words",
                f"bad_words[{position}] is {word!r}: a bad word must be a non-empty string.",
            )
        plain: list[int] | None = None
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                continue
            if plain is None:
                plain = ids
                result.append(ids)
            elif ids[0] != plain[0] and len(ids) == len(plain):
                result.append(ids)
        if plain is None:
            raise InvalidRequestError(
                "bad_words",
                f"bad_words[{position}] {word!r} has no tokens, so it could never match.",
            )
    return result
