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
