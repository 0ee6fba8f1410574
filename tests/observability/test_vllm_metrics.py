"""vLLM's metric names on the frontend's /metrics (issue 32, item 2): every name
vLLM's Grafana dashboards query that gapserve serves is there with its `model_name`
and `engine` labels (the names it does not serve, and why, are listed beside them and
checked absent); with --api-server-count 2 the summed counters are right whichever
frontend answers; under data parallelism each replica is its own `engine`.

The stack runs two frontends on one port (SO_REUSEPORT), the tiny model."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from frontend_svc.telemetry import vllm_metrics
from shared.proto import engine_pb2
from shared.types import FinishReason, RequestOutput, SamplingParams
from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.integration.tiny_model import tiny_llama_dir
from tests.observability.helpers import give, sample, tracked
from tests.observability.test_scheduler_telemetry import Clock, Stats, new_step, telemetry

DASHBOARD = Path(__file__).parent / "data" / "vllm_dashboard_metrics.txt"
NOT_SERVED = Path(__file__).parent / "data" / "vllm_dashboard_metrics_not_served.txt"
# vLLM's types for the dashboards' names (vllm/v1/metrics/loggers.py)
GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:num_requests_waiting_by_reason", "vllm:cache_config_info"}
COUNTERS = {"vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached",
            "vllm:prompt_tokens_cached_by_source", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos"}


def dashboard_names() -> list[str]:
    return [line.strip() for line in DASHBOARD.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def not_served_names() -> list[str]:
    return [line.split("\t", 1)[0] for line in NOT_SERVED.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


# ---- without a stack


def test_token_buckets_are_vllms_1_2_5_series_up_to_max_model_len():
    assert vllm_metrics.build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert vllm_metrics.build_1_2_5_buckets(512)[-1] == 500


def test_scheduler_series_are_its_status_gauges_and_cumulative_counters():
    collector = vllm_metrics.SchedulerStatusCollector()
    collector.model_name = "m"
    collector.status = engine_pb2.EngineStatus(
        num_running=3, num_waiting=4, num_waiting_not_ready=1, kv_cache_usage=0.5,
        num_preemptions_total=7, prefix_cache_queries=90, prefix_cache_hits=32)
    registry = CollectorRegistry()
    registry.register(collector)
    got = families(generate_latest(registry).decode())
    labels = {"model_name": "m", "engine": "0"}
    value = {(f.name, s.name): (s.labels, s.value) for f in got.values() for s in f.samples}
    assert value["vllm:num_requests_running", "vllm:num_requests_running"] == (labels, 3)
    assert value["vllm:num_requests_waiting", "vllm:num_requests_waiting"] == (labels, 5)
    assert value["vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"] == (labels, 0.5)
    assert value["vllm:num_preemptions", "vllm:num_preemptions_total"] == (labels, 7)
    assert value["vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"] == (labels, 90)
    assert value["vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total"] == (labels, 32)
    assert {f.type for n, f in got.items() if n in GAUGES} == {"gauge"}
    waiting = {s.labels["reason"]: s.value
               for s in got["vllm:num_requests_waiting_by_reason"].samples}
    assert waiting == {"capacity": 4, "deferred": 1}  # sums to num_requests_waiting
    tiers = {s.labels["source"]: s.value
             for s in got["vllm:prompt_tokens_cached_by_source"].samples}
    assert tiers == {"device": 32, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0}
    assert not any(n.startswith("vllm:spec_decode") for n in got)  # none configured
    collector.status = None  # the scheduler did not answer: no stale values
    assert families(generate_latest(registry).decode()) == {}


def test_spec_decode_series_are_the_schedulers_totals_when_it_speculates():
    collector = vllm_metrics.SchedulerStatusCollector()
    collector.model_name = "m"
    collector.status = engine_pb2.EngineStatus(
        speculative_config='{"method":"ngram","num_speculative_tokens":2}', spec_num_drafts=5,
        spec_num_draft_tokens=9, spec_num_accepted_tokens=6,
        spec_num_accepted_tokens_per_pos=[4, 2])
    registry = CollectorRegistry()
    registry.register(collector)
    got = families(generate_latest(registry).decode())
    value = {s.name: s.value for n, f in got.items() if n.startswith("vllm:spec")
             for s in f.samples if "position" not in s.labels}
    assert value == {"vllm:spec_decode_num_drafts_total": 5,
                     "vllm:spec_decode_num_draft_tokens_total": 9,
                     "vllm:spec_decode_num_accepted_tokens_total": 6}
    per_pos = {s.labels["position"]: s.value
               for s in got["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 4, "1": 2}


def test_under_data_parallelism_each_replica_is_its_own_engine():
    collector = vllm_metrics.SchedulerStatusCollector()
    collector.model_name, collector.block_size = "m", 16
    collector.engines = [
        ("0", engine_pb2.EngineStatus(num_running=3, num_kv_blocks=96, prefix_cache_hits=5)),
        ("1", engine_pb2.EngineStatus(num_running=1, num_waiting=2, num_kv_blocks=69))]
    registry = CollectorRegistry()
    registry.register(collector)
    got = families(generate_latest(registry).decode())
    running = {s.labels["engine"]: s.value for s in got["vllm:num_requests_running"].samples}
    assert running == {"0": 3, "1": 1}
    info = {s.labels["engine"]: (s.labels["num_gpu_blocks"], s.labels["block_size"], s.value)
            for s in got["vllm:cache_config_info"].samples}
    assert info == {"0": ("96", "16", 1), "1": ("69", "16", 1)}
    # a request's series follow the replica that serves it, from its next output on
    t = tracked("dp-1", "vllm-dp", SamplingParams(max_tokens=4), 5,
                             max_model_len=512)
    vllm_metrics.routed("dp-1", 1)
    t.on_output(t.choice.seen(RequestOutput("dp-1", [7])))
    give(t, 1, 0.1)
    t.finish(FinishReason.LENGTH)
    vllm_metrics.ended("dp-1")
    assert sample("vllm:generation_tokens_total", model_name="vllm-dp", engine="1") == 1
    assert sample("vllm:request_success_total", model_name="vllm-dp", engine="1",
                  finished_reason="length") == 1
    assert sample("vllm:generation_tokens_total", model_name="vllm-dp", engine="0") == 0


def test_a_tracked_request_feeds_the_vllm_series_as_vllm_counts_them():
    m = "vllm-unit"
    before = {n: sample(n, model_name=m, engine="0") for n in (
        "vllm:inter_token_latency_seconds_count", "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total", "vllm:request_time_per_output_token_seconds_sum",
        "vllm:request_decode_time_seconds_sum")}
    t = tracked("v1", m, SamplingParams(max_tokens=8), 6, max_model_len=512)
    give(t, 1, 0.1)
    give(t, 3, 0.4)  # one output of three tokens: one ITL sample
    give(t, 1, 0.5)
    t.finish(FinishReason.LENGTH)

    def delta(name: str) -> float:
        return sample(name, model_name=m, engine="0") - before[name]

    assert delta("vllm:inter_token_latency_seconds_count") == 2
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == 6
    assert delta("vllm:request_decode_time_seconds_sum") == pytest.approx(0.4)
    # TPOT: decode time over the tokens after the first
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert sample("vllm:request_success_total", model_name=m, engine="0",
                  finished_reason="length") == 1
    assert sample("vllm:request_params_max_tokens_bucket", model_name=m, engine="0",
                  le="10.0") >= 1


def test_a_prompts_sources_are_counted_once_its_prefill_ran():
    """vLLM's split of prompt tokens: computed here, found in the prefix cache, loaded
    through a KV connector (none here: 0); the per-request computed tokens."""
    m = "vllm-sources"
    t = tracked("s1", m, SamplingParams(max_tokens=4), 40, max_model_len=512)
    give(t, 1, 0.1)
    t.choice.num_cached_tokens = 32
    t.finish(FinishReason.LENGTH)
    by = {src: sample("vllm:prompt_tokens_by_source_total", model_name=m, engine="0",
                      source=src) for src in vllm_metrics.PROMPT_SOURCES}
    assert by == {"local_compute": 8, "local_cache_hit": 32, "external_kv_transfer": 0}
    assert sample("vllm:prompt_tokens_cached_total", model_name=m, engine="0") == 32
    assert sample("vllm:request_prefill_kv_computed_tokens_sum", model_name=m,
                  engine="0") == 8
    # aborted before its first token: its prompt was not prefilled, so no sources (as
    # vLLM), but vLLM's per-request histogram counts it whole
    t = tracked("s2", m, SamplingParams(max_tokens=4), 10, max_model_len=512)
    t.finish(FinishReason.ABORT)
    assert sample("vllm:prompt_tokens_by_source_total", model_name=m, engine="0",
                  source="local_compute") == 8
    assert sample("vllm:request_prefill_kv_computed_tokens_sum", model_name=m,
                  engine="0") == 18


def test_the_scheduler_sends_queue_and_prefill_times_with_the_first_token_only(captured):
    captured("scheduler")
    clock = Clock()
    tel = telemetry(clock=clock)
    tel.request_added("q", 3, SamplingParams(max_tokens=4))
    clock.now += 2.0  # waiting
    tel.step_scheduled(new_step(1, new=["q"], tokens=3), Stats(num_running=1))
    clock.now += 0.5  # prefill
    first, later = RequestOutput("q", [7]), RequestOutput("q", [8])
    tel.request_outputs([first])
    tel.request_outputs([later])
    assert (first.queue_time_s, first.prefill_time_s) == (2.0, 0.5)
    assert (later.queue_time_s, later.prefill_time_s) == (None, None)


def test_the_queue_and_prefill_times_are_observed_once_when_the_request_finishes():
    m = "vllm-phases"
    t = tracked("p1", m, SamplingParams(max_tokens=8), 3, max_model_len=512)
    t.on_output(t.choice.seen(RequestOutput("p1", [7], queue_time_s=2.0, prefill_time_s=0.5)))
    # a continuation on a second scheduler reports its own: the first ones are kept
    t.on_output(t.choice.seen(RequestOutput("p1", [8], queue_time_s=9.0, prefill_time_s=9.0)))
    assert sample("vllm:request_queue_time_seconds_count", model_name=m, engine="0") == 0
    t.finish(FinishReason.STOP)
    assert sample("vllm:request_queue_time_seconds_sum", model_name=m, engine="0") == 2.0
    assert sample("vllm:request_prefill_time_seconds_sum", model_name=m, engine="0") == 0.5
    assert sample("vllm:request_prefill_time_seconds_count", model_name=m, engine="0") == 1


@pytest.mark.parametrize("count", [1, 2])
def test_only_several_frontends_share_one_fresh_multiprocess_metrics_dir(count):
    from gapserve.serve import children, serve_parser
    from shared import config
    args = config.parse_args(serve_parser(), ["--model", "m", "--api-server-count", str(count)],
                             environ={})
    dirs = {c.name: c.env.get("PROMETHEUS_MULTIPROC_DIR") for c in children(args)}
    assert dirs.pop("scheduler") is None and dirs.pop("worker-0") is None
    if count == 1:
        assert dirs == {"frontend": None}
    else:
        [path] = set(dirs.values())
        assert len(dirs) == 2 and Path(path).is_dir() and not any(Path(path).iterdir())


# ---- two frontends on one port


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tiny_llama_dir(), tmp_path_factory.mktemp("vllm-metrics-stack"),
                    flags=[*TINY_FLAGS, "--api-server-count", "2", "--speculative-config",
                           '{"method": "draft_model", "quantization": "int8", '
                           '"num_speculative_tokens": 2}'])
    yield s
    s.stop()


def metrics_dir(stack) -> Path:
    [path] = {c.env["PROMETHEUS_MULTIPROC_DIR"] for c in stack.supervisor.children
              if c.name.startswith("frontend")}
    return Path(path)


def successes_by_process(stack) -> dict[str, float]:
    """vllm:request_success_total as each frontend process recorded it."""
    out: dict[str, float] = defaultdict(float)
    for f in metrics_dir(stack).glob("counter_*.db"):
        pid = re.fullmatch(r"counter_(\d+)\.db", f.name).group(1)
        for family in MultiProcessCollector.merge([str(f)]):
            out[pid] += sum(s.value for s in family.samples
                            if s.name == "vllm:request_success_total")
    return out


def scrape(stack) -> dict:
    # a new connection each time: the kernel picks either frontend
    with urllib.request.urlopen(stack.http_url + "/metrics", timeout=10) as reply:
        return families(reply.read().decode())


def total(fams: dict, family: str, sample_name: str) -> float:
    return sum(s.value for s in fams[family].samples if s.name == sample_name)


# two full KV blocks and more: from the second request on, a prefix-cache hit
PROMPT = "the cat sat on the mat and looked at the dog, " * 4


@pytest.fixture(scope="module")
def sent(stack):
    """Completions, each on a new connection, until both frontends served some."""
    usage = {"requests": 0, "prompt": 0, "completion": 0}
    while len([v for v in successes_by_process(stack).values() if v]) < 2:
        assert usage["requests"] < 60, "the kernel sent every connection to one frontend"
        with stack.openai() as client:
            r = client.completions.create(model=stack.served_model_name,
                                          prompt=PROMPT, max_tokens=4, temperature=0.0)
        usage["requests"] += 1
        usage["prompt"] += r.usage.prompt_tokens
        usage["completion"] += r.usage.completion_tokens
    return usage


def test_every_vllm_name_the_dashboard_queries_is_served_with_model_name(stack, sent):
    fams = scrape(stack)
    missing = [n for n in dashboard_names() if n not in fams]
    assert not missing, f"not on the frontend's /metrics: {missing}"
    served = [n for n in not_served_names() if n in fams]
    assert not served, f"listed as not served, but served: {served}"
    for name in dashboard_names():
        assert fams[name].samples, name
        for s in fams[name].samples:
            assert s.labels.get("model_name") == stack.served_model_name, (name, s)
            assert s.labels.get("engine") == "0", (name, s)
    assert {fams[n].type for n in GAUGES} == {"gauge"}
    assert {fams[n].type for n in COUNTERS} == {"counter"}
    assert {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples} \
        <= {"stop", "length", "abort"}


def test_the_prompt_token_sources_add_up_to_the_prompt_tokens(stack, sent):
    """Every request of `sent` got tokens, so each prompt token is computed or cached;
    the cache tier is the engine's own pool, and it agrees with the prefix-cache hits."""
    fams = scrape(stack)
    by = defaultdict(float)
    for s in fams["vllm:prompt_tokens_by_source"].samples:
        by[s.labels["source"]] += s.value
    assert by["local_compute"] + by["local_cache_hit"] == sent["prompt"]
    assert by["external_kv_transfer"] == 0
    assert by["local_cache_hit"] == total(fams, "vllm:prompt_tokens_cached",
                                          "vllm:prompt_tokens_cached_total") > 0
    tiers = {s.labels["source"]: s.value
             for s in fams["vllm:prompt_tokens_cached_by_source"].samples}
    assert tiers["device"] == total(fams, "vllm:prefix_cache_hits",
                                    "vllm:prefix_cache_hits_total")
    [info] = fams["vllm:cache_config_info"].samples
    status = stack.engine_status()
    assert (info.labels["num_gpu_blocks"], info.value) == (str(status.num_kv_blocks), 1)


