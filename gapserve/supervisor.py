"""The processes `gapserve serve` runs: starting them, knowing they are its own and
healthy, restarting one that dies (with backoff, up to a limit), stopping them all,
and saying why, last, when it gives up.

Each child's output passes through here (a thread per stream copies it on, to the
terminal or its log file), so the line that says why a child stopped is known: the
last "gapserve <service>: ..." line it wrote on stderr (every service refuses in
one such line), else its traceback's last line.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from shared.config import NICE_ENV
from shared.grpc_server import check_health
from shared.instance import HEADER as INSTANCE_HEADER
from shared.instance import health_service
from shared.link_security import LinkSecurity

STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM, before SIGKILL
POLL_S = 0.5  # how often the supervisor looks at its children
# A child that dies is restarted after 0.5 s, 1 s, 2 s, ... (at most 30 s); one that
# died RESTART_LIMIT times within RESTART_WINDOW_S is given up on, and serve stops.
RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 0.5, 30.0
RESTART_LIMIT, RESTART_WINDOW_S = 5, 600.0
# the line that says why: a service's own refusal, or an exception's last line
_WHY = re.compile(rb"^(gapserve [\w-]+: |[\w.]*(Error|Exception|Interrupt|Exit)\b)")


def _binary(stream) -> BinaryIO:
    """Where a child's bytes go on our terminal (a replaced stream may have no buffer)."""
    return getattr(stream, "buffer", None) or _TextSink(stream)


class _TextSink:
    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


def _with_nice(child: Child) -> str:
    """The child's name, and its niceness where it starts with one (--helper-nice)."""
    nice = child.env.get(NICE_ENV)
    return f"{child.name} (nice {nice})" if nice else child.name


def restart_delay(failures: int, first_s: float = RESTART_BACKOFF_S) -> float:
    """Seconds before the restart that follows the failures-th failure in the window
    (first_s: the first delay; GAPSERVE_RESTART_BACKOFF_S sets it, for tests)."""
    return min(first_s * 2 ** max(failures - 1, 0), RESTART_BACKOFF_MAX_S)


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]  # after `python -m gapserve`
    health_address: str
    http_health_url: str | None = None
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # secrets, GAPSERVE_* variables
    security: LinkSecurity = field(default_factory=LinkSecurity)
    instance_id: str | None = None  # given with --instance-id; its health must report it
    ports: list[tuple[str, int, str]] = field(default_factory=list)  # (host, port, serve's flag)
    last_error: str = ""  # why its last run stopped, in its own words (module docstring)
    error_at: float = 0.0  # monotonic time last_error was written
    failures: deque = field(default_factory=deque)  # monotonic times it died on its own
    restart_at: float | None = None  # when it is due to be started again
    signalled: bool = False  # stopped by us (stop_all), not on its own
    copiers: list[threading.Thread] = field(default_factory=list)

    def healthy(self) -> bool:
        service = health_service(self.instance_id) if self.instance_id else ""
        if not check_health(self.health_address, timeout_s=1.0, service=service,
                            security=self.security):
            return False
        if self.http_health_url is None:
            return True
        # our own child on loopback: its HTTPS certificate is not what is checked here
        context = ssl._create_unverified_context() \
            if self.http_health_url.startswith("https") else None
        try:
            with urllib.request.urlopen(self.http_health_url, timeout=1.0,
                                        context=context) as reply:
                return reply.status == 200 and (
                    self.instance_id is None
                    or reply.headers.get(INSTANCE_HEADER) == self.instance_id)
        except OSError:
            return False

    def exit_line(self) -> str:
        """Why it stopped: its own last error, else its exit code."""
        code = self.process.returncode if self.process is not None else None
        return self.last_error or f"{self.name} exited with code {code}"


