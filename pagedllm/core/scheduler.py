"""One token budget per step: running requests first, then waiting ones.

There is no prefill phase and decode phase: each step gives every scheduled request the
tokens that bring its ``num_computed_tokens`` closer to its ``num_tokens`` (a whole
prompt, a chunk of one, or the one token sampled last step). When the KV cache cannot
hold a running request's next tokens, the lowest-priority running request is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig
    from pagedllm.core.kv_cache import KVCacheManager


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # num_computed_tokens when the step starts (cached prefix included).
    num_computed_tokens: int

    @property
    def reaches_end(self) -> bool:
        """Whether this step computes the request's last known token, so it samples."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS: arrival order, preempted requests back at the front. Priority: lowest
    ``priority`` value first, then arrival."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request, *, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(request)
        else:
            key = (request.priority, request.arrival_time, next(self._counter), request)
            heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._fifo = deque(r for r in self._fifo if r not in requests)
        else:
            self._heap = [e for e in self._heap if e[3] not in requests]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._fifo)
        return iter(e[3] for e in sorted(self._heap))


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # --scheduler-delay-factor: when the last step admitted prompts, and how long it took.
        self._prompt_step_time: float | None = None
        self._last_prompt_latency = 0.0
        self._admitted_last_step = False

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
        budget = self.config.max_num_batched_tokens
        delay_prompts = self._delay_new_prompts()
        scheduled: dict[Request, ScheduledRequest] = {}
        preempted: list[str] = []

        # Running requests, in order; the victims of preemption come from the back.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._limit(request, request.num_tokens - request.num_computed_tokens, budget)
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
            budget -= num_new
            index += 1

        # Waiting requests, if nothing had to be preempted to fit the running ones.
        partial, long_partial = self._partial_prefill_counts(scheduled)
        skipped: list[Request] = []  # held back (partial-prefill limits, pending work)
        admitted = False
        while not preempted and not delay_prompts and len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.pending is not None and not request.pending.done():
                # Still compiling its constraint: the requests behind it go first.
                skipped.append(self.waiting.pop())
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
            scheduled[request] = ScheduledRequest(request, num_new, num_cached)
            budget -= num_new
            admitted = True
        for request in reversed(skipped):
            self.waiting.add(request, front=True)

        self._admitted_last_step = admitted
        if admitted:
            self._prompt_step_time = time.monotonic()
        items = list(scheduled.values())
        return SchedulerOutput(
            scheduled=items,
            num_scheduled_tokens=sum(s.num_new_tokens for s in items),
            preempted_request_ids=preempted,
        )

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

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply the stop conditions that
        need no text (EOS, stop token ids, max_tokens, the model length). Returns the
        requests that got a new token, finished ones included."""
        updated = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            token = sampled_token_ids.get(request.request_id)
            if token is None:
                continue
            request.append_output_token_ids([token])
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                request.status = status
                self.kv.free(request)
            updated.append(request)
        return updated

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
        return None
