"""One token budget per step: running requests first, then waiting ones.

There is no prefill phase and decode phase: each step gives every scheduled request the
tokens that bring its ``num_computed_tokens`` closer to its ``num_tokens`` (a whole
prompt, a chunk of one, or the one token sampled last step). When the KV cache cannot
hold a running request's next tokens, the lowest-priority running request is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.spec_decode import SpeculativeConfig, can_speculate, make_proposer
from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig
    from pagedllm.core.guided import GuidedDecodingManager
    from pagedllm.core.kv_cache import KVCacheManager

__all__ = ["RunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput", "WaitingQueue"]

logger = logging.getLogger("pagedllm.scheduler")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        guided: GuidedDecodingManager | None = None,
        speculative: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        proposer: Any = None,
    ) -> None:
        self.config = config
        # --enable-lora: the most distinct adapters the running batch may hold.
        self.max_loras = max_loras
        # Speculative decoding: the proposer of draft tokens, and the counts behind the
        # metrics (drafts proposed, drafts kept, steps that verified drafts).
        self.speculative = speculative
        # (a draft model's proposer comes from the engine, which loads the draft)
        self.proposer = proposer if proposer is not None else make_proposer(speculative)
        self.spec_stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.kv = kv_manager
        self.max_model_len = max_model_len
        # Guided decoding: the token mask before a step, each new token's acceptance after.
        self.guided = guided
        self.waiting = WaitingQueue.for_policy(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # --scheduler-delay-factor: when the last step admitted prompts, and how long it took.
        self._prompt_step_time: float | None = None
        self._last_prompt_latency = 0.0
        self._admitted_last_step = False
        # Waiting requests whose constraint failed to compile (appended by the compile
        # future's callback, on whichever thread finished it; drained by schedule()).
        self._compile_failures: deque[Request] = deque()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.guided_compile is not None:
            request.guided_compile.add_done_callback(
                lambda _: (
                    self._compile_failures.append(request)
                    if _compile_error(request) is not None
                    else None
                )
            )

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
            request.status = status
            self.kv.free(request)
            finished.append(request)
        return finished

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
        aborted = self._abort_uncompiled()
        budget = self.config.max_num_batched_tokens
        delay_prompts = self._delay_new_prompts()
        scheduled: dict[Request, ScheduledRequest] = {}
        preempted: list[str] = []

        # Running requests, in order; the victims of preemption come from the back.
        speculate = self.proposer is not None and (
            self.speculative.disable_by_batch_size is None
            or len(self.running) < self.speculative.disable_by_batch_size
        )
        to_draft: list[tuple[ScheduledRequest, int]] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            room = self._draft_room(request, budget) if speculate and num_known == 1 else 0
            num_new = self._limit(request, num_known + room, budget)
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
                to_draft.append((scheduled[request], room))
            budget -= num_new
            index += 1
        budget += self._draft(scheduled, to_draft)

        # Waiting requests, if nothing had to be preempted to fit the running ones.
        partial, long_partial = self._partial_prefill_counts(scheduled)
        skipped: list[Request] = []  # held back (partial-prefill limits, pending work)
        admitted = False
        # --enable-lora: the adapters of the running batch (at most --max-loras of them).
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        while not preempted and not delay_prompts and len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.is_compiling:
                # Still compiling its constraint: the requests behind it go first.
                skipped.append(self.waiting.pop())
                continue
            if not self._lora_fits(request, loras):
                # Its adapter would be one too many in the batch: it waits for a slot.
                skipped.append(self.waiting.pop())
                continue
            if request.is_guided and _compile_error(request) is not None:
                # Failed just now (its done-callback may not have run yet): never admit it.
                self._compile_failures.append(request)
                aborted.extend(self._abort_uncompiled())
                continue
            blocks, num_cached = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._limit(request, remaining, budget)
            if num_cached + num_new < request.num_tokens:
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
            if self.kv.allocate_slots(request, num_new, blocks) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            if request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)
            scheduled[request] = ScheduledRequest(request, num_new, num_cached)
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

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether ``request``'s adapter fits beside the batch's ``loras``."""
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        return lora.lora_int_id in loras or len(loras) < self.max_loras

    def _draft_room(self, request: Request, budget: int) -> int:
        """How many draft tokens a decoding request may get: as many as its budget, its
        max_tokens and the model length leave after the token it samples anyway."""
        if not can_speculate(request):
            return 0
        k = self.speculative.num_speculative_tokens
        limit = self.speculative.max_model_len
        if limit is not None and request.num_tokens + k >= limit:
            return 0  # (too long for the draft: plain decoding from now on)
        params = request.sampling_params
        room = self.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return max(0, min(k, room, budget - 1))

    def _draft(
        self,
        scheduled: dict[Request, ScheduledRequest],
        to_draft: list[tuple[ScheduledRequest, int]],
    ) -> int:
        """Ask the proposer for the drafts of the scheduled decoding requests (their slots
        are allocated: a draft model writes its KV there); a request given fewer than its
        room gives the rest of its tokens back. Returns the budget given back."""
        live = [(item, room) for item, room in to_draft if scheduled.get(item.request) is item]
        if not live:
            return 0
        wanted = [
            (item.request, room, self.kv.get_block_ids(item.request.request_id))
            for item, room in live
        ]
        returned = 0
        for (item, room), drafts in zip(live, self.proposer.propose(wanted), strict=True):
            drafts = list(drafts)[:room]
            item.draft_token_ids = drafts
            item.num_new_tokens -= room - len(drafts)
            returned += room - len(drafts)
        return returned

    def _abort_uncompiled(self) -> list[tuple[Request, BaseException]]:
        """Finish (as aborted) the waiting requests whose constraint failed to compile."""
        aborted = []
        while self._compile_failures:
            request = self._compile_failures.popleft()
            if self.requests.get(request.request_id) is not request:
                continue  # finished or aborted meanwhile
            error = _compile_error(request)
            assert error is not None
            request.failure = error
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            aborted.append((request, error))
        return aborted

    def guided_token_mask(self, output: SchedulerOutput) -> Any:
        """The guided-decoding token mask for the step's sampling requests (bool
        ``[rows, vocab]``, True = allowed), or None when none of them is guided."""
        if self.guided is None:
            return None
        return self.guided.token_mask(output.sampling_requests)

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
        """Advance computed tokens, append sampled tokens, advance guided-decoding
        matchers, and apply the stop conditions that need no text (EOS, stop token ids,
        max_tokens, the model length, a token that breaks its constraint). Returns the
        requests that got a new token, finished ones included, and those the step failed
        on (aborted, with ``failure`` set)."""
        # The step ran: the tails its block copies read may go.
        self.kv.release_copy_sources()
        if result.error is not None:
            return self._fail_scheduled(output, result.error)
        updated = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            drafts = item.draft_token_ids
            request.num_computed_tokens = (
                item.num_computed_tokens + item.num_new_tokens - len(drafts)
            )
            if drafts and request.request_id in result.spec_token_ids:
                tokens = result.spec_token_ids[request.request_id]
                # The kept drafts' KV is valid; the rejected ones' slots are rewritten later.
                request.num_computed_tokens += len(tokens) - 1
                self.spec_stats["drafts"] += 1
                self.spec_stats["draft_tokens"] += len(drafts)
                self.spec_stats["accepted_tokens"] += len(tokens) - 1
                self._append_tokens(request, tokens, updated)
                continue
            if request.request_id in result.pooled:  # a pooling request: done
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                request.status = RequestStatus.FINISHED_STOPPED
                self.kv.free(request)
                updated.append(request)
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
            except Exception as exc:  # a matcher's error fails its request only
                self._fail(request, exc)
                break
            if status is not None:
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                request.status = status
                self.kv.free(request)
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
        if self.guided is not None and not self.guided.accept(request, token):
            # Only when a ban overrode the mask (e.g. min_tokens against a finished
            # constraint): end the output rather than leave the constraint.
            logger.warning(
                "request %s: token %d breaks its guided-decoding constraint; stopping it",
                request.request_id,
                token,
            )
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None


def _compile_error(request: Request) -> BaseException | None:
    """Why the request's finished constraint compile failed, or None (no failure yet)."""
    future = request.guided_compile
    if future is None or not future.done():
        return None
    if future.cancelled():
        return RuntimeError("compiling its constraint was stopped")
    return future.exception()
