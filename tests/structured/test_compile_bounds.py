"""Issue 30: a grammar compile cannot be interrupted, so one past the compile
timeout must not hold the compile pool. The cache sets it aside (its thread stops
counting), the next grammar starts at once, and at the cap of set-aside compiles a
new grammar is refused at once (CompileCapacityError; HTTP 503, gRPC
RESOURCE_EXHAUSTED) instead of queueing behind them; cached grammars are still
served. Real llguidance compiles throughout: the slow schema is one that takes
about a second and a half here (12,000 patterned properties, near llguidance's
size limit), the quick ones milliseconds."""

from __future__ import annotations

import json
import threading
import time
import uuid

import grpc
import httpx
import pytest

from shared.wire.common import sampling_to_proto
from shared import config
from shared.structured import compile_cache as so
from shared.proto import generate_pb2
from shared.structured.spec import CompileCapacityError, StructuredOutputError
from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.integration.conftest import TINY_FLAGS
from tests.integration.tiny_model import tiny_llama_dir
from tests.observability.helpers import sample
from tests.structured.test_grpc_structured import generate, metric


def slow_spec(n: int = 12000) -> Spec:
    tag = uuid.uuid4().hex[:6]  # a miss in every cache
    return Spec("json", json.dumps({
        "type": "object", "required": [f"f{tag}_{i}" for i in range(n)],
        "properties": {f"f{tag}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},9}}$"}
                       for i in range(n)}}))


def quick_spec() -> Spec:
    return Spec("regex", f"q{uuid.uuid4().hex[:6]}-[0-9]{{2}}")


@pytest.fixture(scope="module")
def vocab():
    return so.grammar_vocab(tiny_llama_dir())


def stuck_gauge() -> float:
    return sample("gapserve:structured_output_stuck_compiles")


def test_a_timed_out_compile_stops_holding_the_pool_and_the_cap_refuses_at_once(vocab):
    cache = so.CompileCache(threads=1, max_stuck=2, stuck_after_s=60.0)
    first, second = slow_spec(), slow_spec()
    before = stuck_gauge()
    with pytest.raises(StructuredOutputError, match="did not compile within"):
        cache.compile(first, vocab, timeout_s=0.01)
    assert cache.stuck == 1 and stuck_gauge() == before + 1
    running = [cache.submit(first, vocab)]  # joins the compile still running
    # the pool's one thread is free again: a quick grammar compiles while it runs
    quick = quick_spec()
    cache.compile(quick, vocab, timeout_s=30.0)
    assert not running[0].done() and cache.stuck == 1, "the quick one waited for it"
    with pytest.raises(StructuredOutputError, match="did not compile within"):
        cache.compile(second, vocab, timeout_s=0.01)
    running.append(cache.submit(second, vocab))
    assert cache.stuck == 2 and stuck_gauge() == before + 2
    # at the cap: a grammar not compiled yet is refused at once, a cached one served
    with pytest.raises(CompileCapacityError, match="past the compile timeout"):
        cache.compile(quick_spec(), vocab, timeout_s=30.0)
    assert cache.fetch(quick, vocab, timeout_s=30.0)[1] is True  # a hit
    assert not running[1].done(), "the second ended before the cap was shown"
    # when they end they are cached like any compile, and the cap frees up
    assert [f.result(timeout=120).spec for f in running] == [first, second]
    assert cache.stuck == 0 and stuck_gauge() == before
    assert cache.fetch(second, vocab)[1] is True
    cache.compile(quick_spec(), vocab, timeout_s=30.0)


def test_a_compile_nobody_waits_on_is_set_aside_once_it_runs_past_the_timeout(vocab):
    """The worker submits without a timeout of its own (it ends the request itself):
    the cache sets aside a compile that has run longer than stuck_after_s when the
    next grammar arrives (0 here: any compile still running is overdue)."""
    cache = so.CompileCache(threads=1, max_stuck=2, stuck_after_s=0.0)
    running = [cache.submit(slow_spec(), vocab)]
    quick = cache.submit(quick_spec(), vocab)  # sets the slow one aside, then starts
    assert quick.result(timeout=30) and not running[0].done()
    assert cache.stuck == 1
    running.append(cache.submit(slow_spec(), vocab))
    refused = cache.submit(quick_spec(), vocab)  # sets the second aside: at the cap
    assert cache.stuck == 2
    assert isinstance(refused.exception(timeout=0), CompileCapacityError)  # at once
    for future in running:
        future.result(timeout=120)
    assert cache.stuck == 0


