"""Greedy tokens from the runner equal transformers' greedy tokens for each request
alone, however the requests are batched, chunked, preempted or placed in blocks."""

import torch

from shared.types import SamplingParams
from tests.worker.step_driver import StepDriver
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner


def _runner(path, num_blocks=128, max_model_len=256) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=max_model_len,
                                    num_gpu_blocks_override=num_blocks,
                                    max_num_seqs=8))


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_ragged_batch_of_8_mixing_chunks_and_decodes_matches_each_request_alone(
        tiny_llama_dir, hf_model_cache):
    lengths = [5, 40, 1, 23, 64, 9, 17, 33]
    prompts = _prompts(2, lengths)
    driver = StepDriver(_runner(tiny_llama_dir))
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, max_new=12)
    budget = 24  # decodes first, then prefill chunks from what is left: every step mixes
    saw_mixed_step = False
    while not all(r.done for r in driver.requests.values()):
        plan, left = {}, budget
        live = [r for r in driver.requests.values() if not r.done]
        for r in sorted(live, key=lambda r: r.computed < len(r.tokens) - 1):
            gap = len(r.tokens) - r.computed
            if left and gap:
                plan[r.req_id] = min(gap, left)
                left -= plan[r.req_id]
        saw_mixed_step |= len(set(plan.values()) | {1}) > 1 and 1 in plan.values()
        driver.step(plan)
    assert saw_mixed_step
    hf = hf_model_cache(tiny_llama_dir)
    for i, p in enumerate(prompts):
        assert driver.requests[f"r{i}"].output == _hf_greedy(hf, p, 12), f"request r{i}"


def test_reused_blocks_never_leak_stale_kv_into_a_new_request(tiny_qwen2_dir, hf_model_cache):
    first, second = _prompts(3, [75, 21])
    greedy_with_logprobs = SamplingParams(temperature=0.0, logprobs=3)
    driver = StepDriver(_runner(tiny_qwen2_dir, num_blocks=8, max_model_len=112))
    driver.add("first", first, max_new=10)
    driver.run_to_completion()
    blocks_of_first = set(driver.free)
    reused = driver.add("second", second, max_new=20, params=greedy_with_logprobs)
    logprobs = [driver.step().logprobs[0][0] for _ in range(20)]
    assert set(driver.requests["second"].blocks) <= blocks_of_first
    assert reused.output == _hf_greedy(hf_model_cache(tiny_qwen2_dir), second, 20)
    # even a leak too small to flip a token shows up against a never-used cache
    clean = StepDriver(_runner(tiny_qwen2_dir, num_blocks=8, max_model_len=112))
    clean.add("second", second, max_new=20, params=greedy_with_logprobs)
    clean_logprobs = [clean.step().logprobs[0][0] for _ in range(20)]
    for got, want in zip(logprobs, clean_logprobs):
        assert got.token_id == want.token_id
        assert abs(got.logprob - want.logprob) < 1e-5
        for (got_id, got_lp), (want_id, want_lp) in zip(got.top, want.top):
            assert got_id == want_id and abs(got_lp - want_lp) < 1e-5


def test_preempted_request_resumes_with_new_blocks_and_same_tokens(tiny_llama_dir,
                                                                   hf_model_cache):
    prompt, other = _prompts(4, [30, 12])
    driver = StepDriver(_runner(tiny_llama_dir))
    driver.add("victim", prompt, max_new=16)
    driver.add("other", other, max_new=16)
    for _ in range(6):
        driver.step()
    driver.preempt("victim")
    driver.step({"other": 1})
    victim = driver.requests["victim"]
    driver.step({"victim": 20})  # recompute in two chunks: prompt + its output so far
    driver.step({"victim": len(victim.tokens) - victim.computed, "other": 1})
    driver.run_to_completion()
    hf = hf_model_cache(tiny_llama_dir)
    assert victim.output == _hf_greedy(hf, prompt, 16)
    assert driver.requests["other"].output == _hf_greedy(hf, other, 16)


def test_prefix_cache_hit_reads_the_shared_blocks_and_computes_only_the_rest(
        tiny_llama_dir, hf_model_cache):
    from shared.types import NewRequestData, SchedulerOutput
    shared_prefix, tail_a, tail_b = _prompts(5, [32, 5, 9])
    runner = _runner(tiny_llama_dir)
    greedy = SamplingParams(temperature=0.0)

    def new_step(step_id, req_id, prompt, blocks, computed):
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=[NewRequestData(req_id, prompt, greedy, blocks, computed)],
            num_scheduled_tokens={req_id: len(prompt) - computed},
            total_num_scheduled_tokens=len(prompt) - computed)

    runner.execute(new_step(0, "a", shared_prefix + tail_a, [3, 4, 5], 0))
    # b shares a's two full blocks (32 tokens of KV) and computes only its own tail
    out = runner.execute(new_step(1, "b", shared_prefix + tail_b, [3, 4, 6], 32))
    want = _hf_greedy(hf_model_cache(tiny_llama_dir), shared_prefix + tail_b, 1)
    assert out.sampled_token_ids == [want]
