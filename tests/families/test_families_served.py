"""Each new family through real processes: two tensor-parallel worker ranks (heads,
MLP rows and whole experts split; the uneven 5-expert variant holds 3 and 2) driven
over their gRPC Step streams, and the whole stack (frontend, scheduler, worker)
through its gRPC Generation API and the `openai` client; greedy tokens equal
transformers' float32 ones."""

from __future__ import annotations

import pytest

from shared.proto import common_pb2, generate_pb2
from shared.types import SamplingParams
from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_tensor_parallel import _addresses, _ranks
from tests.integration.tp_group import RankGroupClient
from tests.spec.conftest import NGRAM
from tests.spec.engine_loop import run
from tests.worker.step_driver import StepDriver

PROMPTS = [[1, 504, 3209, 28, 253, 4821, 99], [7, 8, 9, 10, 11],
           [1, 2000, 30, 4000, 500, 60, 7000, 80, 9000, 10, 11000, 12]]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe_unnormalized_sparse_step", "mixtral"])
def test_two_ranks_are_greedy_equal_to_transformers_through_a_preemption(
        served_family_dir, hf_model_cache, tmp_path, name):
    path = served_family_dir(name)
    stack = _ranks(path, tmp_path)
    try:
        group = RankGroupClient(_addresses(stack))
        assert all(f"family={name.split('_unnormalized')[0]}" in
                   i.model_info.compute_plan.split() for i in group.infos)
        driver = StepDriver(group)
        reqs = [driver.add(f"r{i}", p, 16) for i, p in enumerate(PROMPTS)]
        for _ in range(4):
            driver.step()
        driver.preempt("r0")  # recomputed from the tokens rank 0 sampled
        driver.run_to_completion()
        group.close()
    finally:
        stack.stop()
    hf = hf_model_cache(path)
    for req, prompt in zip(reqs, PROMPTS):
        assert req.output == hf_greedy(hf, prompt, 16), req.req_id


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_the_stack_serves_the_family_greedy_equal_to_transformers(
        served_family_dir, hf_model_cache, tmp_path, name):
    from transformers import AutoTokenizer
    path = served_family_dir(name)
    stack = start_stack(path, tmp_path, flags=TINY_FLAGS)
    try:
        stub = stack.generation_stub()
        replies = list(stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=PROMPTS[0]),
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True)), timeout=120))
        tokens = [t for r in replies for t in r.token_ids]
        text = stack.openai(timeout=120.0).completions.create(
            model=stack.served_model_name, prompt="The capital of France is",
            max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
        status = stack.engine_status()
    finally:
        stack.stop()
    hf = hf_model_cache(path)
    assert tokens == hf_greedy(hf, PROMPTS[0], 12)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("The capital of France is")["input_ids"]
    assert text.choices[0].text == tok.decode(hf_greedy(hf, ids, 10))
    assert status.num_kv_blocks > 0


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe_unnormalized_sparse_step", "mixtral",
                                  "qwen2_yarn"])
def test_two_ranks_with_ngram_drafts_chunks_and_preemption_are_greedy_equal(
        family_dir, hf_model_cache, tmp_path, name):
    """The ranks driven by the real scheduler core (tests/spec/engine_loop.py): n-gram
    drafts verified on both ranks, 16-token chunks, a pool that preempts."""
    path = family_dir(name)
    prompts = [[5, 17, 99, 200, 3] * 6, [7, 8, 9, 10, 11] * 4, [42, 43] * 2,
               [250, 1, 77, 90, 120, 33, 64, 18, 200, 3, 9, 140]]
    pool = ["--max-model-len", "256", "--num-gpu-blocks-override", "64", "--max-num-seqs", "4"]
    stack = _ranks(path, tmp_path, flags=[*pool, "--speculative-config", NGRAM % 3])
    try:
        group = RankGroupClient(_addresses(stack))
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
                  for _ in prompts]
        got, _, sched = run(group, prompts, params, num_blocks=8, max_model_len=96,
                            max_num_batched_tokens=16, long_prefill_token_threshold=8)
        group.close()
    finally:
        stack.stop()
    hf = hf_model_cache(path)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, 24), (name, i)
    st = sched.stats()
    assert st.num_preemptions_total > 0 and st.spec_num_draft_tokens > 0
