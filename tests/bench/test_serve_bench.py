"""serve_bench's client side: how it reads OpenAI-style streams, counts tokens and
errors, and summarizes. The server here is httpx's in-memory transport speaking
the OpenAI wire format (no socket); the real stack is measured in
tests/deploy/test_compose_stack.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load("serve_bench")


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def _chat_stream(words: list[str], usage: bool = True, done: bool = True) -> bytes:
    events: list = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 11,
                                                "completion_tokens": len(words)}})
    if done:
        events.append("[DONE]")
    return _sse(*events)


class Server:
    """Answers every request with the same body and records what it was sent."""

    def __init__(self, body: bytes, status: int = 200) -> None:
        self.body, self.status, self.seen = body, status, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(json.loads(request.content))
        return httpx.Response(self.status, content=self.body,
                              headers={"content-type": "text/event-stream"})


def _run(argv: list[str], server: Server):
    args = bench.parse_args(["--model", "m", "--quiet", *argv])
    args.started_at = "now"
    reqs = bench.build_requests(args)
    results, duration = asyncio.run(bench.run(args, reqs, httpx.MockTransport(server)))
    return bench.summarize(results, duration, args)


def test_essay_workload_sends_numbered_chat_prompts_with_ignore_eos():
    server = Server(_chat_stream(["a", "b"]))
    _run(["--num-requests", "3", "--concurrency", "2", "--ignore-eos", "--max-tokens", "7"],
         server)
    contents = sorted(b["messages"][0]["content"] for b in server.seen)
    assert contents == [bench.ESSAY_PROMPT.format(i=i) for i in range(3)]
    body = server.seen[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0


def test_output_tokens_come_from_the_usage_report_and_throughput_from_them():
    report = _run(["--num-requests", "4"], Server(_chat_stream(["x", "y", "z"])))
    assert report["completed"] == 4 and report["errors"] == 0
    assert report["total_output_tokens"] == 12
    assert report["mean_prompt_tokens"] == 11
    assert report["output_throughput"] == pytest.approx(12 / report["duration_s"])
    assert report["ttft_ms"]["p50"] is not None and report["itl_ms"]["mean"] is not None


def test_without_a_usage_report_each_text_chunk_counts_as_one_token():
    report = _run(["--num-requests", "2"], Server(_chat_stream(["x", "y"], usage=False)))
    assert report["total_output_tokens"] == 4 and report["mean_prompt_tokens"] is None


def test_a_stream_cut_before_done_is_an_error():
    report = _run(["--num-requests", "2"], Server(_chat_stream(["x"], done=False)))
    assert report["completed"] == 0 and report["errors"] == 2
    assert report["error_samples"] == ["stream ended without [DONE]"]
    assert report["ttft_ms"] == {"mean": None, "p50": None, "p99": None}


def test_an_http_error_status_is_counted_with_its_message():
    server = Server(b'{"error": {"message": "bad max_tokens"}}', status=400)
    report = _run(["--num-requests", "1"], server)
    assert report["errors"] == 1 and "HTTP 400" in report["error_samples"][0]
    assert "bad max_tokens" in report["error_samples"][0]
    json.dumps(report, allow_nan=False)  # the JSON report stays strict JSON on failure


def test_completions_endpoint_reads_text_chunks():
    stream = _sse({"choices": [{"index": 0, "text": "hi"}]},
                  {"choices": [{"index": 0, "text": " there"}]}, "[DONE]")
    server = Server(stream)
    report = _run(["--endpoint", "completions", "--workload", "random",
                   "--input-len", "5:9", "--num-requests", "3"], server)
    assert report["total_output_tokens"] == 6 and report["completed"] == 3
    lengths = [len(b["prompt"].split()) for b in server.seen]
    assert all(5 <= n <= 9 for n in lengths)


def test_random_prompts_are_the_same_for_the_same_seed():
    args = bench.parse_args(["--workload", "random", "--input-len", "8:40", "--seed", "3"])
    again = bench.parse_args(["--workload", "random", "--input-len", "8:40", "--seed", "3"])
    assert bench.build_requests(args) == bench.build_requests(again)


def test_poisson_arrivals_still_send_every_request():
    server = Server(_chat_stream(["x"]))
    report = _run(["--num-requests", "5", "--request-rate", "1000"], server)
    assert len(server.seen) == 5 and report["completed"] == 5


def test_prompt_file_items_may_be_strings_or_messages_with_their_own_max_tokens(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["plain", {"messages": [{"role": "user", "content": "m"}],
                                          "max_tokens": 3}]))
    server = Server(_chat_stream(["x"]))
    _run(["--prompt-file", str(path), "--num-requests", "4", "--concurrency", "1"], server)
    assert [b["messages"][0]["content"] for b in server.seen] == ["plain", "m", "plain", "m"]
    assert [b["max_tokens"] for b in server.seen] == [128, 3, 128, 3]


def test_a_prompt_file_without_prompts_is_refused_clearly(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"text": "no"}]))
    args = bench.parse_args(["--prompt-file", str(path)])
    with pytest.raises(ValueError, match="needs 'prompt' or 'messages'"):
        bench.build_requests(args)


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--concurrency", "0"],
                                  ["--request-rate", "-1"], ["--input-len", "9:3"]])
def test_bad_arguments_exit_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2


def test_percentile_interpolates_between_ranks_like_numpy():
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([5.0], 99) == 5.0
    assert bench.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_table_names_every_headline_metric():
    table = bench.format_table(_run(["--num-requests", "2"], Server(_chat_stream(["x", "y"]))))
    for label in ("Output tokens/s", "Requests/s", "TTFT mean / p50 / p99", "ITL mean",
                  "E2E latency mean", "Completed / errors"):
        assert label in table


def test_a_failed_warmup_stops_the_run_before_measuring():
    server = Server(b'{"error": {"message": "not ready"}}', status=503)
    args = bench.parse_args(["--model", "m", "--quiet", "--warmup", "1", "--num-requests", "3"])
    with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 503"):
        asyncio.run(bench.run(args, bench.build_requests(args), httpx.MockTransport(server)))
    assert len(server.seen) == 1
