"""The messages left unpaired in shared/wire/*.py (UNPAIRED) are built or read by
hand. Each one built or read by a function of its own goes through that function
here with every field set away from its default: a built message must have every
field set (ListFields), a read message every field read (a recording view of it). So
a proto field added without its handling fails here, naming the field. A field not
read on purpose is listed with the reason. Messages built or read inline (an
envelope, one list of ids) are pinned to their fields instead, with where to handle
a new one.

AddRequest's frontend side (continuation.add_message) is checked in test_proto_parity.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from types import SimpleNamespace

import pytest

from frontend_svc.engine.continuation import add_message
from frontend_svc.api.grpc_api import (GenerationServicer, final_message, generate_input,
                                   tokenize_reply)
from frontend_svc.request.choice import Choice
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.translate import GenerationInput, ModelLimits
from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.engine_errors import ErrorCode, Failure
from scheduler_svc.server import EngineServicer, _response, engine_status
from scheduler_svc.worker_group import WorkerGroup
from shared.wire.common import model_info_to_proto, sampling_from_proto, sampling_to_proto
from shared.wire.engine import request_output_from_proto
from shared import types as t
from shared.proto import engine_pb2, generate_pb2, worker_pb2
from worker_svc.server import WorkerServicer


def field_names(msg) -> set[str]:
    return {f.name for f in msg.DESCRIPTOR.fields}


def set_fields(msg) -> set[str]:
    return {f.name for f, _ in msg.ListFields()}


class Recording:
    """A message seen through a view that notes every field read (methods such as
    HasField and WhichOneof pass through without counting as a read)."""

    def __init__(self, msg) -> None:
        object.__setattr__(self, "_msg", msg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        msg = object.__getattribute__(self, "_msg")
        if name in msg.DESCRIPTOR.fields_by_name:
            self.read.add(name)
        return getattr(msg, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"the reader wrote {name} into its input")


def assert_all_set(msgs, what: str) -> None:
    """Every field of the messages (of one type; a oneof's arms over several) is set."""
    missing = set.union(*(field_names(m) for m in msgs)) - set().union(
        *(set_fields(m) for m in msgs))
    name = msgs[0].DESCRIPTOR.name
    assert not missing, f"{name} fields not set by {what}: {sorted(missing)}"


def assert_all_read(views: list[Recording], what: str,
                    not_read: dict[str, str] | None = None) -> None:
    """Every field of the viewed messages was read (the views of one message type)."""
    msg = object.__getattribute__(views[0], "_msg")
    missing = field_names(msg) - set().union(*(v.read for v in views)) - set(not_read or {})
    assert not missing, (f"{msg.DESCRIPTOR.name} fields not read by {what}: {sorted(missing)} "
                         "(read them there, or list them as not read with the reason)")


def off_default(cls):
    """An instance of dataclass `cls` with every field away from its default."""
    hints, values = typing.get_type_hints(cls), {}
    for i, f in enumerate(dataclasses.fields(cls)):
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
            if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        origin = typing.get_origin(base) or base
        values[f.name] = {int: 3 + i, float: 0.25 + i, str: f"{f.name}-x", bool: True,
                          tuple: (1, 2), list: [3]}[origin]
    return cls(**values)


def model_info() -> t.ModelInfo:
    return off_default(t.ModelInfo)


# ---------------------------------------------------------------------------
# engine.proto: AddRequest read by the scheduler, EngineStatus, EngineResponse


def test_the_scheduler_reads_every_add_request_field():
    params = t.SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0)
    choice = Choice.for_prompt("r", [5, 6], params, priority=2)
    choice.trace_context, choice.cache_salt = {"traceparent": "00-x"}, "s"
    choice.generated = [7]
    msg = add_message(choice)
    assert_all_set([msg], "continuation.add_message")
    view, added = Recording(msg), []
    engine = SimpleNamespace(add=lambda session, req, trace: added.append((req, trace)))
    EngineServicer._add(engine, SimpleNamespace(), view, [2])  # the Session stream's add
    assert_all_read([view], "EngineServicer._add (scheduler_svc/server.py)")
    (req, trace), = added
    assert (req.req_id, req.prompt_token_ids, req.priority, req.cache_salt, trace) == \
        ("r", [5, 6, 7], 2, "s", {"traceparent": "00-x"})
    assert req.arrival_time == msg.arrival_unix_s
    assert req.sampling_params == sampling_from_proto(msg.sampling_params)


