"""Only the worker runs the model, so only the worker loads torch: the frontend and
the scheduler of a real `gapserve serve` never map libtorch (issue 44 item 4: torch
alone is ~200 MiB of each process that imports it)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.serve_process import start_serve
from tests.integration.test_services import _children
from tests.integration.tiny_model import tiny_llama_dir


def _service(pid: int) -> str:
    words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return words[words.index(b"gapserve") + 1].decode()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_frontend_and_scheduler_of_a_started_stack_never_load_torch(tmp_path):
    serve = start_serve(tiny_llama_dir(), tmp_path / "serve.log")
    try:
        serve.wait_ready()
        services = {_service(pid): pid for pid in _children(serve.process.pid)}
        assert {"frontend", "scheduler", "worker"} <= services.keys()
        assert _maps_torch(services["worker"])  # the check sees torch where it is
        assert not _maps_torch(services["frontend"])
        assert not _maps_torch(services["scheduler"])
        assert not _maps_torch(serve.process.pid)  # nor `gapserve serve` itself
    finally:
        serve.stop()