@dataclass(slots=True)
class Supervisor:
    children: list[Child]
    stop: threading.Event = field(default_factory=threading.Event)
    log_dir: Path | None = None
    env: dict[str, str] | None = None
    restarts: int = 0
    backoff_s: float = RESTART_BACKOFF_S  # the first restart delay
    _write: threading.Lock = field(default_factory=threading.Lock)

    def start(self, log_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        """Start every child; with log_dir, each writes its output to <name>.log there."""
        self.log_dir, self.env = log_dir, env
        for child in self.children:
            self.launch(child)

    def launch(self, child: Child, env: dict[str, str] | None = None) -> None:
        """(Re)start one child with the same flags (its log is appended to); env
        replaces the supervisor's environment for this launch only. The child's own
        env (its secrets) is laid over either."""
        base = env if env is not None else self.env if self.env is not None else os.environ
        for thread in child.copiers:  # the last run's output is all out (and said) first
            thread.join(STOP_TIMEOUT_S)
        child.process = subprocess.Popen(
            [sys.executable, "-m", "gapserve", *child.argv], env={**base, **child.env},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        child.last_error, child.error_at, child.restart_at, child.signalled = "", 0.0, None, False
        log = None if self.log_dir is None else open(self.log_dir / f"{child.name}.log", "ab")
        copiers = [
            threading.Thread(target=self._copy, args=(child, child.process.stdout,
                                                      log or _binary(sys.stdout), False),
                             name=f"{child.name}-stdout", daemon=True),
            threading.Thread(target=self._copy, args=(child, child.process.stderr,
                                                      log or _binary(sys.stderr), True),
                             name=f"{child.name}-stderr", daemon=True)]
        for thread in copiers:
            thread.start()
        if log is not None:  # closed once both copiers are done with it
            threading.Thread(target=lambda: ([t.join() for t in copiers], log.close()),
                             daemon=True).start()
        child.copiers = copiers

    def _copy(self, child: Child, pipe: BinaryIO, out: BinaryIO, is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            if is_stderr and _WHY.match(line):
                child.last_error = line.decode(errors="replace").rstrip()
                child.error_at = time.monotonic()
            with self._write:
                out.write(line)
                out.flush()
        pipe.close()

    def say(self, text: str, stream: TextIO | None = None) -> None:
        """serve's own lines (on stderr unless told), never amid a child's line."""
        with self._write:
            print(text, file=stream or sys.stderr, flush=True)

    def dead(self) -> Child | None:
        return next((c for c in self.children
                     if c.restart_at is None and c.process.poll() is not None), None)

    def wait_healthy(self, timeout_s: float) -> str | None:
        """None once all are healthy; otherwise why not."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        self.say(f"gapserve serve: starting {', '.join(_with_nice(c) for c in pending)}; "
                 "waiting for each to report ready")
        while pending:
            if self.stop.is_set():
                return "interrupted"
            if (child := self.dead()) is not None:
                return f"{child.name} exited with code {child.process.returncode}"
            if time.monotonic() > deadline:
                return f"{', '.join(c.name for c in pending)} not healthy after {timeout_s:.0f} s"
            ready = [c for c in pending if c.healthy()]
            for child in ready:  # each service's readiness, as it comes (the worker last)
                self.say(f"gapserve serve: {child.name} ready "
                         f"({timeout_s - (deadline - time.monotonic()):.0f} s)")
            pending = [c for c in pending if c not in ready]
            if pending:
                self.stop.wait(POLL_S)
        return None

    def supervise(self) -> Child | None:
        """Restart children that die, each after its backoff, until told to stop
        (None) or until one died RESTART_LIMIT times within RESTART_WINDOW_S: that
        one is returned (the caller stops all, then says its last error)."""
        while not self.stop.wait(POLL_S):
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        self.launch(child)
                        self.restarts += 1
                    continue
                if child.process.poll() is None:
                    continue
                child.failures.append(now)
                while child.failures and child.failures[0] < now - RESTART_WINDOW_S:
                    child.failures.popleft()
                code = child.process.returncode
                if len(child.failures) >= RESTART_LIMIT:
                    self.say(f"gapserve serve: {child.name} exited {len(child.failures)} "
                             f"times within {RESTART_WINDOW_S:.0f} s (last with code "
                             f"{code}); giving up and stopping")
                    return child
                delay = restart_delay(len(child.failures), self.backoff_s)
                # The others carry on (docs/resilience.md): a restarted worker is
                # reconnected by the scheduler, a restarted scheduler by the frontend.
                self.say(f"gapserve serve: {child.name} exited with code {code}; "
                         f"restarting it in {delay:g} s")
                child.restart_at = now + delay
        return None

    def cause(self) -> Child | None:
        """After stop_all: the child whose error to show last, of those that failed
        on their own: the one that said why first (a worker says so before it stops
        its server, so before a scheduler or a rank that loses it says anything),
        then upstream first (the start order: workers, scheduler, frontend)."""
        failed = [c for c in self.children if c.process is not None
                  and c.process.returncode not in (None, 0)
                  and not (c.signalled and c.process.returncode < 0)]
        ranked = sorted(failed, key=lambda c: (not c.last_error, c.error_at,
                                               self.children.index(c)))
        return ranked[0] if ranked else None

    def stop_all(self) -> None:
        """SIGTERM in reverse start order (frontend first), SIGKILL after a timeout;
        then the rest of their output is copied out."""
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.signalled = True
                child.process.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            if child.process is None:
                continue
            try:
                child.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        for child in self.children:
            for thread in child.copiers:
                thread.join(STOP_TIMEOUT_S)  # a grandchild could hold the pipe open
