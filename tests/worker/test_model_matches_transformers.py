"""Our paged-KV decoder computes the same logits as transformers' own forward, in
one shot and when the prompt is prefilled in chunks across steps."""

import pytest
import torch

from shared.types import SamplingParams
from worker_svc.config import WorkerConfig
from worker_svc.inputs import prepare_inputs
from worker_svc.model.cpu import fused_ops
from worker_svc.worker_request import WorkerRequest
from worker_svc.runner import ModelRunner

CHECKPOINTS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_rope_dir",
               "tiny_mistral_sharded_dir"]


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=8, **kw))


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _chunk_logits(runner, state: WorkerRequest, n: int) -> torch.Tensor:
    """Logits of every position of the next n tokens of `state` (one step)."""
    inputs = prepare_inputs([state], [n], runner.block_size, runner.device, runner.last_sampled)
    logits = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                  inputs.meta, torch.arange(n))
    state.num_computed_tokens += n
    return logits


def _state(prompt: list[int]) -> WorkerRequest:
    return WorkerRequest(req_id="r", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                        block_ids=[5, 9, 2, 7, 11, 3], num_computed_tokens=0,
                        params=SamplingParams(temperature=0.0), row=0)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(params=["fused_c_ops", "torch_ops"])
def layer_ops(request):
    """fp32 on CPU runs the C element-wise ops; the torch ops serve every other
    dtype and device. Both must match the reference."""
    if request.param == "fused_c_ops" and fused_ops.load() is None:
        pytest.skip("no C compiler here: the torch ops serve fp32 too")
    return request.param


def _layer_ops_runner(path, layer_ops) -> ModelRunner:
    return _runner(path, cpu_fused_ops=layer_ops == "fused_c_ops")


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_full_prompt_logits_match_transformers(checkpoint, request, hf_model_cache, layer_ops):
    path = request.getfixturevalue(checkpoint)
    prompt = _prompt(0, 83)
    runner = _layer_ops_runner(path, layer_ops)
    assert (runner.model.fused is not None) == (layer_ops == "fused_c_ops")
    got = _chunk_logits(runner, _state(prompt), len(prompt))
    with torch.no_grad():
        want = hf_model_cache(path)(torch.tensor([prompt])).logits[0]
    assert _relative_error(got, want) < 1e-4


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_prompt_prefilled_in_chunks_gives_one_shot_logits(checkpoint, request, layer_ops):
    path = request.getfixturevalue(checkpoint)
    prompt = _prompt(1, 70)
    one_shot = _chunk_logits(_layer_ops_runner(path, layer_ops), _state(prompt), len(prompt))
    runner, state = _layer_ops_runner(path, layer_ops), _state(prompt)
    chunks = [_chunk_logits(runner, state, n) for n in (7, 16, 30, 1, 16)]
    assert _relative_error(torch.cat(chunks), one_shot) < 1e-5


def test_steps_above_the_c_ops_token_limit_take_torch_ops_and_agree(tiny_llama_dir, monkeypatch):
    """A long prefill chunk runs the torch ops, the decode-sized ones the C ops: a
    request whose steps mix both still gets its one-shot logits."""
    if fused_ops.load() is None:
        pytest.skip("no C compiler here: every step takes the torch ops")
    prompt = _prompt(2, 70)
    one_shot = _chunk_logits(_runner(tiny_llama_dir), _state(prompt), len(prompt))
    monkeypatch.setattr(fused_ops, "MAX_TOKENS", 16)
    runner, state = _runner(tiny_llama_dir), _state(prompt)
    calls = []
    fused = runner.model._forward_fused
    monkeypatch.setattr(runner.model, "_forward_fused", lambda *a: calls.append(1) or fused(*a))
    chunks = [_chunk_logits(runner, state, n) for n in (40, 16, 1, 13)]
    assert len(calls) == 3  # the 40-token chunk took the torch ops
    assert _relative_error(torch.cat(chunks), one_shot) < 1e-5
