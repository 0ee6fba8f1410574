"""Structured outputs through the real three-process stack (tiny model), by a gRPC
client: each kind's output full-matches and ends with finish reason STOP; a bad spec
is INVALID_ARGUMENT naming the part at fault with nothing queued; a grammar that
takes a second to compile does not hold other streams up (the request waits deferred
while rank 0 compiles off the step path); the compile, cache and mask metrics count."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import httpx
import jsonschema
import pytest

from shared.wire.common import sampling_to_proto
from shared.proto import common_pb2, engine_pb2, generate_pb2
from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.integration.conftest import TINY_FLAGS
from tests.ports import free_ports

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{2,8}$"},
                         "n": {"type": "integer", "minimum": -5, "maximum": 5}}}

# the random model never closes a free string: json_object is tested with the real one
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["c", "xs"],
          "properties": {"c": {"enum": ["up", "down"]},
                         "xs": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def generate(stub, spec: Spec | None, max_tokens: int = 80, text: str = "Hello", **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec,
                            **kw)
    request = generate_pb2.GenerateRequest(text=text, sampling_params=sampling_to_proto(params))
    messages = list(stub.Generate(request, timeout=120))
    return "".join(m.text for m in messages), messages[-1].final


@pytest.mark.parametrize("spec, check", [
    (Spec("json", json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    (Spec("json", json.dumps(ARRAYS), disable_any_whitespace=True),
     lambda t: jsonschema.validate(json.loads(t), ARRAYS) or " " not in t),
    (Spec("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (Spec("choice", '["red", "green", "blue"]'), lambda t: t in ("red", "green", "blue")),
    (Spec("grammar", 'start: "x=" NUM (";" NUM)*\nNUM: /[0-9]{1,2}/'),
     lambda t: re.fullmatch(r"x=[0-9]{1,2}(;[0-9]{1,2})*", t)),
], ids=["json", "json-arrays", "regex", "choice", "grammar"])
def test_each_kind_full_matches_and_stops(tiny_stack, spec, check):
    text, final = generate(tiny_stack.generation_stub(), spec, max_tokens=200)
    assert check(text) is not False, text
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    unconstrained, _ = generate(tiny_stack.generation_stub(), None, max_tokens=20)
    assert check_fails(check, unconstrained)  # the random model alone matches nothing


def check_fails(check, text: str) -> bool:
    try:
        return not check(text)
    except Exception:  # noqa: BLE001 - json.loads, jsonschema
        return True


@pytest.mark.parametrize("spec, named", [
    (Spec("json", '{"type": "object", "properties": {"a": {"type": "strin"}}}'),
     "structured_output.json"),
    (Spec("regex", "([a-z]"), "structured_output.regex"),
    (Spec("choice", "not json"), "structured_output.choice"),
    (Spec("grammar", "start: nothing_defined"), "structured_output.grammar"),
    (Spec("yaml", "a: 1"), "structured_output kind"),
])
def test_a_bad_spec_is_invalid_argument_and_queues_nothing(tiny_stack, spec, named):
    stub = tiny_stack.generation_stub()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, spec)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()
    status = tiny_stack.engine_status()
    assert (status.num_running, status.num_waiting, status.num_waiting_not_ready) == (0, 0, 0)
    assert status.num_free_blocks == status.num_kv_blocks - 1


def slow_schema(n: int = 5000) -> str:
    """A schema llguidance takes about a second to compile here (5,000 patterned
    properties; measured 0.5 to 1.2 s on this 2-core machine)."""
    return json.dumps({"type": "object", "required": [f"field_{i}" for i in range(n)],
                       "properties": {f"field_{i}": {"type": "string",
                                                     "pattern": f"^[a-z]{{{i % 5 + 1},9}}$"}
                                      for i in range(n)}})


class Stream(threading.Thread):
    """One unconstrained greedy stream; the arrival time of every message. `warm` is
    set once WARM messages arrived (the stream is decoding) or it ended."""

    WARM = 20

    def __init__(self, stub, i: int) -> None:
        super().__init__(daemon=True)
        self.stub, self.i, self.times, self.error = stub, i, [], None
        self.warm = threading.Event()

    def arrived(self) -> None:
        self.times.append(time.monotonic())
        if len(self.times) == self.WARM:
            self.warm.set()

    def run(self) -> None:
        try:
            params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            request = generate_pb2.GenerateRequest(
                text=f"Stream {self.i} says", sampling_params=sampling_to_proto(params))
            for _ in self.stub.Generate(request, timeout=120):
                self.arrived()
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            self.error = e
        finally:
            self.warm.set()  # a waiter never hangs on a stream that ended early


def wait_decoding(streams) -> None:
    for s in streams:
        assert s.warm.wait(60) and s.error is None and len(s.times) >= s.WARM, s.error


def add_directly(stack, spec: Spec) -> tuple[float, list[int]]:
    """Send a request straight to the scheduler's Session (the frontend would compile the
    grammar first; here only rank 0 does, so the wait measured is its compile).
    Returns when its first token arrived and its tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_output=spec)
    add = engine_pb2.AddRequest(request_id="slow-grammar", prompt_token_ids=[1, 2, 3, 4],
                                sampling_params=sampling_to_proto(params),
                                arrival_unix_s=time.time())
    done = threading.Event()

    def requests():
        yield engine_pb2.EngineRequest(add=add)
        done.wait(120)

    first, tokens = None, []
    try:
        for response in stack.engine_stub().Session(requests(), timeout=120):
            for out in response.outputs:
                if out.new_token_ids and first is None:
                    first = time.monotonic()
                tokens.extend(out.new_token_ids)
                if out.finish_reason:
                    return first, tokens
            assert not response.rejections, response.rejections
    finally:
        done.set()
    raise AssertionError("the session ended without the request finishing")


