"""Issue 28 item 10: `gapserve status` asks the frontend the shell is set up for:
GAPSERVE_HTTP_PORT (or --http-port) names its port, --url wins over both."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gapserve import status


@pytest.fixture
def frontend():
    """A stand-in HTTP server answering GET /v1/status (the client is what is tested)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"diagnosis": "idle", "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_status_reads_the_frontends_port_from_gapserve_http_port(frontend, monkeypatch, capsys):
    monkeypatch.setenv("GAPSERVE_HTTP_PORT", str(frontend))
    assert status.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"diagnosis": "idle", "path": "/v1/status"}


def test_status_takes_http_port_as_a_flag_and_url_over_both(frontend, monkeypatch, capsys):
    assert status.main(["--http-port", str(frontend)]) == 0
    assert "diagnosis: idle" in capsys.readouterr().out
    monkeypatch.setenv("GAPSERVE_HTTP_PORT", "1")  # nothing listens there
    assert status.main(["--url", f"http://127.0.0.1:{frontend}"]) == 0
    assert status.main([]) == 1
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err
