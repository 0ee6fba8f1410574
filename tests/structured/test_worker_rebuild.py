"""Rank 0's matcher follows the committed tokens whatever happens to the request
(the tiny random-weight model, whose unconstrained output would match nothing):
every output matches its grammar and ends on EOS; and the same tokens come out when
the request is preempted and recomputed, resent whole to a fresh worker (a worker
loss: the matcher is rebuilt by replaying the output), continued with its output
folded into the prompt (a scheduler loss: num_output_prefix_tokens), or decoded
multi-step (the mask is applied on every pass). Masking composes with seeded
sampling, penalties, logit_bias and top-k/top-p; logprobs are of the masked
distribution, as vLLM's."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jsonschema
import pytest
import tokenizers

from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.worker.step_driver import StepDriver, tiny_cpu_runner

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}}
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
LARK = 'start: "(" NUM ("," NUM){2,5} ")"\nNUM: /[0-9]{1,3}/'
SPECS = [Spec("json", json.dumps(SCHEMA), disable_any_whitespace=True), Spec("regex", REGEX),
         Spec("grammar", LARK), Spec("json", json.dumps(SCHEMA))]
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 31], [11, 12, 13], list(range(40, 77)), [9, 8, 7, 6]]
MAX_NEW = 60
EOS = 2


def params_of(i: int, sampled: bool) -> SamplingParams:
    if not sampled:
        return SamplingParams(temperature=0.0, structured_output=SPECS[i], max_tokens=MAX_NEW)
    return SamplingParams(temperature=0.9, seed=100 + i, top_k=50, top_p=0.95,
                          frequency_penalty=0.4, repetition_penalty=1.1,
                          logit_bias={90: 5.0}, structured_output=SPECS[i],
                          max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return tiny_cpu_runner(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def run(runner, sampled: bool, *, prefix: dict[int, list[int]] | None = None,
        resend: dict[int, list[int]] | None = None, preempt_at: int | None = None,
        num_steps: int = 1) -> dict[int, list[int]]:
    """Every spec's request to completion; the output after `prefix`/`resend` tokens."""
    driver = StepDriver(runner)
    for i, prompt in enumerate(PROMPTS):
        params = params_of(i, sampled)
        done = (prefix or {}).get(i, [])
        if done:  # a continuation: earlier output folded into the prompt
            params = dataclasses.replace(params, max_tokens=MAX_NEW - len(done),
                                         num_output_prefix_tokens=len(done))
        req = driver.add(f"r{i}", prompt + done, max_new=params.max_tokens, params=params)
        req.output = list((resend or {}).get(i, []))
    steps = 0
    while not all(q.done for q in driver.requests.values()):
        live = {r: q for r, q in driver.requests.items() if not q.done}
        decodes = all(len(q.tokens) - q.computed == 1 for q in live.values())
        if num_steps > 1 and decodes:
            n = min(num_steps, *(q.max_new - len(q.output) for q in live.values()))
            driver.step({r: 1 for r in live}, num_steps=n)
        else:
            driver.step()
        steps += 1
        if steps == preempt_at:
            for r, q in driver.requests.items():
                if not q.done:
                    driver.preempt(r)
    driver.step({})  # the finished ones are dropped by the runner
    assert not runner.requests
    return {i: driver.requests[f"r{i}"].output for i in range(len(PROMPTS))}


def assert_matches(outputs, tokenizer):
    for i, out in outputs.items():
        assert out[-1] == EOS, (i, out)  # the grammar ended it; max_tokens never did
        text = tokenizer.decode(out[:-1])
        kind = SPECS[i].kind
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){2,5}\)", text), text


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_the_output_matches_and_survives_preemption_worker_and_scheduler_loss(
        runner, tokenizer, sampled):
    whole = run(runner, sampled)
    assert_matches(whole, tokenizer)
    assert run(runner, sampled, preempt_at=4) == whole
    cut = {i: out[:3 + i] for i, out in whole.items()}
    resent = run(runner, sampled, resend=cut)
    assert resent == whole  # the rebuilt matcher replayed the output it was handed
    continued = run(runner, sampled, prefix=cut)
    assert {i: cut[i] + out for i, out in continued.items()} == whole


def test_multi_step_decode_masks_every_pass(runner):
    assert run(runner, False, num_steps=4) == run(runner, False)


def test_whitespace_is_bounded_so_the_small_model_finishes(runner, tokenizer):
    # SPECS[3] allows whitespace (bounded: one newline and 12 blanks a gap)
    text = tokenizer.decode(run(runner, False)[3][:-1])
    assert re.search(r"\n\s*\n", text) is None and re.search(r"[ \t]{13}", text) is None


def test_logprobs_are_of_the_masked_distribution(runner, tokenizer):
    driver = StepDriver(runner)
    params = SamplingParams(temperature=0.0, logprobs=20,
                            structured_output=Spec("choice", '["yes", "no"]'))
    driver.add("c", [5, 6, 7], max_new=8, params=params)
    result = driver.step()
    (lp,) = result.logprobs[0]
    finite = [(t, v) for t, v in lp.top if math.isfinite(v)]
    assert 0 < len(finite) < 20  # the grammar allows a handful of first tokens
    for t, _ in finite:
        assert "yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t]))
    assert math.isclose(sum(math.exp(v) for _, v in finite), 1.0, rel_tol=1e-4)
    assert lp.rank == 1 and lp.token_id == finite[0][0]
    driver.run_to_completion()
    assert tokenizer.decode(driver.requests["c"].output[:-1]) in ("yes", "no")
    driver.step({})
