"""deploy/healthcheck.py over HTTP (the frontend's probe): healthy only on a 2xx from
the URL; a 503 (scheduler not connected), a 404 or nothing listening is unhealthy."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .compose_file import ROOT


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        code = {"/health": 200, "/starting": 503}.get(self.path, 404)
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _probe(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "deploy" / "healthcheck.py"), url],
                          capture_output=True, text=True, timeout=30)


def test_a_2xx_is_healthy(server):
    result = _probe(f"{server}/health")
    assert result.returncode == 0 and "HTTP 200" in result.stdout


@pytest.mark.parametrize("path, seen", [("/starting", "HTTP 503"), ("/nope", "HTTP 404")])
def test_an_error_status_is_unhealthy_and_says_which(server, path, seen):
    result = _probe(f"{server}{path}")
    assert result.returncode == 1 and seen in result.stderr


def test_nothing_listening_is_unhealthy():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        result = _probe(f"http://127.0.0.1:{port}/health")
    assert result.returncode == 1 and "refused" in result.stderr.lower()
