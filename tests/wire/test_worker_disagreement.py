"""A worker whose answer disagrees with the scheduler (a stop decided otherwise, a
token too many) is a worker fault, not the end of the engine: the answer is refused
before anything changes, logged and counted, the worker drops its state, and every
request is recomputed from the scheduler's tokens, so the output is still
transformers' (tiny random-weight model, the real Step stream on loopback)."""

from __future__ import annotations

import queue

import pytest
import torch
from prometheus_client import REGISTRY

from scheduler_svc.engine_errors import WorkerDisagreement, WorkerLost
from scheduler_svc.worker_group import WorkerGroup
from shared.proto import worker_pb2
from tests.wire.conftest import start_wire_stack
from tests.wire.session_client import wait_for
from tests.wire.test_async_steps import LENGTH, PROMPTS, pool_is_fully_free, run_all
from tests.wire.test_engine_service import hf_greedy


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def disagreements(model_name: str) -> float:
    return REGISTRY.get_sample_value("gapserve:worker_disagreements_total",
                                     {"model_name": model_name}) or 0.0


def corrupt_one_answer(runner, how: str, after_samples: int = 3):
    """From inside the worker: the answer to the step in which requests have sampled
    `after_samples` tokens in all gets one request's tokens changed; the worker's own
    state keeps what it really sampled, so the two sides now differ."""
    execute = runner.execute
    seen = {"tokens": 0, "done": False}

    def corrupted(step, *args, **kwargs):
        out = execute(step, *args, **kwargs)
        if not seen["done"]:
            for k, sampled in enumerate(out.sampled_token_ids):
                seen["tokens"] += len(sampled)
                if sampled and seen["tokens"] >= after_samples:
                    # "extra": a pass the step did not run; "stop": a stop the rule denies
                    out.sampled_token_ids[k] = sampled + sampled[-1:] if how == "extra" else []
                    seen["done"] = True
                    break
        return out

    runner.execute = corrupted
    return seen


@pytest.mark.parametrize("async_scheduling, how", [(False, "extra"), (True, "stop")])
def test_a_disagreeing_answer_is_recomputed_and_the_engine_keeps_serving(
        tiny_runner, hf_model, async_scheduling, how):
    stack = start_wire_stack(tiny_runner, async_scheduling=async_scheduling)
    model = stack.engine.model_info.model_name
    before = disagreements(model)
    seen = corrupt_one_answer(tiny_runner, how)
    try:
        client, ids = run_all(stack, PROMPTS, max_tokens=10, ignore_eos=True)
        assert seen["done"]
        assert stack.engine.failed is None
        assert stack.engine.num_worker_disagreements == 1
        assert disagreements(model) == before + 1
        assert stack.engine.num_worker_reconnects >= 1  # the resilience path ran
        for req_id, prompt in zip(ids, PROMPTS):
            assert client.finished[req_id].finish_reason == LENGTH
            assert client.tokens[req_id] == hf_greedy(hf_model, prompt, 10), prompt
        wait_for(lambda: pool_is_fully_free(stack), what="all blocks free")
        # and it goes on serving new requests
        more, (extra,) = run_all(stack, PROMPTS[:1], max_tokens=4, ignore_eos=True)
        assert more.tokens[extra] == hf_greedy(hf_model, PROMPTS[0], 4)
        client.close()
        more.close()
    finally:
        del tiny_runner.execute
        stack.close()


def test_ranks_that_answer_different_steps_are_a_disagreement_not_an_engine_failure():
    group = WorkerGroup(["127.0.0.1:1", "127.0.0.1:2"])  # two ranks; never connected
    group._answers = [queue.SimpleQueue(), queue.SimpleQueue()]
    group._answers[0].put(worker_pb2.ModelRunnerOutput(step_id=4))
    group._answers[1].put(worker_pb2.ModelRunnerOutput(step_id=5))
    with pytest.raises(WorkerDisagreement, match=r"different steps: \[4, 5\]") as caught:
        group.collect()
    assert isinstance(caught.value, WorkerLost)  # so the engine recovers by recompute
