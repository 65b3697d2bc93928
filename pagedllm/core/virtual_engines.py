"""Several steps in flight: virtual engines.

An executor whose ranks can compute several steps at once (pipeline stages: stage 0
computes step ``v + 1`` while the later stages run step ``v``) says so in
``Executor.steps_in_flight``. The engine then runs that many *virtual engines*: one
scheduler each, all over the one KV cache manager, each with its own requests (a new
request goes to the one with the fewest). A virtual engine has at most one step in
flight, so its scheduler never meets a request whose step is still being computed (it
neither schedules nor preempts one), and it is scheduled again only once that step came
back.

The KV blocks are one pool: a virtual engine allocates, evicts cached blocks and frees
its requests' blocks while another's step is in flight. That is safe because every rank
computes the steps in the order they were started: a block freed (a request aborted in
flight) and given to a later step is written by that step after the earlier one is
done with it, and a block a later step finds in the prefix cache was written by the
earlier step first.

:class:`StepQueue` is the engine's side: each :meth:`StepQueue.step` starts a step for
every virtual engine without one in flight, then finishes the oldest step.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import EngineDeadError
from pagedllm.core.step_data import RunnerOutput

if TYPE_CHECKING:
    from pagedllm.core.interfaces.executor import Executor
    from pagedllm.core.interfaces.scheduler import SchedulerInterface
    from pagedllm.core.outputs import RequestOutput
    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.step_data import SchedulerOutput


class VirtualEngines:
    """The schedulers of the virtual engines, seen as one by the engine, its stat
    logger and its entry points (requests are added and finished here, counts are
    summed)."""

    def __init__(self, schedulers: Sequence[SchedulerInterface]) -> None:
        self.schedulers = list(schedulers)

    @property
    def requests(self) -> collections.ChainMap[str, Request]:
        """Every unfinished request, by id."""
        return collections.ChainMap(*(s.requests for s in self.schedulers))

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def extension_stats(self) -> dict[str, int]:
        # (The step extensions are shared: every scheduler reports the same counters.)
        return self.schedulers[0].extension_stats()

    def add_request(self, request: Request) -> None:
        """Queue ``request`` on the virtual engine with the fewest requests."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        min(self.schedulers, key=lambda s: len(s.requests)).add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        ids = list(request_ids)
        finished = []
        for scheduler in self.schedulers:
            mine = [i for i in ids if i in scheduler.requests]
            if mine:
                finished.extend(scheduler.finish_requests(mine, status))
        return finished


@dataclasses.dataclass(slots=True)
class _Started:
    """A step in flight: its virtual engine's scheduler, what it scheduled, and the
    executor's handle (or the error that failed it before it started)."""

    scheduler: SchedulerInterface
    output: SchedulerOutput
    handle: Any = None
    error: Exception | None = None


class StepQueue:
    """The steps in flight, oldest first. ``finish(scheduler, output, result)`` is the
    engine's end of a step (update, outputs, stop checks); it gives the step's
    outputs."""

    def __init__(
        self,
        engines: VirtualEngines,
        executor: Executor,
        finish: Callable[[SchedulerInterface, SchedulerOutput, RunnerOutput], list[RequestOutput]],
    ) -> None:
        self.engines = engines
        self.executor = executor
        self._finish = finish
        self._in_flight: collections.deque[_Started] = collections.deque()
        # Steps started while another was in flight (the tests read it).
        self.num_overlapped = 0

    def __len__(self) -> int:
        return len(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Start a step for each virtual engine with none in flight (an empty one's
        aborted requests are finished now), then finish the oldest step in flight."""
        outputs: list[RequestOutput] = []
        busy = {id(started.scheduler) for started in self._in_flight}
        for scheduler in self.engines.schedulers:
            if id(scheduler) in busy:
                continue
            output = scheduler.schedule()
            if output.is_empty:
                if output.aborted:
                    outputs.extend(self._finish(scheduler, output, RunnerOutput()))
                continue
            self.num_overlapped += int(bool(self._in_flight))
            self._in_flight.append(self._start(scheduler, output))
        if self._in_flight:
            outputs.extend(self._collect(self._in_flight.popleft()))
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish every step in flight."""
        outputs: list[RequestOutput] = []
        while self._in_flight:
            outputs.extend(self._collect(self._in_flight.popleft()))
        return outputs

    def _start(self, scheduler: SchedulerInterface, output: SchedulerOutput) -> _Started:
        started = _Started(scheduler, output)
        try:
            token_mask = scheduler.token_mask(output)
            started.handle = self.executor.submit(output, token_mask)
        except EngineDeadError:
            raise
        except Exception as exc:  # (fails this step's requests only)
            started.error = exc
        return started

    def _collect(self, started: _Started) -> list[RequestOutput]:
        if started.error is not None:
            result = RunnerOutput(error=started.error)
        else:
            try:
                result = self.executor.collect(started.handle)
            except EngineDeadError:
                raise
            except Exception as exc:
                result = RunnerOutput(error=exc)
        return self._finish(started.scheduler, started.output, result)
