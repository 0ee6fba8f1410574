"""Multi-step decode (SchedulerOutput.num_steps > 1): one step runs several forward
passes, each fed the tokens the last one sampled. It must give the tokens (and
logprobs) of one pass a step, bit for bit, and the step check must refuse a
multi-step it cannot run before anything changes."""

import pytest

from shared.types import MAX_NUM_STEPS, SamplingParams
from tests.worker.step_driver import StepDriver, tiny_cpu_runner
from worker_svc.step_check import StepError

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], list(range(60, 79))]


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    return tiny_cpu_runner(tiny_llama_dir), tiny_cpu_runner(tiny_llama_dir)


def _params():
    return [SamplingParams(temperature=0.0, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7),
            SamplingParams(temperature=0.0, repetition_penalty=1.3)]


def _generate(runner, passes: list[int]):
    """Prefill all prompts in one step, then decode with the given passes a step."""
    driver = StepDriver(runner)
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        driver.add(f"m{i}", prompt, max_new=1 + sum(passes), params=params)
    logprobs = {f"m{i}": [] for i in range(len(PROMPTS))}
    results = [driver.step()]
    for n in passes:
        results.append(driver.step({r: 1 for r in driver.requests}, num_steps=n))
    for result in results:
        for req_id, lps in zip(result.req_ids, result.logprobs):
            logprobs[req_id] += [(lp.token_id, lp.logprob) for lp in lps or []]
    outputs = {r: q.output for r, q in driver.requests.items()}
    driver.step({})  # an empty step tells the runner they finished
    return outputs, logprobs, results


def test_multi_step_gives_the_tokens_of_one_pass_a_step(runners):
    one, multi = runners
    want, want_lp, _ = _generate(one, [1] * 11)
    got, got_lp, results = _generate(multi, [4, 1, 5, 1])
    assert got == want
    assert got_lp == want_lp and len(got_lp["m0"]) == 12
    assert [len(t) for t in results[1].sampled_token_ids] == [4, 4, 4]
    assert results[1].timings.forward_ms > 0
    assert not one.requests and not multi.requests


def test_a_multi_step_the_worker_cannot_run_is_refused_and_changes_nothing(runners):
    runner = runners[0]
    driver = StepDriver(runner)
    driver.add("p", PROMPTS[0], max_new=40)
    driver.step({"p": 3})  # 3 of the prompt's 7 tokens
    state = runner.requests["p"]
    before = (list(state.token_ids), state.num_computed_tokens, list(state.block_ids))
    with pytest.raises(StepError, match="one token that samples"):
        driver.step({"p": 2}, num_steps=3)  # a prefill chunk: it does not sample
    assert (list(state.token_ids), state.num_computed_tokens, list(state.block_ids)) == before
    with pytest.raises(StepError, match=f"outside \\[1, {MAX_NUM_STEPS}\\]"):
        driver.step({"p": 1}, num_steps=MAX_NUM_STEPS + 1)
    assert (list(state.token_ids), state.num_computed_tokens) == before[:2]


def test_multi_step_blocks_must_cover_every_pass(runners):
    from shared.types import CachedRequestData, SchedulerOutput
    runner = runners[1]
    driver = StepDriver(runner)
    driver.add("b", [3] * 15, max_new=40)  # 15 prompt tokens + 1 sampled: one full block
    driver.step()
    req = driver.requests["b"]
    cached = CachedRequestData()
    cached.append("b", False, [], req.computed, None)  # no block for positions 16..
    step = SchedulerOutput(step_id=driver.step_id, scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"b": 1}, total_num_scheduled_tokens=1,
                           num_steps=3)
    with pytest.raises(StepError, match="cannot hold 18 tokens of 3 passes"):
        runner.execute(step)
    assert runner.requests["b"].num_computed_tokens == 15


def _sampled(runner, prompt, n, **sampling):
    """One request alone, one pass a step: the tokens to compare with. Seeded
    sampling: the tiny random model's greedy tokens repeat one id."""
    driver = StepDriver(runner)
    driver.add("g", prompt, max_new=n, params=SamplingParams(
        temperature=1.0, seed=11, ignore_eos=True, **sampling))
    driver.run_to_completion()
    driver.step({})
    return driver.requests["g"].output


