"""The simulator: step-time model, workload files, clock, sweeps and report shapes."""

import json

import pytest

from scheduler_svc.core import SchedulerConfig
from scheduler_svc.sim.cli import main
from scheduler_svc.sim.runner import simulate
from scheduler_svc.sim.step_model import StepModel
from scheduler_svc.sim.workload import WorkloadError, make_requests, parse_workload
from shared.types import SchedulerOutput


def workload_file(tmp_path, groups):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"groups": groups}))
    return str(path)


def test_step_time_is_fixed_plus_per_seq_plus_per_prefill_token():
    model = StepModel(fixed_ms=10, per_seq_ms=1, per_prefill_token_ms=0.5)
    so = SchedulerOutput(step_id=0, num_scheduled_tokens={"a": 1, "b": 1, "c": 100})
    assert model.step_ms(so) == 10 + 3 * 1 + 0.5 * 100
    assert model.step_ms(SchedulerOutput(step_id=1)) == 0.0


def test_target_itl_budget_is_target_less_fixed_over_per_prefill_token():
    assert StepModel(fixed_ms=25, per_prefill_token_ms=0.35).budget_for(200) == 500


@pytest.mark.parametrize("groups,field", [
    ([{"name": "a", "count": 0, "arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 5}], "count"),
    ([{"name": "a", "count": 1, "arrival_ms": -1, "prompt_tokens": 5, "output_tokens": 5}], "arrival_ms"),
    ([{"name": "a", "count": 1, "arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 5,
       "shared_prefix_tokens": 6}], "shared_prefix_tokens"),
    ([{"name": "a", "count": 1, "arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 5,
       "colour": 1}], "colour"),
    ([{"name": "a", "count": 1, "arrival_ms": [0, 1], "prompt_tokens": 5, "output_tokens": 5}],
     "arrival_ms"),
    ([], "groups"),
])
def test_bad_workload_is_rejected_naming_the_field(groups, field):
    with pytest.raises(WorkloadError, match=field):
        parse_workload({"groups": groups})


def test_prompts_are_distinct_except_for_a_groups_shared_prefix():
    groups = parse_workload({"groups": [
        {"name": "a", "count": 3, "arrival_ms": {"start": 0, "interval": 10},
         "prompt_tokens": 40, "output_tokens": 1, "shared_prefix_tokens": 32}]})
    reqs = make_requests(groups)
    assert [r.arrival_ms for r in reqs] == [0, 10, 20]
    prompts = [r.request.prompt_token_ids for r in reqs]
    assert all(len(p) == 40 for p in prompts)
    assert prompts[0][:32] == prompts[1][:32] == prompts[2][:32]
    assert len({tuple(p[32:]) for p in prompts}) == 3


def test_a_request_arriving_during_a_step_joins_at_the_next_step():
    model = StepModel(fixed_ms=10, per_seq_ms=0, per_prefill_token_ms=1)
    groups = parse_workload({"groups": [
        {"name": "first", "count": 1, "arrival_ms": 0, "prompt_tokens": 20, "output_tokens": 1},
        {"name": "second", "count": 1, "arrival_ms": 1, "prompt_tokens": 20, "output_tokens": 1}]})
    cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, hash_seed="t")
    result = simulate(cfg, 64, make_requests(groups), model)
    assert result.groups["first"].ttft_ms == [30]  # 10 + 20 prefill tokens
    assert result.groups["second"].ttft_ms == [30 + 30 - 1]
    assert result.makespan_ms == 60 and result.num_steps == 2


def test_inter_token_latency_is_the_step_time_of_decodes():
    model = StepModel(fixed_ms=10, per_seq_ms=2, per_prefill_token_ms=1)
    groups = parse_workload({"groups": [
        {"name": "g", "count": 2, "arrival_ms": 0, "prompt_tokens": 4, "output_tokens": 3}]})
    cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, hash_seed="t")
    result = simulate(cfg, 64, make_requests(groups), model)
    assert result.groups["g"].itl_ms == [14, 14, 14, 14]


def test_a_multi_step_decode_takes_its_passes_time_and_holds_an_arrival_back():
    model = StepModel(fixed_ms=10, per_seq_ms=0, per_prefill_token_ms=1)
    groups = parse_workload({"groups": [
        {"name": "long", "count": 1, "arrival_ms": 0, "prompt_tokens": 4, "output_tokens": 9},
        {"name": "late", "count": 1, "arrival_ms": 15, "prompt_tokens": 4, "output_tokens": 1}]})
    cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, hash_seed="t",
                          num_scheduler_steps=4)
    result = simulate(cfg, 64, make_requests(groups), model)
    # prefill 0-14; then 4 passes of 10 ms (14-54): their tokens share the 40 ms
    assert result.groups["long"].itl_ms[:4] == [10.0] * 4
    # "late" arrives at 15, during the multi-step: admitted after it, prefilled 54-68
    assert result.groups["late"].ttft_ms == [68 - 15]


