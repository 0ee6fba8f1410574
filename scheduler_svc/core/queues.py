"""WAITING queues: FCFS (a deque) or priority (a heap on (priority, arrival)).

Removal of an aborted request is lazy: it is marked finished and dropped when it
reaches the head, so abort and finish are O(1) and schedule() never scans the queue.

A `deferred` request (its grammar is compiling: core/grammar_wait.py) keeps its place
but is skipped: peek() and pop() give the first request that is ready, so the ones
behind it are admitted meanwhile. Only deferred requests ahead of it are looked at.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from scheduler_svc.core.request import Request, RequestStatus


class FCFSQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()
        self._live = 0

    def add(self, request: Request) -> None:
        self._items.append(request)
        self._live += 1

    def prepend(self, request: Request) -> None:
        """Put a preempted (or skipped) request back at the front."""
        self._items.appendleft(request)
        self._live += 1

    def prepend_all(self, requests: list[Request]) -> None:
        """Put requests back at the front, keeping their order."""
        for request in reversed(requests):
            self.prepend(request)

    def peek(self) -> Request | None:
        items = self._items
        while items and items[0].status >= RequestStatus.FINISHED_STOPPED:
            items.popleft()
        if items and items[0].deferred:
            return self._first_ready()
        return items[0] if items else None

    def _first_ready(self) -> Request | None:
        for request in self._items:
            if not request.deferred and request.status < RequestStatus.FINISHED_STOPPED:
                return request
        return None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        if self._items[0] is request:
            self._items.popleft()
        else:  # behind deferred ones, which keep their places
            self._items.remove(request)
        self._live -= 1
        return request

    def discard(self, request: Request) -> None:
        """Forget a request that was just marked finished (dropped lazily)."""
        self._live -= 1

    def remove(self, request: Request) -> None:
        """Take out a request wherever it is (a suspect admitted alone: step_failure.py)."""
        self._items.remove(request)
        self._live -= 1

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._items if not r.is_finished)


class PriorityQueue:
    """Lower priority value first, then earlier arrival; a preempted request keeps its
    key, so it goes back ahead of everything that arrived after it."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._live = 0

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    next(self._counter), request))
        self._live += 1

    prepend = add

    def prepend_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request | None:
        entry = self._head()
        return None if entry is None else entry[3]

    def _head(self) -> tuple | None:
        """The first ready entry; deferred ones are set aside and pushed back with
        their keys, so they keep their places."""
        heap = self._heap
        aside = []
        while heap and (heap[0][3].status >= RequestStatus.FINISHED_STOPPED
                        or heap[0][3].deferred):
            entry = heapq.heappop(heap)
            if entry[3].status < RequestStatus.FINISHED_STOPPED:
                aside.append(entry)
        head = heap[0] if heap else None
        for entry in aside:
            heapq.heappush(heap, entry)
        return head

    def pop(self) -> Request:
        entry = self._head()
        if entry is None:
            raise IndexError("pop from an empty waiting queue")
        heap = self._heap
        if heap[0] is entry:
            heapq.heappop(heap)
        else:
            heap.remove(entry)
            heapq.heapify(heap)
        self._live -= 1
        return entry[3]

    def discard(self, request: Request) -> None:
        self._live -= 1

    def remove(self, request: Request) -> None:
        """Take out a request wherever it is (a suspect admitted alone: step_failure.py)."""
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)
        self._live -= 1

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if not e[3].is_finished)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
