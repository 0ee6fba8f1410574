"""Seeded sampling survives what the worker can be put through: a seeded request
(temperature 0.8, frequency and presence penalties) samples the same tokens alone
or in a batch, preempted and recomputed, resent whole to a fresh worker after a
loss (output_token_ids), or continued after a scheduler loss with its output
folded into the prompt (num_output_prefix_tokens): the draw is a function of
(seed, output position), and the penalties count the earlier output as output."""

import dataclasses

import pytest

from shared.types import SamplingParams
from tests.worker.step_driver import StepDriver, tiny_cpu_runner

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 31], [11, 12, 13], list(range(40, 77))]
MAX_NEW = 20


def _params(i: int, seed_base: int = 100) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed_base + i, frequency_penalty=0.6,
                          presence_penalty=0.4, max_tokens=MAX_NEW)


def _fresh(model_dir) -> StepDriver:
    """A driver on a new runner, which holds no request (as a replaced worker)."""
    return StepDriver(tiny_cpu_runner(model_dir))


@pytest.fixture(scope="module")
def whole(tiny_llama_dir) -> list[list[int]]:
    driver = _fresh(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        driver.add(f"r{i}", p, max_new=MAX_NEW, params=_params(i))
    driver.run_to_completion()
    return [driver.requests[f"r{i}"].output for i in range(len(PROMPTS))]


def test_a_seeded_request_samples_the_same_alone_as_in_a_batch(tiny_llama_dir, whole):
    for i, p in enumerate(PROMPTS):
        driver = _fresh(tiny_llama_dir)
        driver.add("alone", p, max_new=MAX_NEW, params=_params(i))
        driver.run_to_completion()
        assert driver.requests["alone"].output == whole[i]


def test_other_seeds_sample_other_tokens(tiny_llama_dir, whole):
    driver = _fresh(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        driver.add(f"r{i}", p, max_new=MAX_NEW, params=_params(i, seed_base=200))
    driver.run_to_completion()
    assert all(driver.requests[f"r{i}"].output != whole[i] for i in range(len(PROMPTS)))


def test_a_preempted_seeded_request_continues_its_draws(tiny_llama_dir, whole):
    driver = _fresh(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        driver.add(f"r{i}", p, max_new=MAX_NEW, params=_params(i))
    for _ in range(6):
        driver.step()
    driver.preempt("r1")  # recomputed from its tokens; the worker keeps them
    driver.run_to_completion()
    assert [driver.requests[f"r{i}"].output for i in range(len(PROMPTS))] == whole


def test_a_seeded_request_resent_after_a_worker_loss_continues_its_draws(tiny_llama_dir, whole):
    driver = _fresh(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        req = driver.add(f"r{i}", p, max_new=MAX_NEW, params=_params(i))
        req.output = list(whole[i][:5 + 3 * i])  # generated before the loss
    driver.run_to_completion()
    assert [driver.requests[f"r{i}"].output for i in range(len(PROMPTS))] == whole


def test_a_seeded_continuation_after_a_scheduler_loss_continues_its_draws(tiny_llama_dir, whole):
    driver = _fresh(tiny_llama_dir)
    done = [4, 9, 13]
    for i, p in enumerate(PROMPTS):  # as frontend_svc/engine/continuation.py builds it
        params = dataclasses.replace(_params(i), max_tokens=MAX_NEW - done[i],
                                     num_output_prefix_tokens=done[i])
        driver.add(f"r{i}", p + whole[i][:done[i]], max_new=MAX_NEW - done[i], params=params)
    driver.run_to_completion()
    for i in range(len(PROMPTS)):
        assert driver.requests[f"r{i}"].output == whole[i][done[i]:]


def test_without_the_output_split_a_continuation_samples_other_tokens(tiny_llama_dir, whole):
    """The rule the test above proves is not vacuous: the split is what carries it."""
    driver = _fresh(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        driver.add(f"r{i}", p + whole[i][:9], max_new=MAX_NEW - 9,
                   params=dataclasses.replace(_params(i), max_tokens=MAX_NEW - 9))
    driver.run_to_completion()
    assert any(driver.requests[f"r{i}"].output != whole[i][9:] for i in range(len(PROMPTS)))
