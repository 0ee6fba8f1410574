"""The stack with the observability profile (`docker compose --env-file
deploy/observability.env up`), run as local processes: every gapserve service sends
its traces to the OTLP endpoint the env file names (a local receiver stands in for
Jaeger)."""

from __future__ import annotations

import time

import httpx
import pytest

from .compose_file import OBSERVABILITY_ENV, environment, load_compose
from .local_stack import running_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    doc = load_compose(OBSERVABILITY_ENV)
    with running_stack(doc, tmp_path_factory.mktemp("compose-logs")) as stack:
        yield stack


def test_traces_reach_the_otlp_endpoint_the_profile_sets(stack):
    http_port = int(environment(stack.doc["services"]["frontend"])["GAPSERVE_HTTP_PORT"])
    base = f"http://{stack.ports.address('frontend', http_port)}/v1"
    reply = httpx.post(f"{base}/completions", timeout=120, json={
        "model": httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"],
        "prompt": "Hello", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    receiver = stack.receivers["jaeger"]
    deadline = time.monotonic() + 30  # the batch span processor exports every few seconds
    while len(receiver.services) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # waiting on another process's timer; nothing to join
    assert len(receiver.services) >= 3, receiver.services
