"""Bounded admission against the real stack (tiny model, loopback): every cap on
what one request may ask is a 400 that queues nothing, an oversized body is a
413, a request beyond --max-queued-requests is a 429 with Retry-After, and a
flood of 1,000 concurrent streams, hostile stop strings or huge prompts leave
/health answering quickly and the KV pool empty afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import time
import grpc
import httpx
import pytest

from shared.proto import generate_pb2

from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.integration.load_client import HealthProber, Probe, post_stream, run_load

MAX_NUM_SEQS, MAX_QUEUED = 4, 16
LIMIT = MAX_NUM_SEQS + MAX_QUEUED  # choices the frontend holds at once
# /health waits behind at most HEALTH_BUDGET_S of the event loop's work at p95, and
# never behind HEALTH_STALL_S of it: a stalled loop (a 40 MB prompt tokenized on it,
# quadratic stop matching, a 7 MB body parsed on it) is seconds of the loop thread's
# CPU while one probe waits. Measured in the loop thread's CPU time, not wall time, so
# a loaded machine that only delays the server does not fail it.
HEALTH_BUDGET_S, HEALTH_STALL_S = 0.1, 1.0


def assert_health_fast(probes: list[Probe]) -> None:
    assert probes, "no /health probe completed"
    cpu = sorted(p.loop_cpu_s for p in probes)
    p95 = cpu[int(0.95 * (len(cpu) - 1))]
    assert p95 < HEALTH_BUDGET_S and cpu[-1] < HEALTH_STALL_S, \
        f"/health waited behind {p95 * 1e3:.0f} ms of the loop's CPU at p95, at most " \
        f"{[round(x * 1e3) for x in cpu[-5:]]} ms; wall p95 " \
        f"{sorted(p.wall_s for p in probes)[int(0.95 * (len(probes) - 1))] * 1e3:.0f} ms"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("admission-stack"),
                        flags=[*TINY_FLAGS, "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-queued-requests", str(MAX_QUEUED)])
    yield stack
    stack.stop()


def status(stack) -> dict:
    return httpx.get(stack.http_url + "/v1/status", timeout=10).json()


def wait_idle(stack, timeout_s: float = 60.0) -> dict:
    """Poll until nothing runs or waits and every KV block is free (or fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(stack)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0:
            return s
        assert time.monotonic() < deadline, f"the scheduler never went idle: {s}"
        time.sleep(0.02)


def post(stack, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(stack.http_url + "/v1/completions", json=body, timeout=30, **kwargs)


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def assert_error(reply: httpx.Response, status_code: int, *words: str) -> dict:
    assert reply.status_code == status_code, reply.text
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


BASE = {"prompt": [1, 2, 3], "max_tokens": 4}
CAPPED = [
    ({"prompt": [[1]] * 129}, "--max-client-batch-size"),
    ({"prompt": [[1]] * 100, "n": 3}, "--max-choices-per-request"),
    ({"n": LIMIT + 1}, "--max-queued-requests"),
    ({"stop": [f"s{i}" for i in range(17)]}, "--max-stop-sequences"),
    ({"stop": ["x" * 257]}, "--max-stop-sequence-length"),
    ({"stop_token_ids": list(range(257))}, "--max-stop-token-ids"),
    ({"prompt": "a" * (512 * 81 * 4 + 1)}, "--max-prompt-bytes"),
]


@pytest.mark.parametrize("fields,flag", CAPPED, ids=[flag for _, flag in CAPPED])
def test_each_cap_is_a_400_naming_its_flag_and_queues_nothing(stack, fields, flag):
    before = wait_idle(stack)
    assert_error(post(stack, {**BASE, **fields}), 400, flag)
    after = wait_idle(stack)
    assert after["num_steps_total"] == before["num_steps_total"]


GRPC_CAPPED = [
    ({"stop": [f"s{i}" for i in range(17)]}, "--max-stop-sequences"),
    ({"stop": ["x" * 257]}, "--max-stop-sequence-length"),
    ({"sampling_params": {"stop_token_ids": list(range(257))}}, "--max-stop-token-ids"),
    ({"text": "a" * (512 * 81 * 4 + 1)}, "--max-prompt-bytes"),
]


@pytest.mark.parametrize("fields,flag", GRPC_CAPPED, ids=[flag for _, flag in GRPC_CAPPED])
def test_each_cap_holds_on_grpc_generate_too(stack, fields, flag):
    fields = {"token_ids": {"ids": [1, 2]}, **fields} if "text" not in fields else fields
    with pytest.raises(grpc.RpcError) as info:
        list(stack.generation_stub().Generate(generate_pb2.GenerateRequest(**fields),
                                              timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert flag in info.value.details()


def test_the_issue_s_fan_out_body_is_refused_whole(stack):
    before = wait_idle(stack)
    assert_error(post(stack, {"prompt": [[1]] * 1000, "n": 128, "max_tokens": 1}), 400)
    assert wait_idle(stack)["num_steps_total"] == before["num_steps_total"]


def test_a_body_over_the_payload_limit_is_a_413(stack):
    big = b'{"prompt": "' + b"a" * (8 << 20) + b'"}'
    assert_error(httpx.post(stack.http_url + "/v1/completions", content=big, timeout=30,
                            headers={"content-type": "application/json"}),
                 413, "--payload-limit")


def test_a_grpc_message_over_the_payload_limit_is_refused_unread(stack):
    with pytest.raises(grpc.RpcError) as info:
        list(stack.generation_stub().Generate(
            generate_pb2.GenerateRequest(text="a" * (8 << 20)), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_chunked_body_over_the_payload_limit_is_a_413(stack):
    def chunks():  # no Content-Length: the limit counts the bytes that arrive
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error(httpx.post(stack.http_url + "/v1/completions", content=chunks(), timeout=30,
                            headers={"content-type": "application/json"}),
                 413, "--payload-limit")


def in_flight(stack) -> float:
    for line in httpx.get(stack.http_url + "/metrics").text.splitlines():
        if line.startswith("gapserve:frontend_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_a_request_beyond_the_queue_bound_is_a_429_with_retry_after_and_nothing_queued(stack):
    wait_idle(stack)
    long = {"prompt": [1, 2], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            holders = [asyncio.create_task(post_stream("127.0.0.1", stack.http_port,
                                                       "/v1/completions", long))
                       for _ in range(LIMIT)]  # MAX_NUM_SEQS run, MAX_QUEUED wait
            deadline = time.monotonic() + 30
            while in_flight(stack) < LIMIT:
                assert time.monotonic() < deadline, in_flight(stack)
                await asyncio.sleep(0.02)
            before = status(stack)
            reply = await client.post(stack.http_url + "/v1/completions", json=BASE)
            with pytest.raises(grpc.RpcError) as info:  # the gRPC API shares the bound
                list(stack.generation_stub().Generate(generate_pb2.GenerateRequest(
                    token_ids={"ids": [1, 2]}, sampling_params={"max_tokens": 2}), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            after = status(stack)
            for task in holders:  # disconnect: each is aborted at the scheduler
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return reply, before, after

    reply, before, after = asyncio.run(run())
    error = assert_error(reply, 429, "capacity")
    assert error["type"] == "rate_limit_error"
    assert int(reply.headers["retry-after"]) >= 1
    # nothing of it reached the scheduler
    assert after["num_running"] + after["num_waiting"] <= LIMIT
    assert before["num_running"] + before["num_waiting"] <= LIMIT
    wait_idle(stack)
    assert in_flight(stack) == 0


def test_a_thousand_concurrent_streams_end_200_or_429_with_health_fast_and_kv_freed(stack):
    wait_idle(stack)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 64, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    cpu0 = cpu_s(stack.process("frontend").pid)
    t0 = time.monotonic()
    # started over one second: the admitted ones still run while the rest arrive
    results, probes, growth = asyncio.run(run_load(
        "127.0.0.1", stack.http_port, [body] * 1000, stack.process("frontend").pid, 90.0,
        ramp_s=1.0))
    elapsed = time.monotonic() - t0
    cpu = cpu_s(stack.process("frontend").pid) - cpu0
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 429}, set(codes)
    assert codes.count(200) >= LIMIT  # the bound admits, it does not starve
    assert codes.count(429) > 0  # and it refuses the rest at once
    texts = {text for code, text in results if code == 200}
    assert len(texts) == 1  # greedy: every admitted stream got the same whole text
    assert_health_fast(probes)
    assert growth < 200 << 20, growth  # the frontend holds at most LIMIT requests' state
    after = wait_idle(stack)
    assert after["kv_cache_usage"] == 0.0
    print(f"1000 streams: {codes.count(200)} x 200, {codes.count(429)} x 429 in "
          f"{elapsed:.1f} s; /health max {max(p.wall_s for p in probes) * 1e3:.1f} ms over "
          f"{len(probes)} probes; frontend RSS +{growth >> 20} MiB, CPU {cpu:.2f} s")


def test_hostile_stop_strings_leave_health_fast_and_the_text_unchanged(stack):
    wait_idle(stack)
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    plain = asyncio.run(post_stream("127.0.0.1", stack.http_port, "/v1/completions", body))[1]
    assert plain
    # as many stops as allowed, each as long as allowed and a near-miss of the text
    # (its first 255 characters): the most hold-back and matching work one request
    # can ask for, and the text must come out whole
    stops = [(plain * 256)[:255] + chr(0xE000 + i) for i in range(16)]
    hostile = {**body, "stop": stops}
    results, probes, _ = asyncio.run(run_load(
        "127.0.0.1", stack.http_port, [hostile] * MAX_NUM_SEQS, stack.process("frontend").pid,
        60.0))
    assert all(code == 200 and text == plain for code, text in results)
    assert_health_fast(probes)
    wait_idle(stack)


def test_tokenizing_huge_prompts_leaves_health_fast(stack):
    wait_idle(stack)
    # just under the byte bound: tokenized (off the event loop), then too long a context
    body = {"prompt": "hello world " * (512 * 81 * 4 // 12 - 1), "max_tokens": 1}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[
                client.post(stack.http_url + "/v1/completions", json=body) for _ in range(6)])

    prober = HealthProber("127.0.0.1", stack.http_port, stack.process("frontend").pid)
    try:
        replies = asyncio.run(run())
    finally:
        probes = prober.stop()
    for reply in replies:
        assert_error(reply, 400, "maximum context length")
    assert_health_fast(probes)


# ---- tokenize and detokenize: admitted, bounded before parsing, off the event loop

MAX_PROMPT_BYTES = 512 * 81 * 4  # the tiny model's default --max-prompt-bytes


def test_tokenize_and_detokenize_floods_leave_health_fast(stack):
    wait_idle(stack)
    fits_ids = json.dumps({"tokens": list(range(1, 513))}).encode()  # max_model_len ids
    huge_ids = b'{"tokens": [' + b",".join([b"1234"] * 1_500_000) + b"]}"  # 7.5 MB
    fits_text = json.dumps({"prompt": "hello world " * (MAX_PROMPT_BYTES // 12 - 1)}).encode()
    huge_text = b'{"prompt": "' + b"hello world " * 600_000 + b'"}'  # 7.2 MB
    # fewer places than LIMIT at once; the fitting text is real work on the pool, and
    # more of it would only measure how busy the shared box's two cores are
    wave = [("/detokenize", fits_ids, 200), ("/detokenize", huge_ids, 400),
            ("/tokenize", huge_text, 400)] * 2 + [("/detokenize", fits_ids, 200),
                                                  ("/tokenize", fits_text, 200)]
    cases = wave * 4

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            replies = []
            for _ in range(len(cases) // len(wave)):  # waves: enough probes for a p95
                replies += await asyncio.gather(*[
                    client.post(stack.http_url + path, content=body,
                                headers={"content-type": "application/json"})
                    for path, body, _ in wave])
            return replies

    prober = HealthProber("127.0.0.1", stack.http_port, stack.process("frontend").pid)
    try:
        replies = asyncio.run(run())
    finally:
        probes = prober.stop()
    for (path, _, code), reply in zip(cases, replies):
        assert reply.status_code == code, (path, reply.text[:300])
        if code == 400:  # refused by counting, before json.loads held the GIL for it
            assert "token ids" in reply.text or "--max-prompt-bytes" in reply.text
    assert replies[-1].json()["count"] > 10_000
    # parsing these bodies on the loop stalled it for seconds
    assert len(probes) > 20
    assert_health_fast(probes)
    assert in_flight(stack) == 0


def test_tokenize_and_grpc_generate_meet_admission_before_any_work(stack):
    """With every place taken, /tokenize, /detokenize, gRPC Tokenize and gRPC Generate
    are refused as at capacity, even for input that would fail validation: admission
    comes first, so an overload costs no tokenizing."""
    wait_idle(stack)
    long = {"prompt": [1, 2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    too_long_text = "a" * (MAX_PROMPT_BYTES + 1)  # INVALID_ARGUMENT when there is room

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            holders = [asyncio.create_task(post_stream("127.0.0.1", stack.http_port,
                                                       "/v1/completions", long))
                       for _ in range(LIMIT)]
            deadline = time.monotonic() + 30
            while in_flight(stack) < LIMIT:
                assert time.monotonic() < deadline, in_flight(stack)
                await asyncio.sleep(0.02)
            replies = [await client.post(stack.http_url + path, json=body) for path, body in (
                ("/tokenize", {"prompt": too_long_text}), ("/detokenize", {"tokens": [1]}))]
            stub = stack.generation_stub()
            codes = []
            for call in (lambda: stub.Tokenize(generate_pb2.TokenizeRequest(text="x"),
                                               timeout=10),
                         lambda: list(stub.Generate(generate_pb2.GenerateRequest(
                             text=too_long_text), timeout=10))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                codes.append(info.value.code())
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return replies, codes

    replies, codes = asyncio.run(run())
    for reply in replies:
        assert_error(reply, 429, "capacity")
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    wait_idle(stack)
    with pytest.raises(grpc.RpcError) as info:  # with room again: the validation error
        list(stack.generation_stub().Generate(generate_pb2.GenerateRequest(
            text=too_long_text), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
