"""The VllmEngine protocol's requests become our Requests by vLLM's defaults, and what
we cannot honour is refused naming it (scheduler_svc/vllm_engine_request.py): no
network, no engine."""

from __future__ import annotations

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from scheduler_svc.core.block_pool import BlocksRemoved, BlocksStored, CacheCleared
from scheduler_svc.vllm_engine_kv import KvEventStreams, event_to_proto, signed64
from scheduler_svc.vllm_engine_request import complete, request_from_proto
from shared.types import FinishReason, InvalidRequestError, RequestOutput

EOS = [2]


def request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                              sampling_params=pb.SamplingParams(**sampling))


def test_proto3_zeros_mean_vllms_defaults_and_no_max_tokens_is_what_the_context_leaves():
    params = request_from_proto(request(), EOS, max_model_len=100).sampling_params
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert params.max_tokens == 97 and params.logprobs is None and params.seed is None
    assert params.stop_token_ids == [] and not params.ignore_eos


def test_the_request_stops_on_the_models_eos_when_no_stop_ids_are_sent():
    req = request_from_proto(request(temperature=0.0, max_tokens=4), EOS, 100)
    assert req.eos_token_ids == frozenset(EOS) and req.sampling_params.greedy


def test_constraints_become_structured_outputs():
    spec = request_from_proto(request(json_schema='{"type": "array"}'), EOS, 100) \
        .sampling_params.structured_output
    assert (spec.kind, spec.value) == ("json", '{"type": "array"}')
    choice = request_from_proto(request(choice=pb.ChoiceConstraint(choices=["a", "b"])), EOS,
                                100).sampling_params.structured_output
    assert (choice.kind, choice.value) == ("choice", '["a", "b"]')


@pytest.mark.parametrize("sampling, field", [
    ({"n": 3}, "SamplingParams.n"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ({"structural_tag": "{}"}, "structural_tag")])
def test_options_we_cannot_honour_are_refused_naming_them(sampling, field):
    with pytest.raises(InvalidRequestError, match=field):
        request_from_proto(request(**sampling), EOS, 100)


def test_an_unknown_field_inside_a_nested_message_is_refused():
    msg = request()
    msg.sampling_params.MergeFromString(bytes([0xf8, 0x06, 0x01]))  # field 111 = 1
    with pytest.raises(InvalidRequestError, match=r"unknown field number\(s\) \[111\]"):
        request_from_proto(msg, EOS, 100)


def test_complete_reports_a_stop_id_match_but_not_the_models_eos():
    req = request_from_proto(request(stop_token_ids=[9]), EOS, 100)
    by_stop = complete(RequestOutput("r", [9], finish_reason=FinishReason.STOP, stop_token_id=9,
                                     num_cached_tokens=16), req, [4, 9], None).complete
    assert (by_stop.matched_token_id, by_stop.finish_reason, by_stop.cached_tokens) == \
        (9, "stop", 16)
    by_eos = complete(RequestOutput("r", [2], finish_reason=FinishReason.STOP, stop_token_id=2),
                      req, [2], None).complete
    assert by_eos.WhichOneof("matched_stop") is None
    assert (by_eos.prompt_tokens, by_eos.completion_tokens) == (3, 1)


def test_kv_events_carry_each_blocks_tokens_and_int64_hashes():
    digest = (0xFFFF_FFFF_FFFF_FFFF).to_bytes(32, "big")
    event = event_to_proto(BlocksStored([digest, digest], None, list(range(8))), 4, 1)
    assert [list(b.token_ids) for b in event.stored.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert event.stored.blocks[0].block_hash == signed64(2**64 - 1) == -1
    assert event_to_proto(BlocksRemoved([digest]), 4, 2).removed.block_hashes == [-1]
    assert event_to_proto(CacheCleared(), 4, 3).HasField("cleared")


def test_nothing_is_recorded_before_a_subscriber_and_a_resubscriber_replays_from_its_number():
    started = []
    streams = KvEventStreams(block_size=4, start_recording=lambda: started.append(1))
    streams.publish([CacheCleared()])  # no gateway yet: not built, not kept
    first = streams.subscribe()
    assert started == [1] and first.empty()
    streams.publish([CacheCleared()])
    seq = first.get_nowait().sequence_number
    again = streams.subscribe(start_sequence_number=1)  # from before its first batch
    assert again.get_nowait().sequence_number == seq and again.empty()
    assert started == [1]  # the core records from the first subscriber on


def test_a_subscriber_that_fell_behind_is_ended_without_blocking():
    from scheduler_svc.vllm_engine_kv import ENDED

    streams = KvEventStreams(block_size=4, max_queue=1)
    q = streams.subscribe()
    streams.publish([CacheCleared()])
    streams.publish([CacheCleared()])  # the queue is full: dropped (and counted)
    streams.end(q)
    assert q.get_nowait() is ENDED
    streams.publish([CacheCleared()])  # no longer fed
    assert q.empty()
