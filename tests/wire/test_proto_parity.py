"""protos/ is the one wire contract: every message is either paired with a plain type
(shared/wire/, field by field, both ways) or listed as unpaired with the reason, and
a field on one side without the other fails."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import types
import typing
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from shared import types as t
from shared.proto import common_pb2, gen, worker_pb2
from shared.wire import mapper
from shared.wire.mapper import WireMismatch

PROTO_FILES = sorted(p.stem for p in gen.PROTO_DIR.glob("*.proto"))


def wire_module(stem: str):
    return importlib.import_module(f"shared.wire.{stem}")


def dataclass_pairs() -> list[mapper.Pair]:
    return [p for p in mapper.pairs() if dataclasses.is_dataclass(p.py)]


def test_every_proto_file_has_a_wire_module():
    assert PROTO_FILES == ["common", "engine", "generate", "worker"]
    for stem in PROTO_FILES:
        assert isinstance(wire_module(stem).UNPAIRED, dict)


@pytest.mark.parametrize("stem", PROTO_FILES)
def test_every_message_is_paired_or_listed_unpaired_with_a_reason(stem):
    pb2 = importlib.import_module(f"shared.proto.{stem}_pb2")
    unpaired = wire_module(stem).UNPAIRED
    for name in pb2.DESCRIPTOR.message_types_by_name:
        paired = mapper.registered(getattr(pb2, name)) is not None
        assert not (paired and name in unpaired), f"{name}: paired and listed unpaired"
        assert paired or name in unpaired, \
            f"{stem}.proto {name}: neither paired nor in shared/wire/{stem}.py UNPAIRED"
        if not paired:
            assert len(unpaired[name]) > 10, f"{name}: say why it is unpaired"
    assert set(unpaired) <= set(pb2.DESCRIPTOR.message_types_by_name), "stale UNPAIRED entries"


def test_the_nine_core_messages_are_paired_with_shared_types():
    names = {p.name: p.py for p in dataclass_pairs()}
    assert names == {
        "SamplingParams": t.SamplingParams, "TokenLogprobs": t.TokenLogprobs,
        "ModelInfo": t.ModelInfo, "NewRequestData": t.NewRequestData,
        "CachedRequestData": t.CachedRequestData, "SchedulerOutput": t.SchedulerOutput,
        "StepTimings": t.StepTimings, "ModelRunnerOutput": t.ModelRunnerOutput,
        "RequestOutput": t.RequestOutput, "StructuredOutputSpec": t.StructuredOutputSpec}


@pytest.mark.parametrize("p", dataclass_pairs(), ids=lambda p: p.name)
def test_each_pair_has_a_counterpart_for_every_field_both_ways(p):
    assert mapper.mismatches(p.py, p.msg, p.renames, p.hand_to, p.hand_from) == []
    wire = {f.name for f in p.msg.DESCRIPTOR.fields}
    plain = {f.name for f in dataclasses.fields(p.py)}
    assert wire == {f for f in wire if p.renames.get(f, f) in plain} | set(p.hand_to)
    assert plain == {p.renames.get(f, f) for f in wire} & plain | set(p.hand_from)


# ---------------------------------------------------------------------------
# every field, set to something other than its default, survives the round trip


def sample(hint, name: str = ""):
    """A value of `hint` that differs from any default the core types use."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in args if a is not type(None)), name)
    if origin is list:
        return [sample(args[0], name)]
    if origin is set:
        return {sample(args[0], name), sample(args[0], name) + "b"}
    if origin is dict:
        return {sample(args[0], name): sample(args[1], name)}
    if origin is tuple:
        return tuple(sample(a, name) for a in args)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return list(hint)[-1]
    if dataclasses.is_dataclass(hint):
        return full(hint)
    return {int: 3, float: 0.5, bool: True, str: f"{name}-x"}[hint]


# A column keyed like another (entry i belongs to that field's key i): its sample uses
# that field's keys, since the wire carries it aligned with them.
KEYED_LIKE = {(t.SchedulerOutput, "num_draft_slots"): "num_scheduled_tokens"}