def test_the_gapserve_series_stay_beside_the_vllm_ones(stack, sent):
    fams = scrape(stack)
    assert total(fams, "gapserve:request_success", "gapserve:request_success_total") \
        == total(fams, "vllm:request_success", "vllm:request_success_total")


def test_with_two_frontends_every_scrape_sums_the_requests_sent(stack, sent):
    by_process = successes_by_process(stack)
    assert len([v for v in by_process.values() if v]) == 2  # both served some
    for _ in range(6):  # whichever process answers
        fams = scrape(stack)
        assert total(fams, "vllm:request_success", "vllm:request_success_total") \
            == sent["requests"]
        assert total(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == sent["prompt"]
        assert total(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") \
            == sent["completion"]
        for family in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                       "vllm:request_prefill_time_seconds"):
            assert total(fams, family, family + "_count") == sent["requests"]


def test_the_scheduler_series_are_the_schedulers_own_totals(stack, sent):
    fams = scrape(stack)
    status = stack.engine_status()
    assert total(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") \
        == status.num_preemptions_total
    assert total(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") \
        == status.prefix_cache_queries > 0
    assert total(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") \
        == status.prefix_cache_hits
    assert total(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert 0.0 <= total(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1.0


def test_without_the_scheduler_a_scrape_has_no_stale_scheduler_series(stack, sent):
    """Last in this module: it stops the stack's scheduler."""
    scheduler = stack.process("scheduler")
    scheduler.kill()
    scheduler.wait()
    fams = scrape(stack)
    assert "vllm:num_requests_waiting" not in fams and "vllm:num_preemptions" not in fams
    assert total(fams, "vllm:request_success", "vllm:request_success_total") \
        == sent["requests"]  # the frontends' own series stay
    assert "scrape without the scheduler's series" in stack.logs(chars=20000)
