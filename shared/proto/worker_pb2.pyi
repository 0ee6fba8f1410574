from shared.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("tensor_parallel_size", "max_num_batched_tokens")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    max_num_batched_tokens: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("model_info", "rank", "tensor_parallel_size")
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_info: _common_pb2.ModelInfo
    rank: int
    tensor_parallel_size: int
    def __init__(self, model_info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "trace_context", "output_token_ids")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("req_ids", "resumed_from_preemption", "new_block_ids", "num_computed_tokens", "resumed_token_checks")
    class ResumedTokenChecksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TokenCheck
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TokenCheck, _Mapping]] = ...) -> None: ...
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_CHECKS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    resumed_from_preemption: _containers.RepeatedScalarFieldContainer[bool]
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    resumed_token_checks: _containers.MessageMap[str, TokenCheck]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., resumed_from_preemption: _Optional[_Iterable[bool]] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., resumed_token_checks: _Optional[_Mapping[str, TokenCheck]] = ...) -> None: ...

class TokenCheck(_message.Message):
    __slots__ = ("num_tokens", "checksum")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    checksum: int
    def __init__(self, num_tokens: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("step_id", "scheduled_new_reqs", "scheduled_cached_reqs", "scheduled_req_ids", "num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "trace_context", "num_steps", "grammar_compiles", "num_draft_slots", "reset_requests")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class GrammarCompilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.StructuredOutputSpec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.StructuredOutputSpec, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RESET_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    total_num_scheduled_tokens: int
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    num_steps: int
    grammar_compiles: _containers.MessageMap[str, _common_pb2.StructuredOutputSpec]
    num_draft_slots: _containers.RepeatedScalarFieldContainer[int]
    reset_requests: bool
    def __init__(self, step_id: _Optional[int] = ..., scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequestData, _Mapping]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., total_num_scheduled_tokens: _Optional[int] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., num_steps: _Optional[int] = ..., grammar_compiles: _Optional[_Mapping[str, _common_pb2.StructuredOutputSpec]] = ..., num_draft_slots: _Optional[_Iterable[int]] = ..., reset_requests: _Optional[bool] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_ms", "forward_ms", "sample_ms", "idle_ms", "start_unix_s", "end_unix_s", "num_forward_passes", "num_tokens", "mask_ms", "draft_ms")
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MASK_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    idle_ms: float
    start_unix_s: float
    end_unix_s: float
    num_forward_passes: int
    num_tokens: int
    mask_ms: float
    draft_ms: float
    def __init__(self, prepare_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., idle_ms: _Optional[float] = ..., start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ..., num_forward_passes: _Optional[int] = ..., num_tokens: _Optional[int] = ..., mask_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("token_ids", "has_logprobs", "logprobs", "num_draft_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_logprobs: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_draft_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("step_id", "req_ids", "sampled", "timings", "grammars_ready", "grammar_errors", "error", "step_skipped")
    class GrammarErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_READY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled: _containers.RepeatedCompositeFieldContainer[SampledTokens]
    timings: StepTimings
    grammars_ready: _containers.RepeatedScalarFieldContainer[str]
    grammar_errors: _containers.ScalarMap[str, str]
    error: str
    step_skipped: bool
    def __init__(self, step_id: _Optional[int] = ..., req_ids: _Optional[_Iterable[str]] = ..., sampled: _Optional[_Iterable[_Union[SampledTokens, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., grammars_ready: _Optional[_Iterable[str]] = ..., grammar_errors: _Optional[_Mapping[str, str]] = ..., error: _Optional[str] = ..., step_skipped: _Optional[bool] = ...) -> None: ...