def test_a_comma_list_sweeps_the_flag_one_row_per_setting(tmp_path, capsys):
    path = workload_file(tmp_path, [
        {"name": "g", "count": 4, "arrival_ms": 0, "prompt_tokens": 30, "output_tokens": 8}])
    assert main(["--workload", path, "--max-num-seqs", "4,2", "--max-model-len", "64",
                 "--no-enable-prefix-caching", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["results"]
    assert [r["settings"] for r in rows] == [{"max-num-seqs": 4}, {"max-num-seqs": 2}]
    assert doc["fixed"] == {"max-model-len": 64, "enable-prefix-caching": False}
    for row in rows:
        assert set(row) >= {"settings", "preemptions", "recomputed_tokens", "makespan_ms", "groups"}
        g = row["groups"]["g"]
        assert set(g["ttft_ms"]) == {"mean", "p50", "p99"}
        assert set(g["itl_ms"]) == {"p50", "p99", "max"}
    assert rows[1]["makespan_ms"] > rows[0]["makespan_ms"]


def test_boolean_flags_sweep_too_and_prefix_caching_shortens_ttft(tmp_path, capsys):
    path = workload_file(tmp_path, [
        {"name": "g", "count": 6, "arrival_ms": {"start": 0, "interval": 500},
         "prompt_tokens": 300, "output_tokens": 4, "shared_prefix_tokens": 256}])
    assert main(["--workload", path, "--enable-prefix-caching", "true,false",
                 "--max-model-len", "512", "--max-num-seqs", "8", "--json"]) == 0
    on, off = json.loads(capsys.readouterr().out)["results"]
    assert on["groups"]["g"]["ttft_ms"]["mean"] < off["groups"]["g"]["ttft_ms"]["mean"]


def test_table_and_target_itl_budget_are_printed(tmp_path, capsys):
    path = workload_file(tmp_path, [
        {"name": "g", "count": 2, "arrival_ms": 0, "prompt_tokens": 30, "output_tokens": 4}])
    assert main(["--workload", path, "--max-model-len", "64", "--max-num-seqs", "4",
                 "--step-fixed-ms", "25", "--step-per-prefill-token-ms", "0.35",
                 "--target-itl-ms", "200"]) == 0
    out = capsys.readouterr().out
    assert "ttft p99" in out and "--max-num-batched-tokens <= 500" in out


def test_bad_flag_values_and_configs_are_clear_errors(tmp_path, capsys):
    path = workload_file(tmp_path, [
        {"name": "g", "count": 1, "arrival_ms": 0, "prompt_tokens": 30, "output_tokens": 4}])
    with pytest.raises(SystemExit):
        main(["--workload", path, "--max-num-seqs", "4,x"])
    assert main(["--workload", path, "--max-num-seqs", "4096"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err
    assert main(["--workload", path, "--max-model-len", "16"]) == 2
    assert "prompt" in capsys.readouterr().err
    assert main(["--workload", str(tmp_path / "missing.json")]) == 2