def test_engine_status_sets_every_field():
    engine_status_with_every_field_set(off_default(SchedulerStats))


def engine_status_with_every_field_set(stats) -> engine_pb2.EngineStatus:
    diag = {"waiting": 4, "max_num_seqs": 16, "preemptions_in_window": 2, "window_s": 60.0,
            "diagnosis": "memory_capped", "summary": "one line", "lever": "a flag",
            "admission_blocked_by": "kv_cache"}
    telemetry = SimpleNamespace(status=lambda st: diag if st is stats else None)
    scheduler = SimpleNamespace(stats=lambda: stats)
    engine = SimpleNamespace(
        run_on_loop=lambda fn: fn(), counters=SimpleNamespace(num_steps=7, num_forward_passes=9),
        num_sessions=lambda: 2, worker_addresses=["w0:1", "w1:2"], num_worker_reconnects=1,
        num_worker_failovers=1, model_info=model_info())
    status = engine_status(engine, scheduler, telemetry)
    assert_all_set([status], "engine_status (scheduler_svc/server.py)")
    assert (status.num_running, status.kv_cache_usage, status.worker_addresses) == \
        (stats.num_running, stats.kv_usage, "w0:1,w1:2")
    # waiting for capacity: the diagnosis's count, not the stats' (those count the
    # not-ready too), though both hold a value under the name
    assert (status.num_waiting, status.num_waiting_not_ready, status.max_num_seqs) == \
        (diag["waiting"], stats.num_waiting_not_ready, diag["max_num_seqs"])
    return status


def test_a_step_reply_sets_every_field_of_its_outputs_and_rejections():
    out = t.RequestOutput("a", [1])
    reply = _response([out, Failure("b", ErrorCode.UNAVAILABLE, "worker lost")])
    assert_all_set([reply], "scheduler_svc/server.py _response")
    assert_all_set([reply.rejections[0]], "_response's rejection")
    assert_all_set([reply.rejections[0].status], "_response's rejection status")
    assert (reply.rejections[0].status.code, request_output_from_proto(reply.outputs[0])) \
        == (14, out)  # 14: UNAVAILABLE


# ---------------------------------------------------------------------------
# generate.proto: what frontend_svc/api/grpc_api.py reads and builds


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [1, 7, 8] if add_special_tokens else [7, 8]

    def tokens(self, ids: list[int]) -> list[str]:
        return [f"t{i}" for i in ids]


def frontend() -> SimpleNamespace:
    return SimpleNamespace(limits=ModelLimits(max_model_len=64, vocab_size=100),
                           tokenizer=Tokenizer(), engine=SimpleNamespace(model_info=None),
                           model_path=None)


# read by the servicer, not by generate_input: the client's id for Abort
GENERATE_REQUEST_NOT_READ = {
    "request_id": "GenerationServicer.Generate keys the request by it (Abort finds it there)"}


def test_generate_input_reads_every_generate_request_field():
    params = t.SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[3])
    common = dict(request_id="client-1", sampling_params=sampling_to_proto(params),
                  stop=["END"], include_stop_str_in_output=True, skip_special_tokens=False,
                  add_special_tokens=False, priority=2, cache_salt="salt")
    by_text = generate_pb2.GenerateRequest(text="hello", **common)
    by_ids = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[4, 5]), **common)
    assert_all_set([by_text, by_ids], "this test")
    views = [Recording(by_text), Recording(by_ids)]
    inputs = [generate_input(v, frontend()) for v in views]
    assert_all_read(views, "generate_input (frontend_svc/api/grpc_api.py)", GENERATE_REQUEST_NOT_READ)
    assert inputs == [GenerationInput(ids, params, ["END"], None, True, False, 2, "salt")
                      for ids in ([7, 8], [4, 5])]
    source = inspect.getsource(GenerationServicer.Generate)
    assert all(f"request.{name}" in source for name in GENERATE_REQUEST_NOT_READ)


