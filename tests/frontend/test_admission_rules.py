"""Admission, API keys and the HTTP guard as rules: the bound counts choices and
frees them, keys compare exactly, a priority claim needs a priority key, and any
unexpected exception is a 500 in OpenAI's error shape."""

import grpc
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from structlog.testing import capture_logs

from frontend_svc.request.admission import Admission
from frontend_svc.api.auth import ANONYMOUS, ApiKeys, Forbidden, Unauthenticated, bearer
from frontend_svc.errors import EngineError
from frontend_svc.api.http_guard import HttpGuard
from frontend_svc.api.http_util import install_error_handlers
from shared.types import InvalidRequestError


def test_admission_holds_places_for_the_duration_and_refuses_past_the_bound():
    adm = Admission(max_queued_requests=3)
    adm.max_num_seqs = 2
    with adm.admit(4):
        assert adm.in_flight == 4
        with pytest.raises(EngineError) as info:
            with adm.admit(2):
                pass
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.http_status == 429
        with adm.admit(1):
            assert adm.in_flight == 5
    assert adm.in_flight == 0


def test_a_request_larger_than_the_whole_bound_is_a_400_not_a_429():
    adm = Admission(max_queued_requests=3)
    with pytest.raises(InvalidRequestError, match="--max-queued-requests"):
        adm.check(4)


def test_bearer_tokens_are_parsed_strictly():
    assert bearer("Bearer abc") == "abc" and bearer(b"bearer  abc ") == "abc"
    assert bearer("abc") is None and bearer("Basic abc") is None and bearer("Bearer ") is None


def test_keys_identify_callers_and_gate_priority():
    keys = ApiKeys(("k1", "k2"), ("pk",))
    assert keys.identify("k2") == "k2" and keys.identify("pk") == "pk"
    for bad in (None, "k", "k1 ", "K1"):
        with pytest.raises(Unauthenticated):
            keys.identify(bad)
    keys.check_priority("k1", 0)
    keys.check_priority("pk", -(2**31))
    with pytest.raises(Forbidden):
        keys.check_priority("k1", 1)


def test_without_keys_everyone_is_anonymous_and_may_set_priority():
    keys = ApiKeys()
    assert keys.identify(None) == ANONYMOUS
    keys.check_priority(ANONYMOUS, 5)


def test_an_unexpected_exception_is_a_500_in_openai_s_shape_logged_once():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/boom")
    async def boom():
        raise RuntimeError("a bug")

    app.add_middleware(HttpGuard, keys=ApiKeys(), payload_limit=100)
    # raise_server_exceptions: the error must not reach Starlette, which re-raises it
    # for uvicorn to log a second time
    with capture_logs() as logs:
        reply = TestClient(app, raise_server_exceptions=True).post("/v1/boom")
    assert reply.status_code == 500
    assert reply.json() == {"error": {"message": "internal server error",
                                      "type": "server_error", "param": None, "code": 500}}
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["unexpected error"]


def test_a_wrong_method_is_a_405_typed_as_an_invalid_request():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions():
        return {}

    reply = TestClient(app).get("/v1/completions")
    assert reply.status_code == 405
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_the_guard_answers_401_and_413_before_the_route_runs():
    app = FastAPI()
    install_error_handlers(app)
    seen = []

    @app.post("/v1/echo")
    async def echo(body: dict):
        seen.append(body)
        return body

    app.add_middleware(HttpGuard, keys=ApiKeys(("k",)), payload_limit=100)
    client = TestClient(app)
    assert client.post("/v1/echo", json={"a": 1}).status_code == 401
    ok = {"Authorization": "Bearer k"}
    assert client.post("/v1/echo", json={"a": 1}, headers=ok).json() == {"a": 1}
    big = client.post("/v1/echo", json={"a": "x" * 200}, headers=ok)
    assert big.status_code == 413 and "--payload-limit" in big.json()["error"]["message"]
    assert seen == [{"a": 1}]
