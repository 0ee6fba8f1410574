"""A bad step raises a clear error before any compute and leaves the worker as it was."""

import pytest
import torch

from shared.types import (CachedRequestData, InvalidRequestError, NewRequestData,
                          SamplingParams, SchedulerOutput)
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner
from worker_svc.step_check import StepError


@pytest.fixture()
def runner(tiny_llama_dir):
    return ModelRunner(WorkerConfig(model=str(tiny_llama_dir), device="cpu",
                                    max_model_len=64, num_gpu_blocks_override=16,
                                    max_num_seqs=4))


def _new(req_id, prompt, params=None, blocks=(1,), computed=0):
    return NewRequestData(req_id, list(prompt), params or SamplingParams(temperature=0.0),
                          list(blocks), computed)


def _step(new=(), n=None, step_id=0, cached=None):
    n = n or {r.req_id: len(r.prompt_token_ids) for r in new}
    return SchedulerOutput(step_id=step_id, scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=cached or CachedRequestData(),
                           num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()))


def _snapshot(runner):
    return ({k: (list(v.token_ids), list(v.block_ids), v.num_computed_tokens)
             for k, v in runner.requests.items()},
            [c.clone() for c in runner.kv_caches])


def _assert_unchanged(runner, before):
    reqs, caches = _snapshot(runner)
    assert reqs == before[0]
    assert all(torch.equal(a, b) for a, b in zip(caches, before[1]))


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_k=100_000), "top_k"),
    (SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    (SamplingParams(logprobs=21), "logprobs"),
])
def test_invalid_sampling_params_are_rejected_before_any_compute(runner, params, message):
    good = _new("good", [5, 6, 7])
    runner.execute(_step([good]))
    before = _snapshot(runner)
    bad = _new("bad", [8, 9], params, blocks=(2,))
    cached = CachedRequestData()
    cached.append("good", False, [], 3)
    with pytest.raises(InvalidRequestError, match=message):
        runner.execute(_step([bad], {"good": 1, "bad": 2}, 1, cached))
    _assert_unchanged(runner, before)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"), ([3, 300], r"\[0, 256\)"), (list(range(3, 70)), "max_model_len")])
def test_bad_prompts_are_rejected(runner, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        runner.execute(_step([_new("r", prompt, blocks=(1, 2, 3, 4, 5))],
                             {"r": max(len(prompt), 1)}))
    _assert_unchanged(runner, ({}, [torch.zeros_like(c) for c in runner.kv_caches]))


def test_desynced_steps_are_rejected_with_the_reason(runner):
    with pytest.raises(StepError, match="not held"):
        cached = CachedRequestData()
        cached.append("ghost", False, [], 0)
        runner.execute(_step(n={"ghost": 1}, cached=cached))
    with pytest.raises(StepError, match="cannot hold"):
        runner.execute(_step([_new("r", list(range(3, 23)))]))  # 20 tokens, one block
    with pytest.raises(StepError, match="block id"):
        runner.execute(_step([_new("r", [4, 5], blocks=(16,))]))
    with pytest.raises(StepError, match="only 3 tokens are known"):
        runner.execute(_step([_new("r", [4, 5, 6])], {"r": 4}))
    assert runner.requests == {}


def test_partial_prefill_samples_nothing_and_the_last_chunk_samples_one(runner):
    out = runner.execute(_step([_new("r", [4, 5, 6, 7, 8])], {"r": 3}))
    assert out.sampled_token_ids == [[]]
    cached = CachedRequestData()
    cached.append("r", False, [], 3)
    out = runner.execute(_step(n={"r": 2}, step_id=1, cached=cached))
    assert len(out.sampled_token_ids[0]) == 1
    assert runner.requests["r"].token_ids[-1] == out.sampled_token_ids[0][0]
    assert out.timings.forward_ms > 0 and out.timings.prepare_ms > 0


def _resume_step(step_id, check):
    cached = CachedRequestData()
    cached.append("r", True, [3], 0, check)
    return _step((), {"r": 4}, step_id, cached)


def test_resumed_request_whose_tokens_drifted_fails_the_step_loudly(runner):
    from shared.token_checksum import token_checksum
    runner.execute(_step([_new("r", [5, 6, 7])]))  # samples a 4th token
    tokens = list(runner.requests["r"].token_ids)
    runner.execute(SchedulerOutput(step_id=1, preempted_req_ids={"r"}))
    before = _snapshot(runner)
    drifted = [tokens[:-1] + [(tokens[-1] + 1) % 100], tokens[:-1], tokens + [1]]
    for i, wrong in enumerate(drifted):
        with pytest.raises(StepError, match="drifted"):
            runner.execute(_resume_step(2 + i, (len(wrong), token_checksum(wrong))))
        _assert_unchanged(runner, before)
    with pytest.raises(StepError, match="no token check"):
        runner.execute(_resume_step(5, None))
    runner.execute(_resume_step(6, (len(tokens), token_checksum(tokens))))  # agrees: runs
    assert runner.requests["r"].num_computed_tokens == 4
