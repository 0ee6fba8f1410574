"""WAITING queues: FCFS (a deque) or priority (a heap on (priority, arrival)).

Removal of an aborted request is lazy: it is marked finished and dropped when it
reaches the head, so abort and finish are O(1) and schedule() never scans the queue.
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
        return items[0] if items else None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        self._items.popleft()
        self._live -= 1
        return request

    def discard(self, request: Request) -> None:
        """Forget a request that was just marked finished (dropped lazily)."""
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
        heap = self._heap
        while heap and heap[0][3].status >= RequestStatus.FINISHED_STOPPED:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self._live -= 1
        return request

    def discard(self, request: Request) -> None:
        self._live -= 1

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if not e[3].is_finished)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
