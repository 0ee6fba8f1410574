"""The worker's ModelRunner with the Triton backend (kernels under the interpreter)
produces exactly transformers' greedy tokens, through chunked prefill, mixed
prefill/decode steps and decodes that cross block boundaries."""

import pytest
import torch

from tests.worker.step_driver import StepDriver
from worker_svc.attention import triton_backend
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner


@pytest.fixture(scope="module")
def gqa_9_3_llama(tmp_path_factory):
    """Tiny random Llama with the default model's head layout (9 query, 3 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=144, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the default init: no near-ties
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("llama_9_3")
    model.save_pretrained(str(path))
    return path, model


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_triton_backend_greedy_tokens_equal_transformers(gqa_9_3_llama):
    path, hf = gqa_9_3_llama
    runner = ModelRunner(WorkerConfig(model=str(path), device="cpu", dtype="float32",
                                      block_size=4, num_gpu_blocks_override=64,
                                      max_num_seqs=4, max_model_len=64))
    runner.model.backend = triton_backend  # what select_backend picks on CUDA
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (11, 5, 1)]
    driver = StepDriver(runner)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, max_new=6)
    driver.step({"r0": 6, "r1": 5, "r2": 1})  # r0's first chunk; r1 and r2 whole
    driver.step({"r0": 5, "r1": 1, "r2": 1})  # r0's last chunk beside two decodes
    driver.run_to_completion()
    for i, p in enumerate(prompts):
        assert driver.requests[f"r{i}"].output == hf_greedy(hf, p, 6), f"request r{i}"


@pytest.mark.parametrize("variant", ["mistral_sliding_window", "gemma2"])
def test_triton_backend_applies_the_sliding_window_and_soft_cap_like_transformers(
        variant, tmp_path):
    """Prompts past the 24-token window, in chunks and beside decodes; Gemma 2's scores
    soft-capped in the kernels."""
    from tests.families.dense_checkpoints import reference, write
    from tests.integration.hf_reference import hf_greedy as hf_greedy_loop
    path = write(variant, tmp_path / variant)
    runner = ModelRunner(WorkerConfig(model=str(path), device="cpu", dtype="float32",
                                      block_size=4, num_gpu_blocks_override=64,
                                      max_num_seqs=4, max_model_len=64))
    runner.model.backend = triton_backend
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 27, 2)]
    driver = StepDriver(runner)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, max_new=6)
    driver.step({"r0": 17, "r1": 27, "r2": 2})  # r0's first chunk; r1 and r2 whole
    driver.step({"r0": 13, "r1": 1, "r2": 1})  # r0's last chunk beside two decodes
    driver.run_to_completion()
    hf = reference(path)
    for i, p in enumerate(prompts):
        assert driver.requests[f"r{i}"].output == hf_greedy_loop(hf, p, 6), f"request r{i}"
