from shared.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "cache_salt", "arrival_unix_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    arrival_unix_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., arrival_unix_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("add", "abort", "batch")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequests
    batch: EngineRequests
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., batch: _Optional[_Union[EngineRequests, _Mapping]] = ...) -> None: ...

class EngineRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "finish_reason", "stop_token_id", "num_preemptions", "num_cached_tokens", "queue_time_s", "prefill_time_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    num_preemptions: int
    num_cached_tokens: int
    queue_time_s: float
    prefill_time_s: float
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., prefill_time_s: _Optional[float] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("request_id", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: _common_pb2.Status
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ...) -> None: ...

class EngineResponse(_message.Message):
    __slots__ = ("outputs", "rejections")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_waiting_not_ready", "max_num_seqs", "kv_cache_usage", "num_kv_blocks", "num_free_blocks", "num_preemptions_total", "num_preemptions_in_window", "window_s", "prefix_cache_queries", "prefix_cache_hits", "num_steps_total", "num_sessions", "diagnosis", "summary", "lever", "admission_blocked_by", "worker_addresses", "num_worker_reconnects_total", "num_worker_failovers_total", "num_forward_passes_total", "speculative_config", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_accepted_tokens_per_pos")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_NOT_READY_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSIS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LEVER_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_BLOCKED_BY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKER_RECONNECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKER_FAILOVERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARD_PASSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_waiting_not_ready: int
    max_num_seqs: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions_total: int
    num_preemptions_in_window: int
    window_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps_total: int
    num_sessions: int
    diagnosis: str
    summary: str
    lever: str
    admission_blocked_by: str
    worker_addresses: str
    num_worker_reconnects_total: int
    num_worker_failovers_total: int
    num_forward_passes_total: int
    speculative_config: str
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_not_ready: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_preemptions_total: _Optional[int] = ..., num_preemptions_in_window: _Optional[int] = ..., window_s: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_steps_total: _Optional[int] = ..., num_sessions: _Optional[int] = ..., diagnosis: _Optional[str] = ..., summary: _Optional[str] = ..., lever: _Optional[str] = ..., admission_blocked_by: _Optional[str] = ..., worker_addresses: _Optional[str] = ..., num_worker_reconnects_total: _Optional[int] = ..., num_worker_failovers_total: _Optional[int] = ..., num_forward_passes_total: _Optional[int] = ..., speculative_config: _Optional[str] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...
