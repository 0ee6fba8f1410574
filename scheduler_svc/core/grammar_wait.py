"""The deferred state "grammar compiling" (docs/scheduling.md, pass 2's not-ready rule;
docs/structured_outputs.md).

A request with a structured output cannot sample before its grammar is compiled, and
compiling is the workers' job (rank 0 owns each request's matcher and masks its
logits): the scheduler only holds the request back. On arrival it is marked
`deferred` and stays where it is in WAITING; the queue skips it (queues.py) while
every other request is admitted past it. The next step announces its grammar
(SchedulerOutput.grammar_compiles); rank 0 compiles it in the background and names it
in a later answer (ModelRunnerOutput.grammars_ready), which clears `deferred`, so the
request is admitted from its own place: WAITING -> deferred -> WAITING.

When nothing else runs, the engine sends empty steps to hear about the compile
(`needs_poll`); the worker holds such a step until a compile ends or a short bound.
A spec the workers reported compiled before is not deferred again: rank 0's cache
holds it (the scheduler remembers as many specs as that cache does, most recent
first; were one evicted all the same, rank 0 would compile it at admission, correct
but on the step). A worker loss forgets its compiled grammars: every request with a grammar that has
not run yet is deferred again and re-announced (`requeue_all`). Correctness does not
rest on any of this: a worker handed a request whose grammar it has not compiled
compiles it on the spot; the deferral only keeps the compile off everyone's step.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler_svc.core.request import Request, RequestStatus
from shared.structured.spec import CACHE_SIZE, StructuredOutputSpec


class GrammarWait:
    def __init__(self) -> None:
        self.compiling: dict[str, Request] = {}  # deferred, announced or about to be
        self._to_announce: dict[str, StructuredOutputSpec] = {}
        self.failures: list[tuple[str, str]] = []  # (req_id, message) for the engine
        self.num_deferred_total = 0
        self._compiled: OrderedDict[tuple, None] = OrderedDict()  # spec keys rank 0 holds

    def on_add(self, request: Request) -> None:
        """A new request: deferred if it has a grammar."""
        spec = request.sampling_params.structured_output
        if spec is None:
            return
        if spec.key() in self._compiled:
            self._compiled.move_to_end(spec.key())
            return  # compiled at the workers already: ready at once
        self._defer(request, spec)

    def _defer(self, request: Request, spec: StructuredOutputSpec) -> None:
        request.deferred = True
        self.compiling[request.req_id] = request
        self._to_announce[request.req_id] = spec
        self.num_deferred_total += 1

    def announcements(self) -> dict[str, StructuredOutputSpec]:
        """The grammars the next step asks the workers to compile (each once)."""
        out, self._to_announce = self._to_announce, {}
        return {r: s for r, s in out.items() if r in self.compiling}

    def needs_poll(self) -> bool:
        """Deferred requests whose readiness only a worker's answer can bring."""
        return bool(self.compiling)

    def on_output(self, ready: list[str], errors: dict[str, str]) -> list[Request]:
        """Apply a step's answer: ready requests go back to WAITING where they stood;
        returns the requests whose grammar failed (the caller ends them)."""
        for req_id in ready:
            request = self.compiling.pop(req_id, None)
            if request is not None:
                request.deferred = False
                self._remember(request.sampling_params.structured_output.key())
        failed = []
        for req_id, message in errors.items():
            request = self.compiling.pop(req_id, None)
            if request is not None and not request.is_finished:
                request.deferred = False
                self.failures.append((req_id, message))
                failed.append(request)
        return failed

    def _remember(self, key: tuple) -> None:
        self._compiled[key] = None
        self._compiled.move_to_end(key)
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)

    def on_finish(self, request: Request) -> None:
        self.compiling.pop(request.req_id, None)
        self._to_announce.pop(request.req_id, None)

    def requeue_all(self, requests) -> None:
        """The workers were lost with their compiled grammars: every waiting request
        with a grammar is deferred and announced again (a running one was preempted
        just before and waits too)."""
        self._compiled.clear()
        for request in requests:
            spec = request.sampling_params.structured_output
            if spec is not None and request.status in (RequestStatus.WAITING,
                                                       RequestStatus.PREEMPTED):
                self._defer(request, spec)

    def take_failures(self) -> list[tuple[str, str]]:
        out, self.failures = self.failures, []
        return out

    @property
    def num_deferred(self) -> int:
        return len(self.compiling)
