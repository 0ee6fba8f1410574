"""The stack exactly as `docker compose up` (no profile) describes it, run as local
processes with the real default model, answers a chat request; the benchmark client
measures it. test_compose_observability.py runs it with the observability profile."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from .compose_file import ROOT, environment, load_compose, prometheus_targets, published_ports
from .local_stack import LocalStack, running_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(load_compose(), tmp_path_factory.mktemp("compose-logs")) as stack:
        yield stack


def _api_base(stack: LocalStack) -> str:
    http_port = int(environment(stack.doc["services"]["frontend"])["GAPSERVE_HTTP_PORT"])
    published = [c for _, _, c in published_ports(stack.doc["services"]["frontend"])]
    assert http_port in published  # what a user reaches on the host
    return f"http://{stack.ports.address('frontend', http_port)}/v1"


def test_a_chat_request_completes_through_the_composed_stack(stack):
    from openai import OpenAI
    client = OpenAI(base_url=_api_base(stack), api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0.0)
    choice = reply.choices[0]
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 8


def test_every_gapserve_service_passes_its_compose_healthcheck(stack):
    for name in stack.services:
        assert stack.healthy(name), stack.services[name].log_tail()


def test_without_the_profile_the_stack_is_gapserve_alone_and_exports_no_traces(stack):
    assert set(stack.services) == {"worker", "scheduler", "frontend"}
    assert stack.receivers == {}
    for svc in stack.services.values():
        assert svc.env["GAPSERVE_OTLP_TRACES_ENDPOINT"] == ""


def test_every_prometheus_target_serves_metrics(stack):
    """The default stack's targets are the static ones; the profiles' services are found
    by DNS only while they run (test_compose_data_parallel scrapes those)."""
    for target, (_, _, by_dns) in prometheus_targets().items():
        if by_dns:
            continue
        host, port = target.split(":")
        resp = httpx.get(f"http://{stack.ports.address(host, int(port))}/metrics",
                         timeout=10)
        assert resp.status_code == 200, target
        assert "# TYPE gapserve:" in resp.text, target


def test_serve_bench_reports_a_sane_json_for_a_tiny_run(stack, tmp_path):
    out = tmp_path / "report.json"
    pids = [str(s.process.pid) for s in stack.services.values()]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"),
           "--base-url", _api_base(stack), "--num-requests", "4", "--concurrency", "2",
           "--max-tokens", "6", "--ignore-eos", "--json", str(out)]
    for pid in pids:
        cmd += ["--memory-pid", pid]
    grpc_port = int(environment(stack.doc["services"]["frontend"])["GAPSERVE_GRPC_PORT"])
    cmd += ["--kv-from-gapserve", stack.ports.address("frontend", grpc_port)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "4/4 done" in result.stderr  # progress while it runs
    report = json.loads(out.read_text())
    assert (report["completed"], report["errors"]) == (4, 0)
    assert report["total_output_tokens"] == 4 * 6  # ignore_eos: exactly max_tokens each
    assert report["mean_prompt_tokens"] > 10  # the chat template wraps the prompt
    assert 0 < report["ttft_ms"]["mean"] <= report["e2e_latency_ms"]["mean"]
    assert report["itl_ms"]["p50"] > 0 and report["output_throughput"] > 0
    assert report["memory"]["peak_sum_rss_bytes"] > 200 * 2**20  # fp32 weights alone ~0.5 GB
    assert {p["pid"] for p in report["memory"]["processes"]} >= set(map(int, pids))
    status = httpx.get(_api_base(stack).removesuffix("/v1") + "/v1/status", timeout=10).json()
    # SmolLM2 in fp32: 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes per token
    per_block = 16 * 30 * 2 * 3 * 64 * 4
    assert report["memory"]["kv_cache_bytes"] == status["num_kv_blocks"] * per_block
    assert report["memory"]["kv_cache_share_of_peak_rss"] > 0
    assert "Output tokens/s" in result.stdout and "KV cache" in result.stdout

