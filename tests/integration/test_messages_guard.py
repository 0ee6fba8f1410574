"""/v1/messages behind the HTTP guard, with the real `anthropic` SDK against the real
services (tiny model, --api-key set, one running and two queued requests at most,
a small --payload-limit): the key is read from the SDK's `x-api-key` as well as
from `Authorization: Bearer`, and every refusal (no or a wrong key, admission full,
a body too large, bad input, a prompt longer than the context) comes in Anthropic's
error shape with its status, so the SDK raises its matching error class."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import pytest

from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.integration.load_client import post_stream

KEY = "key-one"
PAYLOAD_LIMIT = 64 << 10
MAX_NUM_SEQS, MAX_QUEUED = 1, 2
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    flags = [*TINY_FLAGS, "--api-key", KEY, "--payload-limit", str(PAYLOAD_LIMIT),
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED)]
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("messages-guard"),
                        flags=flags)
    yield stack
    stack.stop()


def client(stack, **auth) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.http_url, max_retries=0, **auth)


def create(stack, **auth):
    return client(stack, **auth).messages.create(
        model=stack.served_model_name, max_tokens=4, messages=HI)


def anthropic_error(exc: anthropic.APIStatusError, status: int, kind: str) -> str:
    assert exc.status_code == status
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    return exc.body["error"]["message"]


def test_the_sdk_s_x_api_key_and_a_bearer_token_both_authenticate(stack):
    assert create(stack, api_key=KEY).type == "message"  # the SDK sends x-api-key
    assert create(stack, auth_token=KEY).type == "message"  # Authorization: Bearer
    count = client(stack, api_key=KEY).messages.count_tokens(
        model=stack.served_model_name, messages=HI)
    assert count.input_tokens > 0
    # the OpenAI routes read x-api-key too (one rule for the HTTP API)
    reply = httpx.post(stack.http_url + "/v1/completions", headers={"x-api-key": KEY},
                       json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("auth", [{"api_key": "wrong"}, {"auth_token": "wrong"}])
def test_a_wrong_key_is_the_sdk_s_authentication_error(stack, auth):
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(stack, **auth)
    assert "API key" in anthropic_error(info.value, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError) as info:
        client(stack, **auth).messages.count_tokens(model=stack.served_model_name,
                                                    messages=HI)
    anthropic_error(info.value, 401, "authentication_error")


def test_no_key_is_a_401_in_anthropic_s_shape_naming_both_headers(stack):
    # the SDK will not send a request without a key: a bare HTTP client does
    reply = httpx.post(stack.http_url + "/v1/messages",
                       json={"max_tokens": 4, "messages": HI})
    assert reply.status_code == 401
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    assert "x-api-key" in error["error"]["message"]


def test_bad_input_and_an_overlong_prompt_are_the_sdk_s_bad_request_error(stack):
    sdk = client(stack, api_key=KEY)
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model=stack.served_model_name, max_tokens=4, messages=HI,
                            extra_body={"no_such_field": 1})
    assert "no_such_field" in anthropic_error(info.value, 400, "invalid_request_error")
    long = [{"role": "user", "content": "hello " * 1000}]  # beyond --max-model-len 512
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model=stack.served_model_name, max_tokens=4, messages=long)
    anthropic_error(info.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as info:
        sdk.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    anthropic_error(info.value, 404, "not_found_error")


def test_a_body_over_the_payload_limit_is_the_sdk_s_content_too_large_error(stack):
    big = [{"role": "user", "content": "x" * PAYLOAD_LIMIT}]
    with pytest.raises(anthropic.ContentTooLargeError) as info:
        client(stack, api_key=KEY).messages.create(
            model=stack.served_model_name, max_tokens=4, messages=big)
    assert "--payload-limit" in anthropic_error(info.value, 413, "request_too_large")


def in_flight(stack) -> float:
    for line in httpx.get(stack.http_url + "/metrics").text.splitlines():
        if line.startswith("gapserve:frontend_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_full_admission_is_the_sdk_s_rate_limit_error_with_retry_after(stack):
    limit = MAX_NUM_SEQS + MAX_QUEUED
    # one runs, the others queue behind it: the frontend holds `limit` requests
    long = {"prompt": [1, 2], "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def run():
        holders = [asyncio.create_task(post_stream(
            "127.0.0.1", stack.http_port, "/v1/completions", long, {"x-api-key": KEY}))
            for _ in range(limit)]
        deadline = time.monotonic() + 30
        while in_flight(stack) < limit:
            assert time.monotonic() < deadline, in_flight(stack)
            await asyncio.sleep(0.02)
        try:
            await asyncio.to_thread(create, stack, api_key=KEY)
        except anthropic.RateLimitError as exc:
            return exc
        finally:
            for task in holders:  # disconnect: each is aborted at the scheduler
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    exc = asyncio.run(run())
    assert isinstance(exc, anthropic.RateLimitError), "admission was not full"
    anthropic_error(exc, 429, "rate_limit_error")
    assert int(exc.response.headers["retry-after"]) >= 1


def test_a_chunked_body_over_the_payload_limit_is_a_413_in_anthropic_s_shape(stack):
    def chunks():  # no Content-Length: the guard counts the bytes as they arrive
        yield b'{"max_tokens": 4, "messages": [{"role": "user", "content": "'
        for _ in range(PAYLOAD_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}]}'

    reply = httpx.post(stack.http_url + "/v1/messages", content=chunks(),
                       headers={"x-api-key": KEY, "content-type": "application/json"})
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "request_too_large"
