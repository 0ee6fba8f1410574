"""The frontend's client gRPC API through the generated stub, plus the standard
health and reflection services on all three services."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.proto import common_pb2, generate_pb2

PROMPT = "The quick brown fox"


def request(**kw) -> generate_pb2.GenerateRequest:
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    params.update(kw.pop("params", {}))
    if "token_ids" not in kw:
        kw.setdefault("text", PROMPT)
    return generate_pb2.GenerateRequest(sampling_params=params, **kw)


def test_generate_streams_deltas_and_ends_with_usage_and_timings(tiny_stack):
    stub = tiny_stack.generation_stub()
    messages = list(stub.Generate(request(), timeout=60))
    final = messages[-1].final
    assert all(not m.HasField("final") for m in messages[:-1])
    ids = [t for m in messages for t in m.token_ids]
    assert len(ids) == 8 == final.usage.completion_tokens
    prompt_ids = stub.Tokenize(generate_pb2.TokenizeRequest(text=PROMPT)).token_ids
    assert final.usage.prompt_tokens == len(prompt_ids)
    assert final.usage.total_tokens == len(prompt_ids) + 8
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.timings.time_to_first_token_ms > 0 and final.timings.e2e_ms > 0
    text = "".join(m.text for m in messages)
    again = list(stub.Generate(request(token_ids={"ids": list(prompt_ids)}), timeout=60))
    assert [t for m in again for t in m.token_ids] == ids  # token-id input, same greedy output
    assert "".join(m.text for m in again) == text


def test_generate_reports_the_matched_stop_string(tiny_stack):
    stub = tiny_stack.generation_stub()
    text = "".join(m.text for m in stub.Generate(request(params={"max_tokens": 16}), timeout=60))
    stop = text[len(text) // 2:len(text) // 2 + 2]
    messages = list(stub.Generate(request(params={"max_tokens": 16}, stop=[stop]), timeout=60))
    assert "".join(m.text for m in messages) == text[:text.index(stop)]
    final = messages[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert final.WhichOneof("matched_stop") == "stop_str" and final.stop_str == stop


def test_abort_ends_a_running_generate(tiny_stack):
    stub = tiny_stack.generation_stub()
    call = stub.Generate(request(request_id="to-abort", params={"max_tokens": 400}), timeout=60)
    first = next(call)
    assert first.request_id == "to-abort"
    reply = stub.Abort(generate_pb2.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert reply.num_aborted == 1
    rest = list(call)
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].final.usage.completion_tokens < 400


def test_get_model_info_and_tokenize(tiny_stack):
    stub = tiny_stack.generation_stub()
    info = stub.GetModelInfo(common_pb2.GetModelInfoRequest())
    assert info.served_model_name == tiny_stack.served_model_name
    assert info.model_info.vocab_size == 49152 and info.model_info.max_model_len == 512
    assert info.model_info.num_kv_blocks > 0 and info.model_info.block_size == 16
    tok = stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world"))
    assert len(tok.token_ids) == len(tok.tokens) == 2 and tok.max_model_len == 512


@pytest.mark.parametrize("service", ["frontend", "scheduler", "worker"])
def test_health_answers_serving_on_every_service(tiny_stack, service):
    address = {"frontend": tiny_stack.grpc_address, "scheduler": tiny_stack.scheduler_address,
               "worker": tiny_stack.worker_address}[service]
    stub = health_pb2_grpc.HealthStub(tiny_stack.channel(address))
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_generation_service(tiny_stack):
    stub = reflection_pb2_grpc.ServerReflectionStub(tiny_stack.channel(tiny_stack.grpc_address))
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"gapserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_bad_generate_input_is_invalid_argument(tiny_stack):
    stub = tiny_stack.generation_stub()
    for bad in (request(params={"temperature": -1.0}), request(text=""),
                request(token_ids={"ids": [49152]}), request(params={"max_tokens": 600}),
                generate_pb2.GenerateRequest()):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
