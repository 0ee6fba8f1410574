"""A request resent whole to a fresh worker after the old one was lost (its
NewRequestData carries output_token_ids) continues exactly as if nothing had
happened: the same greedy tokens, with penalties counting the earlier output."""

import pytest

from shared.types import SamplingParams
from tests.worker.step_driver import StepDriver
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 31], [11, 12, 13], list(range(40, 77))]


def _runner(path) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=8))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5,
                   repetition_penalty=1.3)], ids=["greedy", "greedy-with-penalties"])
def test_a_resent_request_continues_with_the_tokens_of_an_uninterrupted_run(
        tiny_llama_dir, params):
    whole = StepDriver(_runner(tiny_llama_dir))
    for i, p in enumerate(PROMPTS):
        whole.add(f"r{i}", p, max_new=16, params=params)
    whole.run_to_completion()

    fresh = StepDriver(_runner(tiny_llama_dir))  # the replacement worker: holds nothing
    for i, p in enumerate(PROMPTS):
        req = fresh.add(f"r{i}", p, max_new=16, params=params)
        req.output = list(whole.requests[f"r{i}"].output[:5 + i])  # generated before the loss
    fresh.run_to_completion()
    for i in range(len(PROMPTS)):
        assert fresh.requests[f"r{i}"].output == whole.requests[f"r{i}"].output