def _first_new_at(tokens, at):
    """A stop token that greedy decoding meets first at index `at` (or later)."""
    return next(t for i, t in enumerate(tokens) if i >= at and t not in tokens[:i])


def test_a_request_that_stops_sits_out_the_rest_of_the_passes(runners):
    runner = runners[0]
    want_a, want_b = _sampled(runner, PROMPTS[0], 8), _sampled(runner, PROMPTS[1], 8)
    stop = _first_new_at(want_a, 2)
    at = want_a.index(stop)
    driver = StepDriver(runner)
    driver.add("a", PROMPTS[0], max_new=8, params=SamplingParams(
        temperature=1.0, seed=11, stop_token_ids=[stop], ignore_eos=True))
    driver.add("b", PROMPTS[1], max_new=8, params=SamplingParams(temperature=1.0, seed=11,
                                                                 ignore_eos=True))
    driver.step()  # prefill: one token each
    result = driver.step({"a": 1, "b": 1}, num_steps=7)
    got = dict(zip(result.req_ids, result.sampled_token_ids))
    assert got["a"] == want_a[1:at + 1] and got["a"][-1] == stop  # no pass after its stop
    assert got["b"] == want_b[1:8]  # the other request's tokens are unchanged
    assert result.timings.num_forward_passes == 7
    assert result.timings.num_tokens == at + 7
    assert runner.requests["a"].stopped and not runner.requests["b"].stopped
    driver.step({})
    assert not {"a", "b"} & set(runner.requests)


def test_a_multi_step_ends_when_every_request_in_it_stopped(runners):
    runner = runners[1]
    want = _sampled(runner, PROMPTS[2], 10)
    stop = _first_new_at(want, 3)
    at = want.index(stop)
    driver = StepDriver(runner)
    driver.add("s", PROMPTS[2], max_new=10, params=SamplingParams(
        temperature=1.0, seed=11, stop_token_ids=[stop], ignore_eos=True))
    driver.step()
    result = driver.step({"s": 1}, num_steps=9)
    assert result.sampled_token_ids == [want[1:at + 1]]
    assert result.timings.num_forward_passes == at  # not 9
    # A step the scheduler had already scheduled behind (async) skips the request
    # whose stop it had not seen: no tokens, no pass, no token added.
    state = runner.requests["s"]
    before = list(state.token_ids)
    from shared.types import CachedRequestData, SchedulerOutput
    req = driver.requests["s"]
    cached = CachedRequestData()
    cached.append("s", False, [], req.computed + 9, None)  # the scheduler's count
    behind = runner.execute(SchedulerOutput(
        step_id=driver.step_id, scheduled_cached_reqs=cached, num_scheduled_tokens={"s": 1},
        total_num_scheduled_tokens=1, num_steps=9))
    driver.step_id += 1
    assert behind.sampled_token_ids == [[]] and behind.timings.num_forward_passes == 0
    assert state.token_ids == before
    driver.step({})
    assert "s" not in runner.requests


@pytest.mark.parametrize("params, outputs_before, stops", [
    (SamplingParams(), 0, True),                        # EOS stops
    (SamplingParams(ignore_eos=True), 0, False),        # not with ignore_eos
    (SamplingParams(min_tokens=3), 1, False),           # nor as the 2nd of min 3
    (SamplingParams(min_tokens=3), 2, True),            # but as the 3rd
    (SamplingParams(stop_token_ids=[2], ignore_eos=True), 0, True),  # a stop id does
])
def test_the_workers_stop_rule_is_the_schedulers(params, outputs_before, stops):
    from scheduler_svc.core import Request, Scheduler
    from worker_svc.worker_request import WorkerRequest
    state = WorkerRequest("r", [5, 6] + [9] * outputs_before, 2, [], 0, params, 0, None)
    state.record_sampled(2, frozenset({2}))
    assert state.stopped is stops
    request = Request("r", [5, 6], params, [2])  # EOS 2, as the worker's
    for _ in range(outputs_before):
        request.append_output_token(9)
    # the scheduler takes a one-token answer [2] as a stop exactly when the worker does
    assert Scheduler._stopped_short(request, [2]) is stops
