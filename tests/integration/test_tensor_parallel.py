"""Tensor parallelism with real processes: two worker ranks (one thread each, gloo)
joined in one torch.distributed group, driven over their gRPC Step streams or
started by `gapserve serve --tensor-parallel-size 2`."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import torch

from shared.proto import common_pb2, generate_pb2
from shared.types import SamplingParams
from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.ports import free_ports
from tests.integration.hf_reference import hf_greedy
from tests.integration.tp_group import RankGroupClient
from tests.worker.step_driver import StepDriver

CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain in one sentence what a prime number is.",
                "List three uses of copper."]
SMALL_POOL = ["--max-model-len", "512", "--num-gpu-blocks-override", "64",
              "--max-num-seqs", "4"]


def _ranks(model_dir, log_dir, *, size: int = 2, master_port: int | None = None,
           flags=SMALL_POOL):
    """The worker ranks alone, started exactly as `gapserve serve` starts them."""
    master_port = master_port or free_ports(1)[0]
    return start_stack(model_dir, log_dir, services=("worker",),
                       flags=["--tensor-parallel-size", str(size),
                              "--master-port", str(master_port), *flags])


def _addresses(stack, size: int = 2) -> list[str]:
    return [f"127.0.0.1:{stack.worker_port + r}" for r in range(size)]


def _wait_exit(process, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a process state with a deadline, not a sync sleep
    return process.poll()


@pytest.mark.e2e
def test_tp2_on_cpu_is_greedy_equal_to_tp1_on_the_default_model(tmp_path):
    """4 chat prompts x 64 tokens: the two ranks' partial sums (o_proj, down) and the
    gathered vocab halves pick the same token as the unsplit model at every step."""
    from transformers import AutoTokenizer

    from shared.model_files.default_model import ensure_default_model
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                       add_generation_prompt=True, return_dict=True)
               ["input_ids"] for p in CHAT_PROMPTS]

    def run(runner) -> list[list[int]]:
        driver = StepDriver(runner)
        for i, p in enumerate(prompts):
            driver.add(f"r{i}", p, 64, SamplingParams(temperature=0.0))
        driver.run_to_completion()
        return [driver.requests[f"r{i}"].output for i in range(len(prompts))]

    torch.set_num_threads(1)
    whole = run(ModelRunner(WorkerConfig(model=str(model_dir), device="cpu",
                                         max_model_len=512, num_gpu_blocks_override=64,
                                         max_num_seqs=4)))
    stack = _ranks(model_dir, tmp_path)
    try:
        group = RankGroupClient(_addresses(stack))
        split = run(group)
        group.close()
    finally:
        stack.stop()
    for i, (a, b) in enumerate(zip(whole, split)):
        assert b == a, f"prompt {i} diverges at token " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_ranks_form_one_group_and_a_preempted_request_resumes_greedy_equal(
        tiny_model_dir, tmp_path, hf_tiny):
    """Both ranks answer the Handshake as one group with one KV pool; a request
    recomputed after preemption re-prefills from the tokens rank 0 sampled, which
    rank 1 only knows from rank 0's broadcast; so does each pass of a multi-step
    decode."""
    stack = _ranks(tiny_model_dir, tmp_path)
    try:
        group = RankGroupClient(_addresses(stack))
        assert [(i.rank, i.tensor_parallel_size) for i in group.infos] == [(0, 2), (1, 2)]
        assert len({i.model_info.num_kv_blocks for i in group.infos}) == 1
        # both ranks run on this host: they split its cores (the compute plan)
        assert all("ranks_on_host=2" in i.model_info.compute_plan.split() for i in group.infos)
        driver = StepDriver(group)
        prompt, other = [1, 504, 3209, 28, 253, 4821, 99], [7, 8, 9, 10, 11]
        victim = driver.add("victim", prompt, 12)
        other_ref = hf_greedy(hf_tiny, other, 12)
        stop = other_ref[8]  # sampled in the multi-step below, by every rank alike
        assert stop not in other_ref[:8]
        driver.add("other", other, 12, SamplingParams(temperature=0.0, stop_token_ids=[stop]))
        for _ in range(5):
            driver.step()
        driver.preempt("victim")
        driver.step({"other": 1})
        driver.step()  # the victim recomputes; the other decodes
        # a multi-step decode: each rank runs the 3 passes, rank 1 fed rank 0's tokens;
        # "other" stops at its stop token in the 2nd pass and sits out the 3rd on both
        result = driver.step({"victim": 1, "other": 1}, num_steps=3)
        assert [len(t) for t in result.sampled_token_ids] == [3, 2]
        driver.run_to_completion()
        assert victim.output == hf_greedy(hf_tiny, prompt, 12)
        assert driver.requests["other"].output == other_ref[:9]
        group.close()
    finally:
        stack.stop()


def test_a_dead_rank_makes_the_survivor_fail_loudly_and_a_restarted_group_serves(
        tiny_model_dir, tmp_path, hf_tiny):
    """SIGKILL rank 1: rank 0 notices (a failed collective or a missing heartbeat,
    within --distributed-timeout), ends its Step stream and exits with code 3, as a
    lost worker; two fresh ranks on the same rendezvous port form a new group."""
    master = free_ports(1)[0]
    flags = [*SMALL_POOL, "--distributed-timeout", "5"]
    stack = _ranks(tiny_model_dir, tmp_path / "first", master_port=master, flags=flags)
    try:
        group = RankGroupClient(_addresses(stack))
        driver = StepDriver(group)
        driver.add("a", [1, 2, 3], 4)
        driver.step()
        stack.process("worker-1").send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as lost:  # rank 0's answer to the next step
            driver.step()
        assert lost.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
        assert _wait_exit(stack.process("worker-0"), 30.0) == 3, stack.logs()
        assert "tp_group_lost" in stack.logs(20000)
        group.close()
    finally:
        stack.stop()
    again = _ranks(tiny_model_dir, tmp_path / "again", master_port=master, flags=flags)
    try:
        group = RankGroupClient(_addresses(again))
        driver = StepDriver(group)
        driver.add("b", [1, 504, 3209, 28], 6)
        driver.run_to_completion()
        assert driver.requests["b"].output == hf_greedy(hf_tiny, [1, 504, 3209, 28], 6)
        group.close()
    finally:
        again.stop()


def test_an_idle_group_notices_a_dead_rank_by_its_missing_heartbeat(tiny_model_dir,
                                                                    tmp_path):
    stack = _ranks(tiny_model_dir, tmp_path, flags=[*SMALL_POOL, "--distributed-timeout", "3"])
    try:
        stack.process("worker-1").send_signal(signal.SIGKILL)
        assert _wait_exit(stack.process("worker-0"), 30.0) == 3, stack.logs()
        assert "sent no heartbeat" in stack.logs(20000)
    finally:
        stack.stop()


def test_gapserve_serve_with_two_ranks_answers_greedy_like_transformers(tiny_model_dir,
                                                                        tmp_path, hf_tiny):
    stack = start_stack(tiny_model_dir, tmp_path,
                        flags=[*TINY_FLAGS, "--tensor-parallel-size", "2"])
    try:
        prompt = [1, 504, 3209, 28, 253, 4821, 99]
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True))
        replies = list(stack.generation_stub().Generate(request, timeout=60))
        assert [t for r in replies for t in r.token_ids] == hf_greedy(hf_tiny, prompt, 12)
        text = stack.openai().completions.create(model=stack.served_model_name,
                                                 prompt="Once upon a time", max_tokens=5,
                                                 temperature=0.0)
        assert text.choices[0].text
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 3}',
    '{"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 4}',
    '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3}'],
    ids=["ngram", "int8_self_draft", "draft_model"])
def test_speculative_decoding_on_two_ranks_is_greedy_equal_to_transformers(tmp_path, spec):
    """Both ranks find the same drafts (prompt lookup in the same tokens; the self-draft's
    passes run split like the model, rank 0 picking and broadcasting each token; a draft
    checkpoint runs on rank 0, which broadcasts its drafts), verify them in one pass and
    commit what rank 0 sampled; async scheduling with a small pool (preemption), through
    the real scheduler core. The 256-token checkpoint of tests/spec repeats itself, so
    drafts are accepted; the draft checkpoint is its first layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.spec.engine_loop import run
    from tests.worker.conftest import _write_checkpoint
    model_dir = _write_checkpoint(tmp_path / "tiny256", LlamaConfig, LlamaForCausalLM,
                                  tie_word_embeddings=True, rope_theta=10000.0)
    if "DRAFT" in spec:
        draft = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        draft.model.layers = draft.model.layers[:1]
        draft.config.num_hidden_layers = 1
        draft.save_pretrained(tmp_path / "draft")
        spec = spec.replace("DRAFT", str(tmp_path / "draft"))
    stack = _ranks(model_dir, tmp_path / "logs",
                   flags=[*SMALL_POOL, "--speculative-config", spec])
    try:
        group = RankGroupClient(_addresses(stack))
        assert all(i.model_info.speculative_config for i in group.infos)
        prompts = [[1, 50, 32, 28, 253, 48, 99], [7, 8, 9, 10, 11] * 4, [42] * 3]
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3
        got, _, sched = run(group, prompts, params, num_blocks=8, max_model_len=96)
        group.close()
    finally:
        stack.stop()
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, 40)
    st = sched.stats()
    assert st.spec_num_accepted_tokens > 0 and st.num_preemptions_total > 0