def full(py: type):
    hints = typing.get_type_hints(py)
    obj = py(**{f.name: sample(hints[f.name], f.name) for f in dataclasses.fields(py)})
    for (owner, name), keys_of in KEYED_LIKE.items():
        if owner is py:
            setattr(obj, name, {k: 3 for k in getattr(obj, keys_of)})
    return obj


@pytest.mark.parametrize("p", dataclass_pairs(), ids=lambda p: p.name)
def test_every_field_set_off_its_default_survives_the_round_trip(p):
    obj = full(p.py)
    for f in dataclasses.fields(p.py):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        assert getattr(obj, f.name) != default, f"{f.name} sampled at its default"
    assert p.from_proto(p.to_proto(obj)) == obj


# ---------------------------------------------------------------------------
# a field on one side only is a mismatch


def without(py: type, drop: str) -> type:
    hints = typing.get_type_hints(py)
    return dataclasses.make_dataclass(py.__name__, [
        (f.name, hints[f.name], f) for f in dataclasses.fields(py) if f.name != drop],
        slots=True)


def test_a_proto_field_without_a_dataclass_field_fails_the_pairing():
    trimmed = without(t.SamplingParams, "min_p")
    assert mapper.mismatches(trimmed, common_pb2.SamplingParams) == [
        "proto field 'min_p' has no counterpart in SamplingParams"]
    with pytest.raises(WireMismatch, match="min_p"):
        mapper.pair(trimmed, common_pb2.SamplingParams, register=False)


def test_a_dataclass_field_without_a_proto_field_fails_the_pairing():
    hints = typing.get_type_hints(t.ModelInfo)
    extra = dataclasses.make_dataclass("ModelInfo", [
        (f.name, hints[f.name], f) for f in dataclasses.fields(t.ModelInfo)
    ] + [("rope_theta", float, dataclasses.field(default=0.0))])
    with pytest.raises(WireMismatch, match="ModelInfo.rope_theta has no counterpart"):
        mapper.pair(extra, common_pb2.ModelInfo, register=False)


def test_a_container_for_a_single_field_fails_the_pairing():
    hints = typing.get_type_hints(t.StepTimings) | {"idle_ms": list[float]}
    wrong = dataclasses.make_dataclass("StepTimings", [
        (f.name, hints[f.name], f) for f in dataclasses.fields(t.StepTimings)])
    assert mapper.mismatches(wrong, worker_pb2.StepTimings) == [
        "idle_ms: a container (list) for the single field 'idle_ms'"]


def test_an_enum_with_other_values_than_the_wire_fails():
    Other = enum.IntEnum("Other", {"STOP": 1, "LENGTH": 2})
    with pytest.raises(WireMismatch, match="values"):
        mapper.register_enum(common_pb2.FinishReason, Other)


# ---------------------------------------------------------------------------
# a new sampling field: one line in the .proto, one field in the dataclass


def sampling_with(field_name: str) -> type:
    """common.proto's SamplingParams plus `optional double <field_name> = 99`, built
    the way protoc would (a proto3 optional is a synthetic oneof)."""
    fdp = descriptor_pb2.FileDescriptorProto()
    common_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "parity/common.proto", "parity.v1"
    for m in fdp.message_type:  # references to its own types follow the package
        for f in [*m.field, *(x for n in m.nested_type for x in n.field)]:
            if f.type_name:
                f.type_name = f.type_name.replace(".gapserve.v1.", ".parity.v1.")
    msg = next(m for m in fdp.message_type if m.name == "SamplingParams")
    msg.oneof_decl.add(name=f"_{field_name}")
    fd = descriptor_pb2.FieldDescriptorProto
    msg.field.add(name=field_name, number=99, type=fd.TYPE_DOUBLE, label=fd.LABEL_OPTIONAL,
                  oneof_index=len(msg.oneof_decl) - 1, proto3_optional=True)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("parity.v1.SamplingParams"))


