"""The scheduler's gRPC port speaks `vllm.grpc.engine.VllmEngine` (smg-grpc-proto
0.4.28) over the same engine as gapserve.v1.Engine: real worker and scheduler
processes on loopback, driven by a real gRPC client built from the package's protos."""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.wire.session_client import SessionClient, wait_for

PROMPT = [1, 415, 2936, 9060, 285, 1142, 10843, 690, 253, 23790, 5827, 17, 2020, 88, 11]
EOS = 2  # the tiny checkpoint's generation_config eos_token_id


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("vllm-engine"),
                        services=("worker", "scheduler"), flags=TINY_FLAGS)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def vllm(stack) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(stack.channel(stack.scheduler_address))


def generate(vllm, req_id: str, prompt=PROMPT, stream: bool = False, **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 8)
    return list(vllm.Generate(pb.GenerateRequest(
        request_id=req_id, tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=pb.SamplingParams(**sampling)), timeout=120))


def gapserve_greedy(stack, prompt, max_tokens: int) -> list[int]:
    client = SessionClient(stack.engine_stub())
    try:
        client.add("ref", prompt, max_tokens=max_tokens, temperature=0.0)
        client.wait_ended("ref")
        return client.tokens["ref"]
    finally:
        client.close()


def running(stack) -> int:
    status = stack.engine_status()
    return status.num_running + status.num_waiting


def test_health_check_is_healthy_and_model_info_names_the_served_model_and_its_directory(
        stack, vllm, tiny_model_dir):
    assert vllm.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    info = vllm.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == tiny_model_dir.name
    assert info.model_path == info.tokenizer_path == str(tiny_model_dir)
    assert (info.max_context_length, info.vocab_size) == (512, 49152)
    assert list(info.eos_token_ids) == [EOS] and info.is_generation
    assert (info.model_type, list(info.architectures)) == ("llama", ["LlamaForCausalLM"])
    server = vllm.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.data_parallel_size == 1 and server.max_num_seqs == 64
    assert server.block_size > 0 and server.server_type == "gapserve"
    loads = vllm.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 64


def test_greedy_generate_equals_the_gapserve_protocol_streamed_and_not(stack, vllm):
    want = gapserve_greedy(stack, PROMPT, 8)
    [done] = generate(vllm, "plain")
    assert list(done.complete.output_ids) == want
    assert (done.complete.finish_reason, done.complete.prompt_tokens,
            done.complete.completion_tokens) == ("length", len(PROMPT), 8)
    replies = generate(vllm, "streamed", stream=True)
    chunks, last = replies[:-1], replies[-1]
    assert all(r.WhichOneof("response") == "chunk" for r in chunks)
    assert [t for r in chunks for t in r.chunk.token_ids] == want
    assert list(last.complete.output_ids) == want


def test_without_stop_ids_the_model_eos_stops_and_stop_token_ids_are_reported_matched(vllm):
    # the EOS made certain by a bias: it ends the request as vLLM would, unreported
    [done] = generate(vllm, "eos", logit_bias={EOS: 100.0})
    assert (list(done.complete.output_ids), done.complete.finish_reason) == ([EOS], "stop")
    assert done.complete.WhichOneof("matched_stop") is None
    [free] = generate(vllm, "free", max_tokens=3)
    stop_at = free.complete.output_ids[1]
    [done] = generate(vllm, "stop-id", max_tokens=3, stop_token_ids=[stop_at])
    assert done.complete.finish_reason == "stop"
    assert done.complete.matched_token_id == stop_at
    assert list(done.complete.output_ids)[-1] == stop_at


def test_logprobs_come_in_the_output_logprobs_shape(vllm):
    [done] = generate(vllm, "lp", max_tokens=3, logprobs=2)
    lp = done.complete.output_logprobs
    assert list(lp.token_ids) == list(done.complete.output_ids)
    assert len(lp.token_logprobs) == 3 and all(v <= 0.0 for v in lp.token_logprobs)
    assert all(len(top.token_ids) == 2 for top in lp.top_logprobs)


