"""Authentication against the real stack: API keys on HTTP (Authorization: Bearer)
and gRPC (metadata), /health and /metrics open, priority claims only for
--priority-keys, gRPC Abort only for the caller's own requests, the inner
services refusing callers without the internal token; and every accepted field
does something (logit_bias steers sampling; unknown roles, response_format and
tools are 400s)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc, generate_pb2, \
    worker_pb2, worker_pb2_grpc
from tests.integration.conftest import TINY_FLAGS, start_stack

KEY, OTHER_KEY, PRIORITY_KEY, TOKEN = "key-one", "key-two", "key-priority", "inner-secret"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("auth-stack"),
                        flags=[*TINY_FLAGS, "--api-key", f"{KEY},{OTHER_KEY}",
                               "--priority-keys", PRIORITY_KEY, "--internal-token", TOKEN])
    yield stack
    stack.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(stack, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    return httpx.post(stack.http_url + path, json=body, timeout=60,
                      headers=bearer(key) if key else {})


COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_health_and_metrics_are_open_and_everything_else_needs_a_key(stack):
    assert httpx.get(stack.http_url + "/health").status_code == 200
    assert httpx.get(stack.http_url + "/ping").status_code == 200  # /health's twin, a probe
    assert httpx.get(stack.http_url + "/metrics").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/status"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/responses"), ("GET", "/version"),
                         ("POST", "/tokenize"), ("GET", "/no-such-route")]:
        for headers in ({}, bearer("wrong"), {"Authorization": KEY}):
            reply = httpx.request(method, stack.http_url + path, json={}, headers=headers)
            assert reply.status_code == 401, (path, headers, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "invalid_api_key" and error["message"]
            assert error["type"] == "authentication_error"
    for key in (KEY, OTHER_KEY, PRIORITY_KEY):
        assert post(stack, "/v1/completions", COMPLETION, key).status_code == 200


def test_the_openai_client_authenticates_with_its_api_key(stack):
    good = openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=stack.served_model_name, prompt="hi",
                                   max_tokens=2).choices[0].text is not None
    bad = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_a_priority_claim_needs_a_priority_key(stack):
    for path, body in [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]:
        refused = post(stack, path, {**body, "priority": -(2**31)}, KEY)
        assert refused.status_code == 403, refused.text
        assert "--priority-keys" in refused.json()["error"]["message"]
        assert post(stack, path, {**body, "priority": 0}, KEY).status_code == 200
        assert post(stack, path, {**body, "priority": -5}, PRIORITY_KEY).status_code == 200


# ---- gRPC


def generate_request(**kw) -> generate_pb2.GenerateRequest:
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    params.update(kw.pop("params", {}))
    kw.setdefault("token_ids", {"ids": [1, 2, 3]})
    return generate_pb2.GenerateRequest(sampling_params=params, **kw)


def grpc_key(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_grpc_calls_need_a_key_and_health_stays_open(stack):
    stub = stack.generation_stub()
    for metadata in ([], grpc_key("wrong")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_request(), metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for call, msg in [(stub.Abort, generate_pb2.AbortRequest(request_ids=["x"])),
                          (stub.Tokenize, generate_pb2.TokenizeRequest(text="hi")),
                          (stub.GetModelInfo, common_pb2.GetModelInfoRequest())]:
            with pytest.raises(grpc.RpcError) as info:
                call(msg, metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    messages = list(stub.Generate(generate_request(), metadata=grpc_key(KEY), timeout=60))
    assert messages[-1].final.usage.completion_tokens == 4
    health = health_pb2_grpc.HealthStub(stack.channel(stack.grpc_address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_a_grpc_priority_claim_needs_a_priority_key(stack):
    stub = stack.generation_stub()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate_request(priority=-7), metadata=grpc_key(KEY), timeout=30))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ok = list(stub.Generate(generate_request(priority=-7), metadata=grpc_key(PRIORITY_KEY),
                            timeout=60))
    assert ok[-1].final.usage.completion_tokens == 4


def test_grpc_abort_reaches_only_the_caller_s_own_requests(stack):
    stub = stack.generation_stub()
    call = stub.Generate(generate_request(request_id="mine", params={"max_tokens": 400}),
                         metadata=grpc_key(KEY), timeout=60)
    assert next(call).request_id == "mine"
    other = stub.Abort(generate_pb2.AbortRequest(request_ids=["mine"]),
                       metadata=grpc_key(OTHER_KEY), timeout=10)
    assert other.num_aborted == 0
    # the same id is free for another caller: ids are per caller
    theirs = list(stub.Generate(generate_request(request_id="mine"),
                                metadata=grpc_key(OTHER_KEY), timeout=60))
    assert theirs[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    own = stub.Abort(generate_pb2.AbortRequest(request_ids=["mine"]),
                     metadata=grpc_key(KEY), timeout=10)
    assert own.num_aborted == 1
    assert list(call)[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT


def test_the_inner_services_refuse_callers_without_the_internal_token(stack):
    worker = worker_pb2_grpc.WorkerStub(stack.channel(stack.worker_address))
    engine = engine_pb2_grpc.EngineStub(stack.channel(stack.scheduler_address))
    for metadata in ([], [("x-gapserve-internal-token", "guess")]):
        with pytest.raises(grpc.RpcError) as info:
            worker.Handshake(worker_pb2.HandshakeRequest(tensor_parallel_size=1),
                             metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(worker.Step(iter([]), metadata=metadata, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            engine.GetStatus(engine_pb2.GetStatusRequest(), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status = engine.GetStatus(engine_pb2.GetStatusRequest(),
                              metadata=[("x-gapserve-internal-token", TOKEN)], timeout=10)
    assert status.num_kv_blocks > 0
    for address in (stack.worker_address, stack.scheduler_address):  # probes stay open
        health = health_pb2_grpc.HealthStub(stack.channel(address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


# ---- every accepted field does something


REFUSED = [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    # tools default to tool_choice auto, which needs --enable-auto-tool-choice (vLLM's)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("fields,word", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_fields_we_cannot_honour_or_bad_values_are_a_400_not_ignored(stack, fields, word):
    reply = post(stack, "/v1/chat/completions", {**CHAT, **fields})
    assert reply.status_code == 400, reply.text
    assert word in reply.json()["error"]["message"]


def test_text_response_format_and_known_roles_are_accepted(stack):
    body = {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none",
            "messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": "hi"}]}
    assert post(stack, "/v1/chat/completions", body).status_code == 200
    assert post(stack, "/v1/completions", {**COMPLETION, "logit_bias": {}}).status_code == 200


def test_logit_bias_steers_sampling_on_http_and_grpc(stack):
    stub = stack.generation_stub()

    def grpc_ids(bias: dict[int, float]) -> tuple[list[int], str]:
        messages = list(stub.Generate(
            generate_request(params={"max_tokens": 8, "logit_bias": bias}),
            metadata=grpc_key(KEY), timeout=60))
        return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)

    ids, text = grpc_ids({42: 100.0})
    assert ids == [42] * 8
    forced = post(stack, "/v1/completions", {**COMPLETION, "max_tokens": 8, "ignore_eos": True,
                                             "temperature": 0.0, "logit_bias": {"42": 100}})
    assert forced.status_code == 200 and forced.json()["choices"][0]["text"] == text
    plain, _ = grpc_ids({})
    banned, _ = grpc_ids({plain[0]: -100.0})  # greedy's first choice, now out of reach
    assert plain[0] not in banned


def test_cache_salt_separates_prefix_caches_on_the_grpc_path(stack):
    stub = stack.generation_stub()
    prompt = {"ids": list(range(10, 90))}  # five full blocks of 16

    def cached(salt: str | None) -> int:
        kw = {"cache_salt": salt} if salt is not None else {}
        messages = list(stub.Generate(generate_request(token_ids=prompt, **kw),
                                      metadata=grpc_key(KEY), timeout=60))
        return messages[-1].final.usage.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0  # the same salt shares the prefix
    assert cached("tenant-b") == 0  # another salt does not see it
    assert cached(None) == 0  # nor does an unsalted request
