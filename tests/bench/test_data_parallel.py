"""benchmarks/data_parallel.py: its pure parts (workload, alternation, percentiles,
summary, goal, table) and one real run with tiny settings: the tiny random-weight
model on two replicas behind sglang-router and behind the built-in kv-aware routing."""

from __future__ import annotations

import json

import pytest

from tests.integration.tiny_model import tiny_llama_dir

from .test_serve_bench import _load

dp = _load("data_parallel")


def test_the_workload_binds_each_user_to_one_long_system_prompt_and_is_repeatable():
    args = dp.parse_args(["--users", "12", "--system-prompts", "3", "--system-words", "50",
                          "--turns", "2"])
    users = dp.workload(args)
    assert users == dp.workload(args)  # seeded: every run and mode sends the same
    systems = {u.system for u in users}
    assert len(systems) == 3 and all(len(s.split()) > 50 for s in systems)
    assert sorted(sum(u.system == s for u in users) for s in systems) == [4, 4, 4]
    assert all(len(u.turns) == 2 and len(u.turns[0].split()) < 15 for u in users)


def test_modes_alternate_so_each_runs_first_middle_and_last():
    modes = list(dp.MODES)
    orders = [dp.order(r, modes) for r in range(3)]
    assert [o[0] for o in orders] == modes and all(sorted(o) == sorted(modes) for o in orders)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (dp.percentile(values, 50), dp.percentile(values, 99)) == (50.0, 99.0)
    assert dp.percentile([7.0], 99) == 7.0


def test_summary_goal_and_table_from_runs():
    def run(mode, hit, ttft):
        return {"mode": mode, "hit_rate": hit, "tok_s_per_core": 10.0, "ttft_p50_ms": ttft,
                "ttft_p99_ms": 2 * ttft, "num_errors": 0}
    runs = [run("round-robin", 0.4, 900), run("round-robin", 0.5, 800),
            run("sglang-router", 0.8, 500), run("sglang-router", 0.7, 600),
            run("kv-aware", 0.8, 400), run("kv-aware", 0.9, 450)]
    summary = dp.summarize(runs, list(dp.MODES))
    assert summary["kv-aware"]["hit_rate"] == {"median": pytest.approx(0.85), "min": 0.8,
                                               "max": 0.9}
    assert dp.goal(summary) == ["kv-aware hit rate >= sglang-router's: True",
                                "kv-aware hit rate >= 1.5x round-robin's: True",
                                "kv-aware TTFT p50 below round-robin and sglang-router: True"]
    table = dp.markdown(summary, dp.parse_args(["--repeats", "2"]))
    assert "| kv-aware | 0.850 (0.800-0.900) |" in table and "share" in table
    assert dp.goal(dp.summarize(runs[:4], ["round-robin", "sglang-router"])) == [
        "goal not checked: kv-aware did not run"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        dp.parse_args(["--modes", "random"])
    with pytest.raises(SystemExit):
        dp.parse_args(["--users", "0"])


def test_one_run_on_two_tiny_replicas_behind_sglang_router_and_the_built_in_routing(
        tmp_path, capsys):
    out = tmp_path / "dp.json"
    code = dp.main(["--model", str(tiny_llama_dir()), "--modes", "sglang-router,kv-aware",
                    "--repeats", "1", "--users", "6", "--turns", "2", "--system-prompts", "2",
                    "--system-words", "60", "--max-tokens", "4", "--concurrency", "3",
                    "--kv-blocks", "24", "--max-model-len", "256",
                    "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == ["sglang-router", "kv-aware"]
    for r in report["runs"]:
        # every turn answered; the shared system prompts hit the cache somewhere
        assert r["requests"] == 12 and r["num_errors"] == 0 and r["output_tokens"] == 48
        assert 0.0 < r["hit_rate"] <= 1.0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert len(r["per_replica"]) == 2 and sum(r["per_replica"]) == 12
    printed = capsys.readouterr().out
    assert "| sglang-router |" in printed and "| kv-aware |" in printed
    assert "kv-aware hit rate >= sglang-router's:" in printed


def test_the_report_says_whether_one_replicas_pool_holds_the_system_prompts():
    """The setting decides what a run can show: counted against the pool, in words."""
    args = dp.parse_args(["--kv-blocks", "69"])
    args.prompt_blocks = 104
    assert dp.condition(args) == ("The system prompts fill 104 KV blocks, 1.51x one replica's "
                                  "69: they exceed one replica's pool but fit in two.")
    args.kv_blocks = 120
    assert "one replica's pool holds them all" in dp.condition(args)
    args.kv_blocks = 40
    assert "exceed both pools together" in dp.condition(args)
    args.prompt_blocks = None
    assert "not counted" in dp.condition(args)
    with pytest.raises(SystemExit):
        dp.parse_args(["--block-size", "0"])


def test_prompt_blocks_counts_full_blocks_of_each_distinct_system_prompt():
    args = dp.parse_args(["--users", "6", "--system-prompts", "2", "--system-words", "60",
                          "--block-size", "16"])
    args.model = str(tiny_llama_dir())
    blocks = dp.prompt_blocks(args, dp.workload(args))
    # two distinct prompts of 60+ words: at least 60 tokens each, so 3+ full blocks each
    assert blocks is not None and blocks >= 6
    args.block_size = 8
    assert dp.prompt_blocks(args, dp.workload(args)) >= 2 * blocks  # floor(n/8) >= 2 floor(n/16)
