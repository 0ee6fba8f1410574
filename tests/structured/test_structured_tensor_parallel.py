"""Structured outputs under tensor parallelism (two real worker ranks, gloo, the tiny
model): rank 0 alone compiles and masks, rank 1 follows on the tokens rank 0
broadcasts; constrained greedy output equals one rank's, across a preemption and a
multi-step decode; an announced grammar is reported ready by rank 0."""

from __future__ import annotations

import json

import pytest

from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams, SchedulerOutput
from tests.integration.tp_group import RankGroupClient
from tests.integration.test_tensor_parallel import SMALL_POOL, _addresses, _ranks
from tests.worker.step_driver import StepDriver, tiny_cpu_runner

SPECS = [Spec("json", json.dumps({"type": "array", "minItems": 4, "maxItems": 6,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 99}}),
              disable_any_whitespace=True),
         Spec("regex", r"[a-z]{3,6}(-[a-z]{3,6}){2}")]
PROMPTS = [[1, 504, 3209, 28, 253, 4821, 99], [7, 8, 9, 10, 11]]


def run(runner) -> dict[str, list[int]]:
    driver = StepDriver(runner)
    for i, (prompt, spec) in enumerate(zip(PROMPTS, SPECS)):
        driver.add(f"r{i}", prompt, 60, SamplingParams(temperature=0.0, max_tokens=60,
                                                      structured_output=spec))
    for _ in range(3):
        driver.step()
    driver.preempt("r0")
    driver.step()  # r0 recomputes from the tokens rank 0 sampled
    driver.step({"r0": 1, "r1": 1}, num_steps=2)  # every pass masked on rank 0
    driver.run_to_completion()
    driver.step({})
    return {r: q.output for r, q in driver.requests.items()}


def test_rank_0_masks_and_the_group_gives_one_ranks_constrained_output(tiny_model_dir,
                                                                       tmp_path):
    whole = run(tiny_cpu_runner(tiny_model_dir))
    assert all(out[-1] == 2 for out in whole.values())  # each grammar ended it
    stack = _ranks(tiny_model_dir, tmp_path, flags=SMALL_POOL)
    try:
        group = RankGroupClient(_addresses(stack))
        assert run(group) == whole
        step = SchedulerOutput(step_id=10_000, grammar_compiles={"late": SPECS[1]})
        answer = group.execute(step)  # rank 0's answer; the cache has it: ready at once
        assert answer.grammars_ready == ["late"] and not answer.grammar_errors
        group.close()
    finally:
        stack.stop()


@pytest.mark.parametrize("spec", [
    '{"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}',
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'],
    ids=["int8_self_draft", "ngram"])
def test_drafts_under_a_grammar_on_two_ranks_give_one_ranks_constrained_output(
        tiny_model_dir, tmp_path, spec):
    """Speculative decoding with grammars on two ranks: rank 0 drafts under the masks
    (the self-draft) or cuts each request's drafts to what its grammar allows (prompt
    lookup) and sends the lengths, so both ranks verify the same positions; the
    output is one unsplit rank's without drafts (docs/spec_decode.md)."""
    from tests.spec.engine_loop import run as serve
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_output=s)
              for s in SPECS]
    whole, _, _ = serve(tiny_cpu_runner(tiny_model_dir), PROMPTS, params)
    stack = _ranks(tiny_model_dir, tmp_path, flags=[*SMALL_POOL, "--speculative-config", spec])
    try:
        group = RankGroupClient(_addresses(stack))
        got, _, sched = serve(group, PROMPTS, params)
        group.close()
    finally:
        stack.stop()
    assert got == whole
    assert sched.stats().spec_num_draft_tokens > 0
