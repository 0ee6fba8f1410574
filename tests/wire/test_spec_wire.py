"""Speculative decoding through the real engine over gRPC (docs/spec_decode.md): the
scheduler adopts the worker's --speculative-config from the handshake, async steps
carry draft slots, the answers the worker's proposals, and the output is transformers'
greedy text; vLLM's counters reach the scheduler's metrics, GetStatus and
`gapserve status`."""

from __future__ import annotations

import pytest

from shared.speculative_config import parse_speculative_config
from tests.observability.helpers import sample
from tests.wire.conftest import start_wire_stack
from tests.wire.session_client import SessionClient, wait_for
from tests.wire.test_async_steps import PROMPTS, hf_model, pool_is_fully_free, rid, status  # noqa: F401
from tests.integration.hf_reference import hf_greedy

SELF_DRAFT = '{"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def spec_runner(tiny_model_dir):
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=tiny_model_dir, kv_cache_memory=4 << 20,
                                    max_model_len=256, max_num_seqs=16,
                                    speculative_config=parse_speculative_config(SELF_DRAFT)))


def test_the_engine_serves_drafts_greedy_exact_and_counts_them(spec_runner, hf_model, capsys):
    stack = start_wire_stack(spec_runner, async_scheduling=True)
    try:
        assert stack.scheduler_core.config.speculative_config.num_speculative_tokens == 3
        slots = []
        original = stack.group.submit

        def recording(step, *a, **kw):
            slots.append(dict(step.num_draft_slots))
            return original(step, *a, **kw)
        stack.group.submit = recording
        client = SessionClient(stack.engine_stub)
        ids = [rid() for _ in PROMPTS]
        for req_id, prompt in zip(ids, PROMPTS):
            client.add(req_id, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
        client.wait_ended(*ids)
        for req_id, prompt in zip(ids, PROMPTS):
            assert client.tokens[req_id] == hf_greedy(hf_model, prompt, 24)
        assert any(slots)
        wait_for(lambda: pool_is_fully_free(stack), what="all blocks free")
        st = status(stack)
        assert parse_speculative_config(st.speculative_config) == \
            parse_speculative_config(SELF_DRAFT)
        assert 0 < st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
        assert len(st.spec_num_accepted_tokens_per_pos) == 3
        model = {"model_name": stack.engine.model_info.model_name}
        assert sample("gapserve:spec_decode_num_accepted_tokens_total", **model) >= \
            st.spec_num_accepted_tokens
        from gapserve import status as status_cli
        assert status_cli.main(["--scheduler-address",
                                f"127.0.0.1:{stack.scheduler.port}"]) == 0
        out = capsys.readouterr().out
        assert f"acceptance rate {st.spec_num_accepted_tokens / st.spec_num_draft_tokens:.3f}" \
            in out
        client.close()
    finally:
        stack.close()
