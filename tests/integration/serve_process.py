"""`gapserve serve` as a real process for tests: on free loopback ports, its output
in a file, stopped with SIGTERM at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.integration.conftest import TINY_FLAGS
from tests.ports import free_ports
from tests.wire.session_client import wait_for

READY = b"gapserve: serving"


@dataclass(slots=True)
class Serve:
    process: subprocess.Popen
    log: Path
    ports: dict[str, int]  # flag -> port

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self) -> list[str]:
        """Its output without the services' JSON log lines: what a person reads."""
        return [line for line in self.output().splitlines()
                if line.strip() and not line.startswith("{")]

    def wait(self, timeout_s: float = 300) -> int:
        return self.process.wait(timeout_s)

    def wait_ready(self) -> None:
        wait_for(lambda: READY in self.log.read_bytes() or self.process.poll() is not None,
                 timeout_s=300, what="gapserve serve to report ready")
        assert self.process.poll() is None, self.output()[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def port_flags() -> dict[str, int]:
    http, grpc_port, sched, worker, sched_metrics, worker_metrics = free_ports(6)
    return {"--http-port": http, "--grpc-port": grpc_port, "--scheduler-port": sched,
            "--worker-port": worker, "--scheduler-metrics-port": sched_metrics,
            "--worker-metrics-port": worker_metrics}


def start_serve(model_dir: Path, log: Path, *flags: str,
                ports: dict[str, int] | None = None,
                env: dict[str, str] | None = None) -> Serve:
    """`gapserve serve` with the tiny flags (then `flags`), not waited for; env is
    added to its environment (none of this process's GAPSERVE_ variables is)."""
    ports = ports or port_flags()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")},
           "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gapserve", "serve", "--model", str(model_dir),
             *(str(x) for kv in ports.items() for x in kv),
             "--log-format", "json", *TINY_FLAGS, *flags],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    return Serve(proc, log, ports)
