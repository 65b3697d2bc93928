"""The scheduler's queue of requests waiting to run: one class per ``--scheduling-policy``."""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import ClassVar

from pagedllm.core.request import Request


class WaitingQueue(abc.ABC):
    """Requests not running, in the order the scheduler admits them. A preempted
    request goes back with ``front=True``: it runs again before newer ones."""

    # --scheduling-policy value -> class
    policies: ClassVar[dict[str, type[WaitingQueue]]] = {}
    policy: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        WaitingQueue.policies[cls.policy] = cls

    @classmethod
    def for_policy(cls, policy: str) -> WaitingQueue:
        if policy not in cls.policies:
            raise ValueError(
                f"unknown scheduling policy {policy!r} (choose from {', '.join(cls.policies)})"
            )
        return cls.policies[policy]()

    @abc.abstractmethod
    def add(self, request: Request, *, front: bool = False) -> None: ...

    @abc.abstractmethod
    def peek(self) -> Request:
        """The request to admit next (the queue is not empty)."""

    @abc.abstractmethod
    def pop(self) -> Request: ...

    @abc.abstractmethod
    def remove(self, requests: set[Request]) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In admission order."""


class FCFSQueue(WaitingQueue):
    """Arrival order; preempted requests back at the front."""

    policy = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request, *, front: bool = False) -> None:
        if front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, requests: set[Request]) -> None:
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(WaitingQueue):
    """Lowest ``priority`` value first, then arrival. ``front`` changes nothing: a
    preempted request keeps its place by priority and arrival."""

    policy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request, *, front: bool = False) -> None:
        key = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, requests: set[Request]) -> None:
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(entry[3] for entry in sorted(self._heap))