def test_final_message_sets_every_field_of_the_final_usage_and_timings():
    def state(stop_reason) -> OutputStream:
        choice = Choice("r", GenerationInput([1, 2, 3], t.SamplingParams()), t.SamplingParams(),
                        arrival_unix_s=1000.0, arrival_s=1000.0, generated=[4, 5, 6],
                        num_output_tokens=3, finish_reason=t.FinishReason.STOP,
                        stop_reason=stop_reason, num_cached_tokens=2, num_preemptions=1,
                        first_token_s=1000.1, last_token_s=1000.3)
        return OutputStream(choice, None, None)
    finals = [final_message(state("END")), final_message(state(9))]  # the oneof's two arms
    where = "final_message (frontend_svc/api/grpc_api.py)"
    assert_all_set(finals, where)
    assert_all_set([f.usage for f in finals], where)
    assert_all_set([f.timings for f in finals], where)
    assert (finals[0].stop_str, finals[1].stop_token_id, finals[0].usage.total_tokens,
            finals[0].usage.cached_tokens, finals[0].timings.num_preemptions) == \
        ("END", 9, 6, 2, 1)


def test_tokenize_reads_its_request_and_sets_every_reply_field():
    view = Recording(generate_pb2.TokenizeRequest(text="hi", add_special_tokens=False))
    reply = tokenize_reply(view, frontend())
    assert_all_read([view], "tokenize_reply (frontend_svc/api/grpc_api.py)")
    assert_all_set([reply], "tokenize_reply (frontend_svc/api/grpc_api.py)")
    assert list(reply.token_ids) == [7, 8]


# ---------------------------------------------------------------------------
# worker.proto: the Handshake, both sides


class Aborted(Exception):
    pass


def abort(code, message):
    raise Aborted(f"{code}: {message}")


def test_the_worker_reads_every_handshake_request_field_and_sets_every_reply_field():
    servicer = WorkerServicer(rank=1, tensor_parallel_size=2)
    budget = model_info().max_num_batched_tokens
    servicer.runner = SimpleNamespace(max_num_batched_tokens=budget, model_info=model_info)
    view = Recording(worker_pb2.HandshakeRequest(tensor_parallel_size=2,
                                                 max_num_batched_tokens=budget))
    reply = servicer.Handshake(view, SimpleNamespace(abort=abort))
    assert_all_read([view], "WorkerServicer.Handshake (worker_svc/server.py)")
    assert_all_set([reply], "WorkerServicer.Handshake (worker_svc/server.py)")
    with pytest.raises(Aborted, match="max-num-batched-tokens"):  # and it acts on them
        servicer.Handshake(worker_pb2.HandshakeRequest(tensor_parallel_size=2,
                                                       max_num_batched_tokens=budget + 1),
                           SimpleNamespace(abort=abort))


def test_the_scheduler_sets_every_handshake_request_field_and_reads_every_reply_field():
    asks, views = [], []

    class Stub:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def Handshake(self, ask, timeout, wait_for_ready, metadata):
            asks.append(ask)
            views.append(Recording(worker_pb2.HandshakeResponse(
                model_info=model_info_to_proto(model_info()), rank=self.rank,
                tensor_parallel_size=2)))
            return views[-1]

    group = WorkerGroup(["w0:1", "w1:2"])
    stubs = [Stub(0), Stub(1)]
    group._group_stubs = lambda index: stubs
    budget = model_info().max_num_batched_tokens
    assert group.handshake(5.0, max_num_batched_tokens=budget) == model_info()
    assert_all_set(asks[:1], "WorkerGroup._handshake_group (scheduler_svc/worker_group.py)")
    assert_all_read(views, "WorkerGroup._handshake_group (scheduler_svc/worker_group.py)")


# ---------------------------------------------------------------------------
# every unpaired message is checked above or pinned to its fields here

CHECKED = {  # by a test above, through the function that builds or reads it
    "AddRequest", "EngineStatus", "EngineResponse", "Rejection", "Status",
    "GenerateRequest", "GenerateFinal", "Usage", "RequestTimings", "TokenizeRequest",
    "TokenizeResponse", "HandshakeRequest", "HandshakeResponse"}

PINNED = {  # message: (its fields, where a new field must be handled)
    "GetModelInfoRequest": ((), "an empty request"),
    "GetStatusRequest": ((), "an empty request"),
    "AbortRequests": (("request_ids",), "built by frontend_svc/engine/engine_client.py, read by "
                      "EngineServicer._handle"),
    "EngineRequest": (("add", "abort", "batch"), "the oneof's arms: EngineServicer._read "
                      "and _handle dispatch on each"),
    "EngineRequests": (("requests",), "a batch: EngineServicer._read"),
    "TokenIds": (("ids",), "the token_ids arm of GenerateRequest: generate_input (checked "
                 "above through the prompt ids it returns)"),
    "GenerateResponse": (("request_id", "token_ids", "text", "logprobs", "final"),
                         "built inline by GenerationServicer.Generate"),
    "AbortRequest": (("request_ids",), "read by GenerationServicer.Abort"),
    "AbortResponse": (("num_aborted",), "built by GenerationServicer.Abort"),
    "GetModelInfoResponse": (("served_model_name", "model_info"),
                             "built by GenerationServicer.GetModelInfo"),
    "SampledTokens": (("token_ids", "has_logprobs", "logprobs", "num_draft_tokens"),
                      "hand code in shared/wire/worker.py, round-tripped with "
                      "ModelRunnerOutput in test_proto_parity.py"),
}

