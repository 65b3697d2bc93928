"""Guided decoding in the engine: choosing a backend, compiling constraints off the
engine loop (cached), one matcher per sequence, and the batch's token mask.

A request whose constraint is still compiling waits in the queue while the others run
(``request.features["guided"]``); its matcher is made on first use and advanced with each token it
samples.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.guided_compile import CompileLimitError, CompilePool
from pagedllm.core.interfaces import (
    CompiledConstraint,
    Grammar,
    GuidedBackend,
    GuidedConstraint,
    GuidedOptions,
)
from pagedllm.core.sampling.guided_params import GuidedDecodingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedllm.core.config import DecodingConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.request import Request

logger = logging.getLogger("pagedllm.guided")

# The order ``auto`` tries the built-in backends in; other registered ones follow.
# outlines builds a whole automaton first: what it cannot within the compile time limit
# (``a{100000}``, its generic JSON-object regex on a large vocabulary) falls back to
# xgrammar, which compiles lazily.
AUTO_ORDER = ("outlines", "xgrammar")
MATCHER_KEY = "guided.matcher"
REASONER_KEY = "guided.reasoner"
ANSWER_START_KEY = "guided.answer_start"
SCANNED_KEY = "guided.scanned"
OPENERS_KEY = "guided.openers"
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclasses.dataclass(slots=True)
class _Entry:
    """A constraint compiling or compiled: its future, how many callers wait on it, and
    (once compiled) the memory it holds."""

    future: Future[CompiledConstraint]
    cancelled: threading.Event
    waiters: int = 0
    size: int | None = None

    @property
    def evictable(self) -> bool:
        # (A compile that is measured is done but for setting its future.)
        return self.size is not None or self.future.done()


class GuidedDecodingManager:
    def __init__(
        self,
        pm: PluginManager,
        config: DecodingConfig,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.registry = pm.registry("guided_backends")
        self.default_backend = config.guided_decoding_backend
        self.disable_fallback = config.disable_fallback
        self.options = GuidedOptions(
            disable_any_whitespace=config.disable_any_whitespace,
            disable_additional_properties=config.disable_additional_properties,
        )
        self.tokenizer = tokenizer
        # --reasoning-parser: a constraint applies to the answer, after the reasoning.
        self.reasoning_cls = (
            pm.load("reasoning_parsers", config.reasoning_parser)
            if config.reasoning_parser
            else None
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._backends: dict[str, GuidedBackend] = {}
        # Compiled constraints, least recently used first, bounded in number
        # (--guided-decoding-cache-size) and in memory (--guided-decoding-cache-memory).
        self._cache: OrderedDict[Any, _Entry] = OrderedDict()
        self.cache_size = config.compile_cache_size
        self.cache_bytes = int(config.compile_cache_memory_mib * (1 << 20))
        self._lock = threading.Lock()
        workers = config.compile_workers
        # --guided-decoding-compile-workers 0: compile in threads of this process.
        self._pool = (
            CompilePool(
                tokenizer,
                vocab_size,
                eos_token_ids,
                workers=workers,
                timeout=config.compile_timeout,
                memory_mib=config.compile_memory_mib,
            )
            if workers > 0
            else None
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(workers, 1), thread_name_prefix="pagedllm-guided"
        )

    # ------------------------------------------------------------------ compiling

    def backend_names(self, requested: str | None) -> list[str]:
        """The backends to try, in order, for a request naming ``requested`` (or None)."""
        name = requested or self.default_backend
        names = self.registry.names()
        if name != "auto" and name not in names:
            raise ValueError(
                f"guided decoding backend {name!r} is not installed (choose from auto, "
                f"{', '.join(names)})"
            )
        conflict = self.registry.conflict(name) if name != "auto" else None
        if conflict is not None:
            raise ValueError(f"cannot use {conflict}")
        # (A name two plugins claim is never a fallback.)
        usable = [n for n in names if not self.registry.entry(n).conflicts]
        ordered = [n for n in AUTO_ORDER if n in usable]
        ordered += [n for n in usable if n not in AUTO_ORDER]
        if name == "auto":
            return ordered
        if self.disable_fallback:
            return [name]
        return [name] + [n for n in ordered if n != name]

    def backend(self, name: str) -> GuidedBackend:
        with self._lock:
            if name not in self._backends:
                cls = self.registry.load(name)
                self._backends[name] = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._backends[name]

    def submit(self, guided: GuidedDecodingParams) -> Future[CompiledConstraint]:
        """The compiled constraint, compiling in the background (cached)."""
        return self._entry(guided, wait=False).future

    def acquire(self, guided: GuidedDecodingParams) -> tuple[Any, Future[CompiledConstraint]]:
        """``(handle, future)`` of the compiled constraint for a caller that waits on it;
        the caller gives the handle back with :meth:`release`."""
        key = self._key(guided)
        entry = self._entry(guided, wait=True, key=key)
        return (key, entry), entry.future

    def release(self, handle: Any) -> None:
        """A caller stopped waiting: a compile nobody waits for any more is stopped (and
        forgotten, so that a later request compiles it afresh). The handle names the
        entry itself: the cache may have dropped it and compiled the key anew meanwhile."""
        key, entry = handle
        with self._lock:
            entry.waiters -= 1
            if entry.waiters > 0 or entry.future.done():
                return
            if self._cache.get(key) is entry:
                del self._cache[key]
        entry.cancelled.set()
        entry.future.cancel()

    @property
    def cached_bytes(self) -> int:
        """The memory the compiled constraints in the cache hold (as measured)."""
        with self._lock:
            return sum(entry.size or 0 for entry in self._cache.values())

    def _key(self, guided: GuidedDecodingParams) -> Any:
        constraint = guided.constraint()
        options = dataclasses.replace(self.options, whitespace_pattern=guided.whitespace_pattern)
        return (tuple(self.backend_names(guided.backend)), constraint, options)

    def _entry(self, guided: GuidedDecodingParams, *, wait: bool, key: Any = None) -> _Entry:
        key = key if key is not None else self._key(guided)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                cancelled = threading.Event()
                future = self._executor.submit(self._compile_measured, key, cancelled)
                entry = self._cache[key] = _Entry(future, cancelled)
                self._evict()
            else:
                self._cache.move_to_end(key)
            entry.waiters += wait
        return entry

    def _evict(self) -> None:
        """Drop the least recently used finished entries past the cache's size or memory.
        (Requests using a dropped one keep it until they finish.)"""
        excess = len(self._cache) - self.cache_size
        excess_bytes = sum(entry.size or 0 for entry in self._cache.values()) - self.cache_bytes
        for key in list(self._cache):
            if excess <= 0 and excess_bytes <= 0:
                break
            entry = self._cache[key]
            if entry.evictable:
                del self._cache[key]
                excess -= 1
                excess_bytes -= entry.size or 0

    def _compile_measured(self, key: Any, cancelled: threading.Event) -> CompiledConstraint:
        """Compile (on a compile thread), then count what the result holds in the cache."""
        compiled = self._compile(*key, cancelled)
        try:
            size = compiled.memory_size_bytes()
        except Exception:  # a plugin's measure must not cost the request its constraint
            logger.warning("cannot measure a compiled %s constraint", key[1].kind, exc_info=True)
            size = 0
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.cancelled is not cancelled:
                return compiled  # released meanwhile: not cached
            entry.size = size
            if size > self.cache_bytes:
                # Used by the requests that wait for it, but not kept: it would push
                # every other constraint out.
                del self._cache[key]
                logger.info(
                    "a compiled %s constraint of %.1f MiB is not cached: it is more than "
                    "--guided-decoding-cache-memory (%.1f MiB)",
                    key[1].kind,
                    size / (1 << 20),
                    self.cache_bytes / (1 << 20),
                )
            else:
                self._evict()
        return compiled

    def _compile(self, names, constraint, options, cancelled) -> CompiledConstraint:
        errors: list[str] = []
        first_error: ValueError | None = None
        for name in names:
            backend = self.backend(name)
            reason = backend.unsupported_reason(constraint)
            if reason is not None:
                errors.append(f"{name}: {reason}")
                continue
            try:
                if self._pool is None:
                    return backend.compile(constraint, options)
                data = self._pool.compile(type(backend), constraint, options, cancelled)
                return backend.load_compiled(data)
            except ValueError as exc:
                message = _LOG_PREFIX.sub("", str(exc))
                if isinstance(exc, CompileLimitError):
                    message = f"{_describe(constraint)}: {message}"
                if first_error is None:
                    first_error = ValueError(message)
                errors.append(f"{name}: {message}")
                logger.debug("guided backend %s failed on %s: %s", name, constraint.kind, exc)
        if first_error is not None:
            raise first_error
        raise ValueError(
            f"no guided-decoding backend supports this {constraint.kind} constraint ("
            + "; ".join(errors)
            + ")"
            + (" and --guided-decoding-disable-fallback is set" if self.disable_fallback else "")
        )

    # ------------------------------------------------------------------ per step

    def _answer_start(self, request: Request) -> int | None:
        """Index in the output where the constrained answer starts: 0 without a
        reasoning parser or when the answer began at once (see
        ``opening_token_sequences``), else just past the end of the reasoning (None while
        it goes on, or while the output may still be opening it)."""
        if self.reasoning_cls is None:
            return 0
        state = request.sampler_state
        start = state.get(ANSWER_START_KEY)
        if start is not None:
            return start
        parser = state.get(REASONER_KEY)
        if parser is None:
            tail = self.tokenizer.decode(request.prompt_token_ids[-32:])
            parser = state[REASONER_KEY] = self.reasoning_cls.for_prompt(self.tokenizer, tail)
            state[OPENERS_KEY] = parser.opening_token_sequences()
        output = request.output_token_ids
        openers = state[OPENERS_KEY]
        scanned = state.get(SCANNED_KEY, 0)
        if openers is not None:
            opened = _opened(openers, output)
            if opened is None:
                return None
            if opened == 0:
                # Each token was an opening marker's next or one the constraint allowed
                # (see token_mask), and the output left every marker: the answer began
                # with its first token.
                state[ANSWER_START_KEY] = 0
                return 0
            scanned = max(scanned, opened)
        # The first output position after which the reasoning is over.
        for end in range(scanned, len(output) + 1):
            if parser.is_reasoning_end(output[:end]):
                state[ANSWER_START_KEY] = end
                return end
        state[SCANNED_KEY] = len(output) + 1
        return None

    def matcher(self, request: Request) -> Grammar | None:
        """The request's matcher, or None while it is still reasoning."""
        state = request.sampler_state
        matcher = state.get(MATCHER_KEY)
        if matcher is None and _compiled(request) is not None:
            start = self._answer_start(request)
            if start is None:
                return None
            matcher = _compiled(request).result().matcher()
            # A recomputed (preempted) request keeps its output: replay its answer.
            answer = request.output_token_ids[start:]
            if answer and not matcher.accept_tokens(answer):
                raise RuntimeError(f"request {request.request_id}: output left its constraint")
            state[MATCHER_KEY] = matcher
        return matcher

    def token_mask(self, requests: list[Request]) -> torch.Tensor | None:
        """Bool ``[len(requests), vocab_size]`` (True = allowed), or None when no request
        is guided. Every matcher writes its row of one shared bitmask."""
        rows = [(i, r, self.matcher(r)) for i, r in enumerate(requests) if "guided" in r.features]
        if not rows:
            return None
        vocab_size = self.vocab_size
        words = (vocab_size + 31) // 32
        bitmask = torch.full((len(requests), words), -1, dtype=torch.int32)
        openers: dict[int, set[int]] = {}
        for index, request, matcher in rows:
            if matcher is None:
                # The output may still open the reasoning, or begin the answer (see
                # _answer_start): a marker's next token, or what the constraint allows
                # after the output so far (nothing once a marker token left it).
                output = request.output_token_ids
                following = _next_opening_tokens(request.sampler_state.get(OPENERS_KEY), output)
                if following:
                    openers[index] = following
                    bitmask[index].zero_()
                    probe = _compiled(request).result().matcher()
                    if probe.accept_tokens(output):
                        matcher = probe
            if matcher is not None:
                bitmask[index].zero_()
                matcher.fill_bitmask(bitmask, index)
        mask = unpack_bitmask(bitmask, vocab_size)
        for index, following in openers.items():
            mask[index, [t for t in following if t < vocab_size]] = True
        return mask

    def accept(self, request: Request, token: int) -> bool:
        """Advance the request's matcher with its new token (the last of its output)."""
        state = request.sampler_state
        matcher = state.get(MATCHER_KEY)
        if matcher is None:
            openers = state.get(OPENERS_KEY)
            output = request.output_token_ids
            if openers and _compiled(request) is not None and _opened(openers, output) == 0:
                # This token began the answer (the output left every opening marker):
                # the answer so far must hold to the constraint, as the mask let it
                # unless a ban overrode the mask.
                return _compiled(request).result().matcher().accept_tokens(output)
            # Reasoning (or not guided): the matcher is made when the answer starts.
            return True
        return matcher.accept_token(token)

    def shutdown(self) -> None:
        """Stop every compile now (the server is stopping)."""
        with self._lock:
            entries = list(self._cache.values())
        for entry in entries:
            entry.cancelled.set()
        if self._pool is not None:
            self._pool.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _opened(openers: tuple[tuple[int, ...], ...], output: list[int]) -> int | None:
    """How ``output`` began, given the token sequences that open a reasoning section: the
    length of the one it begins with (the model reasons), 0 when it can begin none any
    more (the answer began), None while it is a proper prefix of one."""
    for sequence in openers:
        if tuple(output[: len(sequence)]) == sequence:
            return len(sequence)
    if any(sequence[: len(output)] == tuple(output) for sequence in openers):
        return None
    return 0


def _next_opening_tokens(
    openers: tuple[tuple[int, ...], ...] | None, output: list[int]
) -> set[int]:
    """The tokens that go on with an opening marker while ``output`` may still be opening
    one (see :func:`_opened`); none otherwise."""
    if not openers or _opened(openers, output) is not None:
        return set()
    prefix = tuple(output)
    return {s[len(prefix)] for s in openers if s[: len(prefix)] == prefix}


def _describe(constraint: GuidedConstraint) -> str:
    """The constraint as a 400 names it: its kind, and its text if short."""
    kind = {"json": "JSON schema", "json_object": "JSON object", "choice": "choice"}.get(
        constraint.kind, constraint.kind
    )
    if constraint.spec is None:
        return f"the {kind} constraint"
    text = str(constraint.spec)
    return f"the {kind} constraint {text[:60] + '...' if len(text) > 60 else text!r}"


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]`` from an int32 bitmask ``[rows, ceil(vocab / 32)]``."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _compiled(request: Request) -> Any:
    """The future of the request's compiled constraint (the guided-decoding step
    extension's state), or None."""
    return request.features.get("guided")