def test_a_new_sampling_field_needs_only_the_proto_line_and_the_dataclass_field(monkeypatch):
    wire = sampling_with("top_a")
    # the copy's nested StructuredOutputSpec lives in the parity package: pair it too
    spec = wire.DESCRIPTOR.fields_by_name["structured_output"].message_type
    monkeypatch.setitem(mapper._PAIRS, spec.full_name, mapper.pair(
        t.StructuredOutputSpec, message_factory.GetMessageClass(spec), register=False))
    with pytest.raises(WireMismatch, match="'top_a' has no counterpart"):
        mapper.pair(t.SamplingParams, wire, register=False)
    hints = typing.get_type_hints(t.SamplingParams)
    plain = dataclasses.make_dataclass("SamplingParams", [
        (f.name, hints[f.name], f) for f in dataclasses.fields(t.SamplingParams)
    ] + [("top_a", float, dataclasses.field(default=0.0))], slots=True)
    p = mapper.pair(plain, wire, register=False)
    sp = plain(temperature=0.0, top_a=0.25, stop_token_ids=[2])
    assert p.to_proto(sp).top_a == 0.25
    assert p.from_proto(p.to_proto(sp)) == sp
    assert p.from_proto(wire()).top_a == 0.0  # unset on the wire: the dataclass default


# ---------------------------------------------------------------------------
# AddRequest is unpaired: its two edges are checked here instead


def test_a_continuation_fills_every_add_request_field_and_the_scheduler_reads_them():
    from frontend_svc.engine.continuation import add_message
    from frontend_svc.request.choice import Choice
    from scheduler_svc.server import _request_from_proto

    params = t.SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0)
    choice = Choice.for_prompt("r", [5, 6], params, priority=2)
    choice.trace_context, choice.cache_salt = {"traceparent": "00-x"}, "s"
    choice.generated = [7]
    msg = add_message(choice)
    for f in msg.DESCRIPTOR.fields:  # a new AddRequest field must be filled here too
        value = getattr(msg, f.name)
        assert (len(value) if f.is_repeated else msg.HasField(f.name) if f.has_presence
                else value), f"AddRequest.{f.name} is not filled by continuation.add_message"
    req = _request_from_proto(msg, [2])
    assert (req.req_id, req.prompt_token_ids, req.priority, req.cache_salt) == \
        ("r", [5, 6, 7], 2, "s")
    assert req.sampling_params == t.SamplingParams(max_tokens=9, min_tokens=3, temperature=0.0,
                                                   num_output_prefix_tokens=1)
    assert req.arrival_time == msg.arrival_unix_s


# ---------------------------------------------------------------------------
# benchmarks/wire_hand_reference.py: the hand-written mapping the derived one is timed
# against does the same work


@pytest.mark.parametrize("name", ["scheduler_output", "runner_output", "request_output"])
def test_the_hand_reference_of_the_benchmark_converts_as_the_derived_mapping(name):
    import importlib.util

    import shared.wire.engine as engine_wire
    import shared.wire.worker as worker_wire

    path = Path(__file__).parents[2] / "benchmarks" / "wire_hand_reference.py"
    spec = importlib.util.spec_from_file_location("wire_hand_reference", path)
    hand = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hand)
    py = {"scheduler_output": t.SchedulerOutput, "runner_output": t.ModelRunnerOutput,
          "request_output": t.RequestOutput}[name]
    ours = worker_wire if name != "request_output" else engine_wire
    obj = full(py)
    to_hand, to_ours = getattr(hand, f"{name}_to_proto"), getattr(ours, f"{name}_to_proto")
    assert to_hand(obj).SerializeToString(deterministic=True) == \
        to_ours(obj).SerializeToString(deterministic=True)
    assert getattr(hand, f"{name}_from_proto")(to_ours(obj)) == obj


def test_columns_read_together_take_one_pass_and_the_dataclass_gets_each_in_its_place():
    from shared.proto import worker_pb2
    from shared.wire import worker as worker_wire

    calls = []

    def counted(m):
        calls.append(m)
        return worker_wire._columns(m)

    p = mapper.pair(t.ModelRunnerOutput, worker_pb2.ModelRunnerOutput,
                    hand_to={"sampled": worker_wire._sampled},
                    hand_from=mapper.columns(counted, "sampled_token_ids", "logprobs",
                                             "num_draft_tokens"), register=False)
    obj = full(t.ModelRunnerOutput)
    assert p.from_proto(p.to_proto(obj)) == obj
    assert len(calls) == 1
