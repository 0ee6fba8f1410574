"""common.proto <-> shared/types.py: the messages every hop carries."""

from __future__ import annotations

from shared import types as t
from shared.proto import common_pb2
from shared.structured.spec import StructuredOutputSpec
from shared.wire.mapper import pair, register_enum, tuple_shape

register_enum(common_pb2.FinishReason, t.FinishReason)
tuple_shape(common_pb2.TopLogprob)  # (token_id, logprob): the core's list of tuples

STRUCTURED_OUTPUT = pair(StructuredOutputSpec, common_pb2.StructuredOutputSpec)
SAMPLING = pair(t.SamplingParams, common_pb2.SamplingParams)
LOGPROBS = pair(t.TokenLogprobs, common_pb2.TokenLogprobs)
MODEL_INFO = pair(t.ModelInfo, common_pb2.ModelInfo)

sampling_to_proto = SAMPLING.to_proto
sampling_from_proto = SAMPLING.from_proto  # unset fields take the defaults; no validation
logprobs_to_proto = LOGPROBS.to_proto
logprobs_from_proto = LOGPROBS.from_proto
model_info_to_proto = MODEL_INFO.to_proto
model_info_from_proto = MODEL_INFO.from_proto

UNPAIRED = {
    "Status": "an error inside a stream message: built from an engine Failure and read "
              "into an EngineError at the two ends of the Session stream",
    "GetModelInfoRequest": "an empty request",
}