MODULES = ("common", "engine", "generate", "worker")


def unpaired() -> dict[str, type]:
    out = {}
    for stem in MODULES:
        pb2 = importlib.import_module(f"shared.proto.{stem}_pb2")
        for name in importlib.import_module(f"shared.wire.{stem}").UNPAIRED:
            out[name] = getattr(pb2, name)
    return out


def test_every_unpaired_message_is_checked_or_pinned():
    names = set(unpaired())
    assert not CHECKED & set(PINNED)
    assert names - CHECKED - set(PINNED) == set(), \
        "a new unpaired message: check it through its function above, or pin it"
    assert (CHECKED | set(PINNED)) - names == set(), "stale entries"


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_pinned_message_has_its_listed_fields(name):
    fields, where = PINNED[name]
    actual = [f.name for f in unpaired()[name].DESCRIPTOR.fields]
    assert actual == list(fields), \
        f"{name} has fields {actual}, pinned {list(fields)}: handle it in {where}, then pin it"


# ---------------------------------------------------------------------------
# the checks fail for a field added to the proto and not handled


def with_field(pb2, message: str, field: str):
    """pb2's `message` plus `int32 <field> = 99`, in a pool of its own (with the files
    it imports), as protoc would generate it."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    pool = descriptor_pool.DescriptorPool()
    for dep in pb2.DESCRIPTOR.dependencies:
        fdp = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(fdp)
        pool.Add(fdp)
    fdp = descriptor_pb2.FileDescriptorProto()
    pb2.DESCRIPTOR.CopyToProto(fdp)
    msg = next(m for m in fdp.message_type if m.name == message)
    fd = descriptor_pb2.FieldDescriptorProto
    msg.field.add(name=field, number=99, type=fd.TYPE_INT32, label=fd.LABEL_OPTIONAL)
    pool.Add(fdp)
    full_name = pb2.DESCRIPTOR.message_types_by_name[message].full_name
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def test_a_new_engine_status_field_that_engine_status_does_not_set_fails(monkeypatch):
    """engine_status fills the message by name (shared/wire/readout.py): a field that
    no source holds fails the builder, naming it."""
    import scheduler_svc.server as server
    from shared.wire.mapper import WireMismatch
    monkeypatch.setattr(server, "engine_pb2", SimpleNamespace(
        EngineStatus=with_field(engine_pb2, "EngineStatus", "num_new_things")))
    with pytest.raises(WireMismatch, match=r"EngineStatus\.num_new_things: no value given "
                                           r"and no source holds 'num_new_things'"):
        engine_status_with_every_field_set(off_default(SchedulerStats))


def test_a_new_engine_status_field_the_stats_hold_is_carried_with_no_edit(monkeypatch):
    import scheduler_svc.server as server
    monkeypatch.setattr(server, "engine_pb2", SimpleNamespace(
        EngineStatus=with_field(engine_pb2, "EngineStatus", "num_new_things")))
    stats = SimpleNamespace(**dataclasses.asdict(off_default(SchedulerStats)),
                            num_new_things=5)
    assert engine_status_with_every_field_set(stats).num_new_things == 5


def test_a_new_generate_request_field_that_generate_input_does_not_read_fails():
    Extended = with_field(generate_pb2, "GenerateRequest", "num_new_things")
    params = sampling_to_proto(t.SamplingParams(max_tokens=5))
    request = Extended(text="hello", num_new_things=3, priority=1)
    request.sampling_params.CopyFrom(request.sampling_params.__class__.FromString(
        params.SerializeToString()))
    view = Recording(request)
    generate_input(view, frontend())
    with pytest.raises(AssertionError, match=r"not read by generate_input.*'num_new_things'"):
        assert_all_read([view], "generate_input", GENERATE_REQUEST_NOT_READ)
