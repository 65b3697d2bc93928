"""One token budget per step: running requests first, then waiting ones.

There is no prefill phase and decode phase: each step gives every scheduled request the
tokens that bring its ``num_computed_tokens`` closer to its ``num_tokens`` (a whole
prompt, a chunk of one, or the one token sampled last step). When the KV cache cannot
hold a running request's next tokens, the lowest-priority running request is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import StepExtension, StepOutcome, overriding
from pagedllm.core.interfaces.scheduler import SchedulerInterface
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig
    from pagedllm.core.kv_cache import KVCacheManager

__all__ = ["RunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput", "WaitingQueue"]


class Scheduler(SchedulerInterface):
    """The built-in scheduler (``--scheduler-cls default``)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        *,
        extensions: Sequence[StepExtension] = (),
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        # The step extensions, by name; each hook's list holds only the extensions that
        # override it, so that a step without any does no extra work. Per-request hooks
        # go through request.features (the extensions whose state a request carries).
        self.extensions = {e.name: e for e in extensions}
        if len(self.extensions) != len(extensions):
            raise ConfigError(f"step extensions with the same name: {[e.name for e in extensions]}")
        self._per_step = overriding(extensions, StepExtension, "begin_step")
        self._masks = overriding(extensions, StepExtension, "token_mask")
        self._readers = overriding(extensions, StepExtension, "read_outputs")
        self._cutters = overriding(extensions, StepExtension, "schedulable_tokens")
        self._loaders = overriding(extensions, StepExtension, "external_tokens")
        verifiers = overriding(extensions, StepExtension, "extra_tokens")
        if len(verifiers) > 1:
            raise ConfigError(
                f"step extensions {[e.name for e in verifiers]} all add tokens to verify; "
                "at most one may"
            )
        self._verifier = verifiers[0] if verifiers else None
        self.waiting = WaitingQueue.for_policy(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # --scheduler-delay-factor: when the last step admitted prompts, and how long it took.
        self._prompt_step_time: float | None = None
        self._last_prompt_latency = 0.0
        self._admitted_last_step = False

    def _features(self, request: Request) -> list[StepExtension]:
        """The extensions whose state ``request`` carries."""
        return [self.extensions[name] for name in request.features if name in self.extensions]

    def extension_stats(self) -> dict[str, int]:
        return {
            f"{ext.name}_{key}": value
            for ext in self.extensions.values()
            for key, value in ext.stats.items()
        }

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.features:
            for ext in self._features(request):
                ext.add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests; frees their KV blocks."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove({request})
            self._finished(request, status)
            finished.append(request)
        return finished

    def _finished(self, request: Request, status: RequestStatus) -> None:
        """``request`` (out of the queue and the batch) is done: its blocks are freed."""
        request.status = status
        self.kv.free(request)
        if request.features:
            for ext in self._features(request):
                ext.request_finished(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ schedule

    def _preempt_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    def _limit(self, request: Request, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _delay_new_prompts(self) -> bool:
        """With a delay factor, hold new prompts back until ``factor x`` the last prompt
        step's latency has passed, so that more of them batch together (vLLM's rule)."""
        now = time.monotonic()
        if self._admitted_last_step and self._prompt_step_time is not None:
            self._last_prompt_latency = now - self._prompt_step_time
        factor = self.config.delay_factor
        if factor <= 0 or not self.running or self._prompt_step_time is None:
            return False
        return now - self._prompt_step_time <= factor * self._last_prompt_latency

    def schedule(self) -> SchedulerOutput:
        # (Normally released by update_from_output already.)
        self.kv.release_copy_sources()
        aborted = self._begin_step() if self._per_step else []
        budget = self.config.max_num_batched_tokens
        delay_prompts = self._delay_new_prompts()
        scheduled: dict[Request, ScheduledRequest] = {}
        preempted: list[str] = []

        # Running requests, in order; the victims of preemption come from the back.
        extra = self._verifier
        to_verify: list[tuple[ScheduledRequest, int]] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            room = extra.extra_tokens(request, budget) if extra and num_known == 1 else 0
            num_new = self._limit(request, num_known + room, budget)
            if self._cutters and num_known > 1 and request.features:
                num_new = self._schedulable(request, request.num_computed_tokens, num_new)
            room = max(0, num_new - num_known)
            if num_new <= 0:
                index += 1
                continue
            while True:
                if self.kv.allocate_slots(request, num_new) is not None:
                    break
                victim = self._preempt_victim()
                undone = scheduled.pop(victim, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                if self.running.index(victim) < index:
                    index -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the same index is the next request now
            scheduled[request] = ScheduledRequest(request, num_new, request.num_computed_tokens)
            if room:
                to_verify.append((scheduled[request], room))
            budget -= num_new
            index += 1
        if to_verify:
            budget += self._propose(scheduled, to_verify)

        # Waiting requests, if nothing had to be preempted to fit the running ones.
        partial, long_partial = self._partial_prefill_counts(scheduled)
        skipped: list[Request] = []  # held back (partial-prefill limits, pending work)
        admitted = False
        while not preempted and not delay_prompts and len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.features:
                admit = self._admit(request, aborted)
                if admit is None:
                    continue  # aborted
                if not admit:
                    # Held back by a feature (e.g. pending work): the requests behind it
                    # go first.
                    skipped.append(self.waiting.pop())
                    continue
            blocks, num_cached = self.kv.get_computed_blocks(request)
            # Tokens an extension loads (e.g. another engine's KV): computed, not scheduled.
            loaded = self._external_tokens(request, num_cached) if request.features else 0
            computed = num_cached + loaded
            remaining = request.num_tokens - computed
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._limit(request, remaining, budget)
            if self._cutters and request.features:
                num_new = self._schedulable(request, computed, num_new)
                if num_new <= 0:
                    break  # (its next piece does not fit in what is left of the step)
            if computed + num_new < request.num_tokens:
                is_long = (
                    self.config.long_prefill_token_threshold > 0
                    and request.num_tokens > self.config.long_prefill_token_threshold
                )
                if partial >= self.config.max_num_partial_prefills or (
                    is_long and long_partial >= self.config.max_long_partial_prefills
                ):
                    # Let the requests behind it that fit in one step overtake it.
                    skipped.append(self.waiting.pop())
                    continue
                partial += 1
                long_partial += int(is_long)
            if self.kv.allocate_slots(request, loaded + num_new, blocks) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            self.running.append(request)
            if request.features:
                for ext in self._features(request):
                    ext.admitted(request)
            scheduled[request] = ScheduledRequest(request, num_new, computed)
            budget -= num_new
            admitted = True
        for request in reversed(skipped):
            self.waiting.add(request, front=True)

        self._admitted_last_step = admitted
        if admitted:
            self._prompt_step_time = time.monotonic()
        items = list(scheduled.values())
        for item in items:
            item.block_ids = self.kv.get_block_ids(item.request.request_id)
        return SchedulerOutput(
            scheduled=items,
            num_scheduled_tokens=sum(s.num_new_tokens for s in items),
            preempted_request_ids=preempted,
            aborted=aborted,
            blocks_to_copy=self.kv.take_block_copies(),
        )

    def _schedulable(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` as the extensions of ``request`` let it compute from ``start``."""
        for ext in self._cutters:
            if ext.name in request.features:
                num_new = min(num_new, ext.schedulable_tokens(request, start, num_new))
        return num_new

    def _begin_step(self) -> list[tuple[Request, BaseException]]:
        """The extensions' start of a step; finishes (as aborted) the waiting requests they
        can never run."""
        aborted = []
        for ext in self._per_step:
            for request, error in ext.begin_step(self.running):
                if self.requests.get(request.request_id) is not request:
                    continue  # finished or aborted meanwhile
                request.failure = error
                self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
                aborted.append((request, error))
        return aborted

    def _external_tokens(self, request: Request, num_cached: int) -> int:
        """The tokens after ``num_cached`` that an extension of ``request`` loads."""
        for ext in self._loaders:
            if ext.name in request.features:
                return ext.external_tokens(request, num_cached)
        return 0

    def _admit(self, request: Request, aborted: list[tuple[Request, BaseException]]) -> bool | None:
        """Whether the extensions of a waiting request let it start now; None when one
        failed it (it is aborted, and added to ``aborted``)."""
        for ext in self._features(request):
            try:
                if not ext.admit(request):
                    return False
            except Exception as exc:
                self.waiting.pop()
                request.failure = exc
                self.requests.pop(request.request_id, None)
                self._finished(request, RequestStatus.FINISHED_ABORTED)
                aborted.append((request, exc))
                return None
        return True

    def _propose(
        self,
        scheduled: dict[Request, ScheduledRequest],
        to_verify: list[tuple[ScheduledRequest, int]],
    ) -> int:
        """The extra tokens of the scheduled decoding requests that are still in the step
        (preemption may have undone some). Returns the budget given back."""
        live = [(item, room) for item, room in to_verify if scheduled.get(item.request) is item]
        if not live:
            return 0
        for item, _ in live:
            item.block_ids = self.kv.get_block_ids(item.request.request_id)
        assert self._verifier is not None
        return self._verifier.propose(live)

    def token_mask(self, output: SchedulerOutput) -> Any:
        """The extensions' token mask for the step's sampling requests (bool
        ``[rows, vocab]``, True = allowed), or None when nothing is masked."""
        for ext in self._masks:
            mask = ext.token_mask(output.sampling_requests)
            if mask is not None:
                return mask
        return None

    def _partial_prefill_counts(
        self, scheduled: dict[Request, ScheduledRequest]
    ) -> tuple[int, int]:
        partial = long_partial = 0
        threshold = self.config.long_prefill_token_threshold
        for item in scheduled.values():
            if not item.reaches_end:
                partial += 1
                long_partial += int(threshold > 0 and item.request.num_tokens > threshold)
        return partial, long_partial

    # ------------------------------------------------------------------ update

    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens (or what the extensions read from
        the output), and apply the stop conditions that need no text (EOS, stop token ids,
        max_tokens, the model length, an extension's check of each token). Returns the
        requests that got a new token, finished ones included, and those the step failed
        on (aborted, with ``failure`` set)."""
        # The step ran: the tails its block copies read may go.
        self.kv.release_copy_sources()
        if result.error is not None:
            return self._fail_scheduled(output, result.error)
        updated = []
        outcomes: dict[str, StepOutcome] = {}
        for ext in self._readers:
            outcomes.update(ext.read_outputs(output, result))
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.num_computed_tokens + item.num_known_tokens
            outcome = outcomes.get(request.request_id) if outcomes else None
            if outcome is not None:
                request.num_computed_tokens += outcome.computed
                if outcome.finished:
                    self.running.remove(request)
                    self.requests.pop(request.request_id, None)
                    self._finished(request, RequestStatus.FINISHED_STOPPED)
                    updated.append(request)
                else:
                    self._append_tokens(request, outcome.tokens, updated)
                continue
            token = result.sampled_token_ids.get(request.request_id)
            if token is None:
                continue
            self._append_tokens(request, [token], updated)
        return updated

    def _append_tokens(self, request: Request, tokens: list[int], updated: list[Request]) -> None:
        """Append a step's new tokens one by one, stopping at the first that ends the
        request (the rest are dropped)."""
        request.num_new_output_tokens = 0
        for token in tokens:
            request.append_output_token_ids([token])
            request.num_new_output_tokens += 1
            try:
                status = self._check_stop(request, token)
            except Exception as exc:  # an extension's error fails its request only
                self._fail(request, exc)
                break
            if status is not None:
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                self._finished(request, status)
                break
        updated.append(request)

    def _fail_scheduled(self, output: SchedulerOutput, error: Exception) -> list[Request]:
        failed = [item.request for item in output.scheduled if not item.request.is_finished]
        for request in failed:
            self._fail(request, error)
        return failed

    def _fail(self, request: Request, error: BaseException) -> None:
        request.failure = error
        self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
            # vLLM reports the id of a stop token as stop_reason, and None for EOS.
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and request.num_output_tokens >= max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.features:
            for ext in self._features(request):
                status = ext.check_token(request, token)
                if status is not None:
                    return status
        return None
