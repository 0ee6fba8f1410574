"""The real stack as processes on loopback, through real clients: the generated
gRPC stubs, the `openai` package, and the `gapserve serve` command itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.proto import common_pb2, generate_pb2
from tests.integration.conftest import TINY_FLAGS
from tests.ports import free_ports
from tests.wire.session_client import wait_for
from tests.integration.hf_reference import hf_greedy

GREEDY = {"temperature": 0.0}
PROMPT_IDS = [1, 504, 3209, 28, 253, 4821, 99]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()



def pool_is_free(stack) -> bool:
    status = stack.engine_status()
    return status.num_running == 0 and status.num_free_blocks == status.num_kv_blocks - 1


def generate(stack, **fields) -> list[generate_pb2.GenerateResponse]:
    request = generate_pb2.GenerateRequest(**fields)
    return list(stack.generation_stub().Generate(request, timeout=60))


# ---------------------------------------------------------------------------
# health and reflection


def test_every_service_answers_grpc_health_serving(tiny_stack):
    for address in (tiny_stack.worker_address, tiny_stack.scheduler_address,
                    tiny_stack.grpc_address):
        health = health_pb2_grpc.HealthStub(tiny_stack.channel(address))
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


def test_every_service_lists_its_api_through_reflection(tiny_stack):
    for address, name in ((tiny_stack.worker_address, "gapserve.v1.Worker"),
                          (tiny_stack.scheduler_address, "gapserve.v1.Engine"),
                          (tiny_stack.grpc_address, "gapserve.v1.Generation")):
        stub = reflection_pb2_grpc.ServerReflectionStub(tiny_stack.channel(address))
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        assert name in {s.name for s in next(replies).list_services_response.service}


# ---------------------------------------------------------------------------
# the gRPC Generation API


def test_grpc_generate_streams_greedy_tokens_equal_to_transformers(tiny_stack, hf_tiny):
    replies = generate(tiny_stack, token_ids=generate_pb2.TokenIds(ids=PROMPT_IDS),
                       sampling_params=common_pb2.SamplingParams(
                           temperature=0.0, max_tokens=10, ignore_eos=True))
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == hf_greedy(hf_tiny, PROMPT_IDS, 10)
    final = replies[-1].final
    assert replies[-1].HasField("final") and not any(r.HasField("final") for r in replies[:-1])
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPT_IDS), 10)


def test_grpc_generate_text_deltas_join_to_the_decoded_tokens(tiny_stack):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_stack.model_dir)
    replies = generate(tiny_stack, text="The capital of France is",
                       sampling_params=common_pb2.SamplingParams(
                           temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens = [t for r in replies for t in r.token_ids]
    assert "".join(r.text for r in replies) == tok.decode(tokens, skip_special_tokens=True)


def test_grpc_abort_ends_the_stream_and_frees_the_kv_pool(tiny_stack):
    req_id = uuid.uuid4().hex
    stream = tiny_stack.generation_stub().Generate(generate_pb2.GenerateRequest(
        request_id=req_id, token_ids=generate_pb2.TokenIds(ids=PROMPT_IDS),
        sampling_params=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)),
        timeout=60)
    next(stream)  # it is running
    reply = tiny_stack.generation_stub().Abort(
        generate_pb2.AbortRequest(request_ids=[req_id]), timeout=5)
    assert reply.num_aborted == 1
    rest = list(stream)
    assert rest and rest[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_for(lambda: pool_is_free(tiny_stack), what="the KV pool to be free")


def test_grpc_get_model_info_reports_the_served_model(tiny_stack):
    reply = tiny_stack.generation_stub().GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                      timeout=5)
    assert reply.served_model_name == tiny_stack.served_model_name
    assert reply.model_info.vocab_size == 49152 and reply.model_info.max_model_len == 512
    assert reply.model_info.num_kv_blocks > 1 and reply.model_info.block_size == 16
    # how the worker computes its steps, as its compute plan logged it at start
    assert reply.model_info.compute_plan.startswith("device=cpu family=llama layers=c dtype=float32 attention=")


@pytest.mark.parametrize("fields", [
    {"text": ""},
    {"token_ids": generate_pb2.TokenIds(ids=[1] * 600)},
    {"text": "hi", "sampling_params": common_pb2.SamplingParams(temperature=-1.0)},
    {"text": "hi", "sampling_params": common_pb2.SamplingParams(max_tokens=600)},
])
def test_grpc_bad_input_is_invalid_argument_and_the_stack_keeps_serving(tiny_stack, fields):
    with pytest.raises(grpc.RpcError) as e:
        generate(tiny_stack, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    replies = generate(tiny_stack, text="hi", sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    assert replies[-1].final.usage.completion_tokens == 3


# ---------------------------------------------------------------------------
# the OpenAI API through the openai package


def test_completion_honours_max_tokens_and_counts_usage_exactly(tiny_stack):
    client = tiny_stack.openai()
    prompt = "Once upon a time"
    n_prompt = client.post("/../tokenize", body={"prompt": prompt}, cast_to=dict)["count"]
    reply = client.completions.create(model=tiny_stack.served_model_name, prompt=prompt,
                                      max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n_prompt, 7)
    assert reply.usage.total_tokens == n_prompt + 7


def test_streamed_completion_equals_the_unstreamed_one_and_reports_usage(tiny_stack):
    client = tiny_stack.openai()
    args = dict(model=tiny_stack.served_model_name, prompt="Hello, my name is", max_tokens=12,
                extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_completion_streamed_and_not_agree(tiny_stack):
    client = tiny_stack.openai()
    args = dict(model=tiny_stack.served_model_name, max_tokens=10,
                messages=[{"role": "user", "content": "Say something."}],
                extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 10


def test_stop_string_is_withheld_and_ends_the_request(tiny_stack):
    client = tiny_stack.openai()
    args = dict(model=tiny_stack.served_model_name, prompt="A story:", max_tokens=24,
                extra_body={"ignore_eos": True}, **GREEDY)
    full = client.completions.create(**args).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    reply = client.completions.create(stop=[stop], **args)
    assert reply.choices[0].text == full[:full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"
    wait_for(lambda: pool_is_free(tiny_stack), what="the stopped request to be aborted")


def test_seeded_sampling_is_reproducible_across_requests(tiny_stack):
    client = tiny_stack.openai()
    args = dict(model=tiny_stack.served_model_name, prompt="Random words:", max_tokens=16,
                temperature=1.0, seed=4242, extra_body={"ignore_eos": True})
    texts = {client.completions.create(**args).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_a_client_that_disconnects_mid_stream_aborts_its_request(tiny_stack):
    client = tiny_stack.openai()
    stream = client.completions.create(model=tiny_stack.served_model_name, prompt="Go on:",
                                       max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for(lambda: pool_is_free(tiny_stack), what="the abandoned request to be aborted")


@pytest.mark.parametrize("body", [
    {"prompt": "x " * 600, "max_tokens": 1},  # longer than max_model_len
    {"prompt": "hello", "max_tokens": 1000},  # prompt + max_tokens beyond it
    {"prompt": "hello", "temperature": -0.5},
    {"prompt": "hello", "top_p": 1.5},
    {"prompt": ""},
    {"prompt": "hello", "max_tokens": "many"},
])
def test_bad_completion_input_gets_a_4xx_openai_error_and_serving_goes_on(tiny_stack, body):
    client = tiny_stack.openai()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=tiny_stack.served_model_name, **body)
    assert 400 <= e.value.status_code < 500
    assert e.value.body and "message" in e.value.body
    reply = client.completions.create(model=tiny_stack.served_model_name, prompt="ok",
                                      max_tokens=2, extra_body={"ignore_eos": True}, **GREEDY)
    assert reply.usage.completion_tokens == 2
    assert pool_is_free(tiny_stack)


# ---------------------------------------------------------------------------
# gapserve serve


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _start_serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, list[int], int]:
    http, grpc_port, sched, worker = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
    env["OMP_NUM_THREADS"] = "1"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gapserve", "serve", "--model", str(model_dir),
             "--http-port", str(http), "--grpc-port", str(grpc_port),
             "--scheduler-port", str(sched), "--worker-port", str(worker),
             "--scheduler-metrics-port", "0", "--worker-metrics-port", "0",
             "--log-format", "json", *TINY_FLAGS],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: b"gapserve: serving" in log.read_bytes() or proc.poll() is not None,
                 timeout_s=300, what="gapserve serve to report ready")
    except AssertionError:
        proc.kill()
        raise
    assert proc.poll() is None, log.read_text()[-3000:]
    kids = _children(proc.pid)
    assert len(kids) == 3
    return proc, kids, http


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_serve_stops_all_three_services_cleanly_on_sigterm(tiny_model_dir, tmp_path):
    proc, kids, _ = _start_serve(tiny_model_dir, tmp_path / "serve.log")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert all(_gone(k) for k in kids)


def test_serve_restarts_a_dead_service_and_keeps_serving(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, kids, http = _start_serve(tiny_model_dir, log)
    worker = next(k for k in kids if b"worker" in Path(f"/proc/{k}/cmdline").read_bytes())
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: b"worker-0 exited with code -9; restarting it" in log.read_bytes(),
             timeout_s=30, what="serve to restart the worker")
    assert proc.poll() is None  # the others carried on
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x",
                           max_retries=0, timeout=120)
    # the scheduler reconnects to the new worker; the request waits for it, no error
    done = client.completions.create(model=tiny_model_dir.name, prompt="Hello",
                                     max_tokens=4, temperature=0.0)
    assert done.choices[0].finish_reason in ("length", "stop")
    new_kids = _children(proc.pid)
    assert worker not in new_kids and len(new_kids) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert all(_gone(k) for k in new_kids)
