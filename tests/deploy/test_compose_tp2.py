"""docker-compose.yml's `tp2` profile (deploy/tp2.env): a second worker rank that
joins rank 0's group, and a scheduler that drives both; off by default."""

from __future__ import annotations

import pytest

from .compose_file import TP2_ENV_PATH, environment, load_compose
from .local_stack import LocalStack


def test_without_the_profile_there_is_one_unsplit_worker():
    services = load_compose()["services"]
    assert "worker-1" not in services
    assert environment(services["worker"])["GAPSERVE_TENSOR_PARALLEL_SIZE"] == "1"
    assert environment(services["scheduler"])["GAPSERVE_WORKER_ADDRESSES"] == "worker:50053"


def test_the_tp2_profile_adds_rank_1_of_the_same_group_and_the_scheduler_drives_both():
    services = load_compose(TP2_ENV_PATH)["services"]
    first, second = environment(services["worker"]), environment(services["worker-1"])
    assert (first["GAPSERVE_RANK"], second["GAPSERVE_RANK"]) == ("0", "1")
    assert first["GAPSERVE_TENSOR_PARALLEL_SIZE"] == second["GAPSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    rendezvous = ("GAPSERVE_MASTER_ADDR", "GAPSERVE_MASTER_PORT")
    assert [first[k] for k in rendezvous] == [second[k] for k in rendezvous] == ["worker", "29500"]
    addresses = environment(services["scheduler"])["GAPSERVE_WORKER_ADDRESSES"]
    assert addresses == f"worker:{first['GAPSERVE_PORT']},worker-1:{second['GAPSERVE_PORT']}"


@pytest.mark.e2e
def test_the_tp2_profile_starts_both_ranks_and_answers_a_chat_request(tmp_path):
    from openai import OpenAI

    from shared.model_files.default_model import ensure_default_model
    ensure_default_model()
    stack = LocalStack(load_compose(TP2_ENV_PATH), tmp_path)
    try:
        stack.start()
        stack.wait_healthy("frontend")
        assert stack.healthy("worker-1"), stack.services["worker-1"].log_tail()
        for rank in ("worker", "worker-1"):
            assert "tp_group_formed" in stack.services[rank].log_tail(200000)
        http_port = int(environment(stack.doc["services"]["frontend"])["GAPSERVE_HTTP_PORT"])
        client = OpenAI(base_url=f"http://{stack.ports.address('frontend', http_port)}/v1",
                        api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        stack.stop()