def test_the_process_cache_uses_the_configured_timeout_to_find_overdue_compiles():
    assert so.CACHE.stuck_after_s == config.DEFAULT_COMPILE_TIMEOUT_S
    assert (so.CACHE.threads, so.CACHE.max_stuck) == (so.COMPILE_THREADS,
                                                      so.MAX_STUCK_COMPILES)


# ---- through the real stack


def stuck_at(stack) -> float:
    text = httpx.get(stack.http_url + "/metrics", timeout=30).text
    return metric(text, "gapserve:structured_output_stuck_compiles")


def complete(stack, spec: dict) -> httpx.Response:
    return httpx.post(stack.http_url + "/v1/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 4, "temperature": 0.0, "structured_outputs": spec})


def fill_to_the_cap(stack) -> None:
    """New hostile schemas, each set aside past the compile timeout, until
    MAX_STUCK_COMPILES of them still compile at once (skipped where they end faster
    than they can be sent)."""
    for _ in range(2 * so.MAX_STUCK_COMPILES):
        if stuck_at(stack) >= so.MAX_STUCK_COMPILES:
            return
        reply = complete(stack, {"json": json.loads(slow_spec().value)})
        assert reply.status_code == 400, reply.text
        assert "did not compile within 0.05 s" in reply.json()["error"]["message"]
    pytest.skip("the hostile compiles ended before four ran at once: too fast here "
                "to reach the cap")


def test_at_the_cap_a_new_grammar_is_a_503_on_http_and_resource_exhausted_on_grpc(
        start_stack_factory, tiny_model_dir):
    stack = start_stack_factory(tiny_model_dir, flags=[
        *TINY_FLAGS, "--structured-outputs-compile-timeout-s", "0.05"])
    cached = {"choice": ["p", "q"]}
    assert complete(stack, cached).status_code == 200  # compiled before the hostile ones
    for _attempt in range(3):
        fill_to_the_cap(stack)
        probe = complete(stack, {"regex": quick_spec().value})
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_output=quick_spec())
        try:
            list(stack.generation_stub().Generate(generate_pb2.GenerateRequest(
                text="x", sampling_params=sampling_to_proto(params)), timeout=60))
            grpc_error = None
        except grpc.RpcError as e:
            grpc_error = e
        if stuck_at(stack) >= so.MAX_STUCK_COMPILES:
            break  # the cap held through both probes: their answers count
        # a set-aside compile ended (it compiled) before the probes: fill up again
    assert probe.status_code == 503, probe.text
    error = probe.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "structured_outputs.regex" in error["message"] and "retry later" in error["message"]
    assert grpc_error is not None, "gRPC Generate was served at the cap"
    assert grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "past the compile timeout" in grpc_error.details()
    assert complete(stack, cached).status_code == 200  # a cached grammar is still served
    status = stack.engine_status()  # the refusals queued nothing
    assert (status.num_running, status.num_waiting) == (0, 0)


def test_grpc_compiles_on_the_grammar_pool_not_on_the_tokenizer_threads(tiny_stack):
    """Two slow grammars compiling for gRPC Generate hold neither of the frontend's
    two tokenizer threads (they compile on the grammar pool, as HTTP's do): an
    unconstrained request sent meanwhile is answered while both still compile at
    the frontend, before the scheduler has seen either."""
    stub = tiny_stack.generation_stub()
    url = tiny_stack.http_url + "/metrics"
    miss = 'gapserve:structured_output_cache_total{result="miss"}'
    misses = metric(httpx.get(url, timeout=30).text, miss)
    results: list = []
    slow = [threading.Thread(target=lambda: results.append(generate(stub, slow_spec(), 4)))
            for _ in range(2)]
    for t in slow:
        t.start()
    deadline = time.monotonic() + 60
    while metric(httpx.get(url, timeout=30).text, miss) < misses + 2:  # both compiling
        assert time.monotonic() < deadline, "the slow grammars never reached the compile"
    text, final = generate(stub, None, max_tokens=2)
    status = tiny_stack.engine_status()
    assert final.usage.completion_tokens == 2
    assert (status.num_running, status.num_waiting, status.num_waiting_not_ready) == (0, 0, 0), \
        "the slow requests reached the scheduler first: the probe waited for their compile"
    for t in slow:
        t.join(120)
    assert len(results) == 2
