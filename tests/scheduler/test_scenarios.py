"""The shipped scenarios show what docs/scheduling.md says they show."""

import json
from pathlib import Path

from scheduler_svc.sim.cli import main

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


# The scenarios are written for a worker faster than this CPU, where a step's fixed
# cost weighs more against its per-token cost; docs/scheduling.md runs them so too.
SCENARIO_STEP_MODEL = ("--step-fixed-ms", "25", "--step-per-seq-ms", "0.6",
                       "--step-per-prefill-token-ms", "0.35")


def sweep(capsys, *argv):
    assert main([*argv, *SCENARIO_STEP_MODEL, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"]


def test_budget_trades_chat_stalls_for_long_prompt_ttft_and_threshold_lets_chats_overtake(capsys):
    rows = sweep(capsys, "--workload", str(SCENARIOS / "long_prompt_into_chats.json"),
                 "--max-model-len", "8192", "--num-gpu-blocks-override", "4096",
                 "--max-num-batched-tokens", "512,2048,8192",
                 "--long-prefill-token-threshold", "0,256")
    by = {(r["settings"]["max-num-batched-tokens"],
           r["settings"]["long-prefill-token-threshold"]): r["groups"] for r in rows}
    stall = [by[(b, 0)]["chat"]["itl_ms"]["max"] for b in (512, 2048, 8192)]
    long_ttft = [by[(b, 0)]["long"]["ttft_ms"]["mean"] for b in (512, 2048, 8192)]
    assert stall[0] < stall[1] < stall[2]
    assert long_ttft[0] > long_ttft[1] > long_ttft[2]
    for budget in (512, 2048, 8192):  # short prompts overtake the long one
        assert by[(budget, 256)]["chat"]["ttft_ms"]["p99"] < by[(budget, 0)]["chat"]["ttft_ms"]["p99"] / 4
        assert by[(budget, 256)]["long"]["ttft_ms"]["mean"] > by[(budget, 0)]["long"]["ttft_ms"]["mean"]


def test_small_pool_preempts_when_concurrency_outruns_memory_and_a_cap_removes_it(capsys):
    rows = sweep(capsys, "--workload", str(SCENARIOS / "small_kv_pool.json"),
                 "--max-model-len", "1024", "--num-gpu-blocks-override", "513",
                 "--max-num-seqs", "48,16")
    wide, capped = rows
    assert wide["preemptions"] > 0 and wide["recomputed_tokens"] > 0
    assert capped["preemptions"] == 0 and capped["recomputed_tokens"] == 0
    assert capped["makespan_ms"] < 1.1 * wide["makespan_ms"]
    assert capped["groups"]["grow"]["itl_ms"]["max"] < wide["groups"]["grow"]["itl_ms"]["max"] / 10
