"""Engine statistics and the periodic log line (``--disable-log-stats`` turns it off)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.scheduler import SchedulerOutput

logger = logging.getLogger("pagedllm.stats")

LOG_INTERVAL_SECONDS = 5.0
# The per-step samples kept for a metrics listener between two of its reads (older ones
# are dropped, so that an engine nobody reads does not grow them).
MAX_STEP_SAMPLES = 65536


@dataclasses.dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Speculative decoding: verification steps of drafts, drafts proposed and kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # KV transfer (vLLM's external prefix cache): prompt tokens looked up, found.
    kv_transfer_queries: int = 0
    kv_transfer_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


# The step extensions' counters that EngineStats reports (see SchedulerInterface).
_EXTENSION_COUNTERS = frozenset(
    f.name for f in dataclasses.fields(EngineStats) if f.name.startswith(("spec_", "kv_transfer_"))
)


class StatLogger:
    def __init__(self, engine: Any, enabled: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._interval_prompt = 0
        self._interval_generation = 0
        self._last_log = time.monotonic()
        # Per step, the tokens it computed; per request and step with a new token, the time
        # since its previous one (vLLM's iteration_tokens_total and
        # inter_token_latency_seconds). Read and cleared by :meth:`take_samples`.
        self._iteration_tokens: collections.deque[int] = collections.deque(maxlen=MAX_STEP_SAMPLES)
        self._inter_token_latencies: collections.deque[float] = collections.deque(
            maxlen=MAX_STEP_SAMPLES
        )

    def record_inter_token_latency(self, seconds: float) -> None:
        self._inter_token_latencies.append(seconds)

    def take_samples(self) -> tuple[list[int], list[float]]:
        """The steps' token counts and the inter-token latencies recorded since the last
        call (on the engine's thread, as the steps)."""
        samples = list(self._iteration_tokens), list(self._inter_token_latencies)
        self._iteration_tokens.clear()
        self._inter_token_latencies.clear()
        return samples

    def on_step(self, output: SchedulerOutput, num_sampled: int) -> None:
        # Tokens computed this step that were not the previous step's sampled token.
        prompt = output.num_scheduled_tokens - sum(
            1 + len(s.extra_token_ids)
            for s in output.scheduled
            if s.num_computed_tokens >= s.request.num_prompt_tokens
        )
        self.prompt_tokens += prompt
        self.generation_tokens += num_sampled
        self._iteration_tokens.append(output.num_scheduled_tokens)
        self._interval_prompt += prompt
        self._interval_generation += num_sampled
        if self.enabled and time.monotonic() - self._last_log >= LOG_INTERVAL_SECONDS:
            self.log()

    def snapshot(self) -> EngineStats:
        kv = self.engine.kv_manager
        total = kv.total_prefix_cache_stats
        return EngineStats(
            num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=total.queries,
            prefix_cache_hits=total.hits,
            num_preemptions=self.engine.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            **{
                key: value
                for key, value in self.engine.scheduler.extension_stats().items()
                if key in _EXTENSION_COUNTERS
            },
        )

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log, 1e-9)
        stats = self.snapshot()
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            self._interval_prompt / elapsed,
            self._interval_generation / elapsed,
            stats.num_running,
            stats.num_waiting,
            stats.kv_cache_usage * 100,
            stats.prefix_cache_hit_rate * 100,
        )
        if stats.spec_draft_tokens:
            logger.info(
                "speculative decoding: %.1f%% of %d draft tokens accepted, mean acceptance "
                "length %.2f (tokens per verification step, the sampled one included)",
                100 * stats.spec_accepted_tokens / stats.spec_draft_tokens,
                stats.spec_draft_tokens,
                1 + stats.spec_accepted_tokens / max(stats.spec_drafts, 1),
            )
        self._interval_prompt = self._interval_generation = 0
        self._last_log = now