def test_other_streams_keep_their_pace_while_a_large_grammar_compiles(start_stack_factory,
                                                                      tiny_model_dir):
    metrics_port, worker_metrics = free_ports(2)
    stack = start_stack_factory(tiny_model_dir, flags=[
        *TINY_FLAGS, "--async-scheduling", "--scheduler-metrics-port", str(metrics_port),
        "--worker-metrics-port", str(worker_metrics)])
    stub = stack.generation_stub()
    streams = [Stream(stub, i) for i in range(4)]
    for s in streams:
        s.start()
    wait_decoding(streams)  # all four are decoding
    sent = time.monotonic()
    first, tokens = add_directly(stack, Spec("json", slow_schema()))
    for s in streams:
        s.join(120)
        assert s.error is None
    assert tokens and tokens[0] == tokenizer_id(stack, "{")
    worker = httpx.get(f"http://127.0.0.1:{worker_metrics}/metrics").text
    assert metric(worker, "gapserve:structured_output_compile_seconds_count") >= 1
    assert metric(worker, 'gapserve:structured_output_cache_total{result="miss"}') >= 1
    scheduler = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert metric(scheduler, "gapserve:structured_output_mask_seconds_count") >= 1
    check_pace(streams, sent, first)


def check_pace(streams, sent: float, first: float) -> None:
    """The other streams' largest token gap while the grammar compiled (from `sent`
    to the constrained request's first token) stays under half that window: a
    compile on the step path (or holding the event loop) would stall them for about
    all of it. Skipped when the window is too short to tell the two apart."""
    window = first - sent
    if window <= 0.4:
        pytest.skip(f"the compile took {window:.2f} s: too fast on this machine to tell a "
                    "stall from the streams' own pace (needs over 0.4 s)")
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])
            if sent <= a and b <= first]
    assert len(gaps) > 20, "the other streams made no progress while it compiled"
    print(f"compile window {window:.3f} s, max gap {max(gaps):.3f} s, {len(gaps)} gaps")
    assert max(gaps) < 0.5 * window, (max(gaps), window)


def tokenizer_id(stack, text: str) -> int:
    reply = stack.generation_stub().Tokenize(
        generate_pb2.TokenizeRequest(text=text, add_special_tokens=False))
    return reply.token_ids[0]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))