@pytest.mark.parametrize("field, sampling, request_fields", [
    ("text", {}, {"text": "hello"}),
    ("n", {"n": 2}, {}),
    ("prompt_logprobs", {"prompt_logprobs": 1}, {}),
    ("structural_tag", {"structural_tag": "{}"}, {}),
    ("kv_transfer_params_json", {}, {"kv_transfer_params_json": "{}"}),
    ("data_parallel_rank", {}, {"data_parallel_rank": 1}),
    ("temperature", {"temperature": -1.0}, {}),
])
def test_unsupported_options_and_bad_values_are_refused_naming_the_field(
        vllm, field, sampling, request_fields):
    msg = pb.GenerateRequest(request_id=f"bad-{field}",
                             sampling_params=pb.SamplingParams(max_tokens=4, **sampling),
                             **request_fields)
    if "text" not in request_fields:
        msg.tokenized.input_ids.extend(PROMPT)
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(msg, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_an_unknown_field_is_refused_with_invalid_argument(stack):
    # field 99 with varint 1 appended: what a newer client's extra field looks like
    raw = pb.GenerateRequest(request_id="unknown", tokenized=pb.TokenizedInput(
        input_ids=PROMPT)).SerializeToString() + bytes([0x98, 0x06, 0x01])
    call = stack.channel(stack.scheduler_address).unary_stream(
        "/vllm.grpc.engine.VllmEngine/Generate", request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field number(s) [99]" in err.value.details()


def test_a_cancelled_stream_frees_its_request(stack, vllm):
    call = vllm.Generate(pb.GenerateRequest(
        request_id="cancel-me", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
    first = next(call)
    assert first.chunk.token_ids
    call.cancel()
    wait_for(lambda: running(stack) == 0, timeout_s=60, what="the request to be freed")


def test_abort_by_id_ends_the_stream_with_abort_and_frees_the_request(stack, vllm):
    call = vllm.Generate(pb.GenerateRequest(
        request_id="abort-me", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
    assert next(call).chunk.token_ids
    vllm.Abort(pb.AbortRequest(request_ids=["abort-me"]), timeout=10)
    replies = list(call)
    assert replies[-1].complete.finish_reason == "abort"
    wait_for(lambda: running(stack) == 0, timeout_s=60, what="the request to be freed")


def test_kv_events_stream_the_prefix_cache_and_flush_cache_clears_it(stack, vllm):
    events = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(
        load_records_before_first_batch=True))
    first = next(events)
    assert first.HasField("load") and first.load.max_running_requests == 64
    seen: list = []
    ready = threading.Event()

    def read():
        for batch in events:
            seen.extend(batch.events)
            if any(e.HasField("cleared") for e in batch.events):
                ready.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    prompt = PROMPT * 6  # 90 tokens: several full blocks
    [before] = generate(vllm, "kv-1", prompt=prompt, max_tokens=2)
    [again] = generate(vllm, "kv-2", prompt=prompt, max_tokens=2)
    assert before.complete.cached_tokens == 0 and again.complete.cached_tokens > 0
    vllm.FlushCache(cpb.FlushCacheRequest(), timeout=30)
    assert ready.wait(60)
    events.cancel()
    stored = [b for e in seen if e.HasField("stored") for b in e.stored.blocks]
    size = stored[0].block_size
    assert list(stored[0].token_ids) == prompt[:size]
    [after] = generate(vllm, "kv-3", prompt=prompt, max_tokens=2)
    assert after.complete.cached_tokens == 0


def test_get_tokenizer_streams_the_tokenizer_files_as_one_zip(vllm, tiny_model_dir):
    chunks = list(vllm.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert zipfile.ZipFile(io.BytesIO(data)).read("tokenizer.json") == \
        (tiny_model_dir / "tokenizer.json").read_bytes()


def test_embed_is_unimplemented_with_a_message_for_a_generation_model(vllm):
    with pytest.raises(grpc.RpcError) as err:
        vllm.Embed(pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(
            input_ids=PROMPT)), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "pooling" in err.value.details()


@pytest.fixture(scope="module")
def bounded(tiny_model_dir, tmp_path_factory):
    """A scheduler that holds one open request at most (max-num-seqs 1, no queue)."""
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("vllm-engine-bounded"),
                        services=("worker", "scheduler"),
                        flags=[*TINY_FLAGS, "--max-num-seqs", "1", "--max-queued-requests", "0"])
    yield stack
    stack.stop()


def test_the_schedulers_admission_bound_refuses_an_engine_protocol_request_too(bounded):
    # a gapserve frontend's session fills the bound; the gateway's request is refused
    # as another frontend's would be (one bound over every caller)
    filler = SessionClient(bounded.engine_stub())
    try:
        filler.add("fill", PROMPT, max_tokens=400, ignore_eos=True, temperature=0.0)
        wait_for(lambda: running(bounded) == 1, timeout_s=60, what="the bound to fill")
        vllm = pb_grpc.VllmEngineStub(bounded.channel(bounded.scheduler_address))
        with pytest.raises(grpc.RpcError) as err:
            generate(vllm, "one-too-many", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 1" in err.value.details()
    finally:
        filler.abort("fill")
        filler.close()
