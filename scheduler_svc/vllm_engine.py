"""The `vllm.grpc.engine.VllmEngine` protocol (smg-grpc-proto 0.4.28) on the
scheduler's gRPC port, so the Shepherd Model Gateway (`smg launch --backend vllm
--worker-urls grpc://...`) drives a gapserve replica as it drives vLLM
(docs/scale_out.md).

A thin servicer over the same Engine as gapserve.v1.Engine: each Generate call is a
one-request Session of the engine, so admission (the open-request bound), the stop
rule (the model's EOS from generation_config, as vLLM, when no stop ids are sent),
metrics and spans are the gapserve protocol's; no second loop. A cancelled stream
closes its session, which aborts the request, and Abort aborts by id; either frees
it. The translation of messages is scheduler_svc/vllm_engine_request.py, the KV
event stream scheduler_svc/vllm_engine_kv.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import queue
import threading
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import grpc
from prometheus_client import Counter
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_svc.engine import CLOSED, Engine
from scheduler_svc.engine_errors import EngineFailed, Failure, Overloaded, describe
from scheduler_svc.metrics import REJECTED_FULL
from scheduler_svc.vllm_engine_kv import ENDED, KvEventStreams
from scheduler_svc.vllm_engine_request import (FINISH_REASONS, chunk, complete,
                                               request_from_proto, unknown_field_numbers)
from shared.telemetry import get_logger
from shared.types import InvalidRequestError

log = get_logger(service="scheduler")

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
SERVER_TYPE = "gapserve"
TOKENIZER_CHUNK_BYTES = 1 << 20
# What GetTokenizer ships: the files a Hugging Face tokenizer and chat template load from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json",
                   "config.json")
_TRACE_KEYS = ("traceparent", "tracestate", "baggage")
RPCS = Counter("gapserve:vllm_engine_rpcs",
               "Calls of the vllm.grpc.engine.VllmEngine protocol (gateways such as smg), "
               "by method and the status they ended with.", ["method", "code"])


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None  # set by ready() once the workers answered
        self._status_fn = self._flush_fn = None
        self.kv_streams: KvEventStreams | None = None
        self.max_num_seqs = 0
        self._ready = threading.Event()
        self._started = time.time()
        self._last_receive = 0.0

    def ready(self, engine: Engine, status_fn, flush_fn, kv_streams: KvEventStreams,
              max_num_seqs: int) -> None:
        """status_fn: () -> engine_pb2.EngineStatus; flush_fn: () -> None, on the loop."""
        self.engine, self._status_fn, self._flush_fn = engine, status_fn, flush_fn
        self.kv_streams, self.max_num_seqs = kv_streams, max_num_seqs
        self._ready.set()

    def shutdown(self) -> None:
        if self.kv_streams is not None:
            self.kv_streams.close()

    def _engine(self, context, method: str) -> Engine:
        # unlike gapserve.v1 callers, a gateway probes and retries: answer at once
        engine = self.engine
        if not self._ready.is_set() or engine is None:
            self._abort(context, method, grpc.StatusCode.UNAVAILABLE,
                        "the scheduler is still starting (waiting for its workers)")
        if engine.failed is not None:
            self._abort(context, method, grpc.StatusCode.UNAVAILABLE,
                        f"the engine failed: {describe(engine.failed)}")
        return engine

    @staticmethod
    def _abort(context, method: str, code: grpc.StatusCode, message: str):
        RPCS.labels(method, code.name).inc()
        if code is not grpc.StatusCode.UNAVAILABLE:
            log.info("vllm_engine_refused", method=method, code=code.name, error=message)
        context.abort(code, message)

    def _check_known(self, msg, context, method: str) -> None:
        unknown = unknown_field_numbers(msg)
        if unknown:
            self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                        f"unknown field number(s) {sorted(set(unknown))} in "
                        f"{msg.DESCRIPTOR.name}: this server speaks vllm.grpc.engine from "
                        "smg-grpc-proto 0.4.28")

    # ---------------------------------------------------------------- generation

    def Generate(self, request, context):
        engine = self._engine(context, "Generate")
        self._last_receive = time.time()
        try:
            req = request_from_proto(request, engine.model_info.eos_token_ids,
                                     engine.max_model_len)
        except InvalidRequestError as e:
            self._abort(context, "Generate", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        trace = {k: v for k, v in context.invocation_metadata() if k in _TRACE_KEYS}
        session = engine.open_session()
        # a cancelled stream (the gateway's client went away) aborts the request
        context.add_callback(lambda: engine.close_session(session))
        try:
            engine.add(session, req, trace)
        except InvalidRequestError as e:
            self._abort(context, "Generate", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KeyError as e:
            self._abort(context, "Generate", grpc.StatusCode.ALREADY_EXISTS, e.args[0])
        except Overloaded as e:
            REJECTED_FULL.inc()
            self._abort(context, "Generate", grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineFailed as e:
            self._abort(context, "Generate", grpc.StatusCode.UNAVAILABLE, str(e))
        with_logprobs = req.sampling_params.logprobs is not None
        output_ids: list[int] = []
        logprobs: list | None = [] if with_logprobs else None
        try:
            while True:
                items = session.outbox.get()
                if items is CLOSED:  # the stream was cancelled: nothing to answer
                    RPCS.labels("Generate", "CANCELLED").inc()
                    log.info("vllm_engine_cancelled", request_id=req.req_id,
                             num_output_tokens=len(output_ids))
                    return
                for item in items:
                    if isinstance(item, Failure):
                        self._abort(context, "Generate", item.code.status_code, item.message)
                    output_ids += item.new_token_ids
                    if with_logprobs:
                        logprobs += item.new_logprobs
                    if request.stream and item.new_token_ids:
                        yield chunk(item, req.num_prompt_tokens, len(output_ids), with_logprobs)
                    if item.finished:
                        RPCS.labels("Generate", "OK").inc()
                        yield complete(item, req, output_ids, logprobs)
                        return
        finally:
            engine.close_session(session)

    def Abort(self, request, context):
        engine = self._engine(context, "Abort")
        self._check_known(request, context, "Abort")
        engine.abort(list(request.request_ids))
        RPCS.labels("Abort", "OK").inc()
        log.info("vllm_engine_abort", request_ids=list(request.request_ids))
        return pb.AbortResponse()

    def Embed(self, request, context):
        self._abort(context, "Embed", grpc.StatusCode.UNIMPLEMENTED,
                    "Embed needs a pooling (embedding) model; gapserve serves generation "
                    "models only")

    # ---------------------------------------------------------------- facts

    def HealthCheck(self, request, context):
        engine = self.engine
        if not self._ready.is_set() or engine is None:
            healthy, message = False, "starting: waiting for the workers"
        elif engine.failed is not None:
            healthy, message = False, f"the engine failed: {describe(engine.failed)}"
        elif not engine.workers_connected:
            healthy, message = False, "reconnecting to the workers"
        else:
            healthy, message = True, "serving"
        RPCS.labels("HealthCheck", "OK").inc()
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    def GetModelInfo(self, request, context):
        engine = self._engine(context, "GetModelInfo")
        info = engine.model_info
        config = _read_json(info.model_path, "config.json")
        eos = info.eos_token_ids
        RPCS.labels("GetModelInfo", "OK").inc()
        return pb.GetModelInfoResponse(
            model_path=info.model_path, tokenizer_path=info.model_path,
            served_model_name=info.model_name, is_generation=True, supports_vision=False,
            max_context_length=engine.max_model_len, max_req_input_len=engine.max_model_len - 1,
            vocab_size=info.vocab_size, eos_token_ids=eos,
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures") or []],
            pad_token_id=_int_or(config.get("pad_token_id"), -1),
            bos_token_id=_int_or(config.get("bos_token_id"), -1))

    def GetServerInfo(self, request, context):
        engine = self._engine(context, "GetServerInfo")
        status = self._status_fn()
        RPCS.labels("GetServerInfo", "OK").inc()
        return pb.GetServerInfoResponse(
            active_requests=status.num_running + status.num_waiting,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started, server_type=SERVER_TYPE,
            data_parallel_size=1,  # one replica per scheduler; the gateway routes between them
            kv_cache_dtype="auto", block_size=engine.model_info.block_size,
            model_dtype=engine.model_info.dtype, max_num_seqs=self.max_num_seqs)

    def GetLoads(self, request, context):
        self._engine(context, "GetLoads")
        self._check_known(request, context, "GetLoads")
        if request.HasField("dp_rank") and request.dp_rank != 0:
            self._abort(context, "GetLoads", grpc.StatusCode.INVALID_ARGUMENT,
                        f"dp_rank {request.dp_rank} does not exist: this scheduler is rank 0")
        s = self._status_fn()
        used_blocks = s.num_kv_blocks - s.num_free_blocks
        block = self.engine.model_info.block_size
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=s.num_running, num_waiting_reqs=s.num_waiting,
            num_total_reqs=s.num_running + s.num_waiting, num_used_tokens=used_blocks * block,
            max_total_num_tokens=s.num_kv_blocks * block, token_usage=s.kv_cache_usage,
            cache_hit_rate=(s.prefix_cache_hits / s.prefix_cache_queries
                            if s.prefix_cache_queries else 0.0),
            utilization=s.num_running / s.max_num_seqs if s.max_num_seqs else 0.0,
            max_running_requests=s.max_num_seqs)
        RPCS.labels("GetLoads", "OK").inc()
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                   version=SERVER_TYPE, dp_rank_count=1, loads=[load])

    def _engine_load(self) -> cpb.EngineLoad:
        s = self._status_fn()
        return cpb.EngineLoad(running_requests=s.num_running, waiting_requests=s.num_waiting,
                              token_usage=s.kv_cache_usage, max_running_requests=s.max_num_seqs,
                              load_only=True)

    # ---------------------------------------------------------------- cache, tokenizer

    def FlushCache(self, request, context):
        self._engine(context, "FlushCache")
        self._check_known(request, context, "FlushCache")
        self._flush_fn()
        log.info("prefix_cache_flushed", via=SERVICE_NAME)
        RPCS.labels("FlushCache", "OK").inc()
        return cpb.FlushCacheResponse(success=True, message="prefix cache cleared")

    def SubscribeKvEvents(self, request, context):
        self._engine(context, "SubscribeKvEvents")
        self._check_known(request, context, "SubscribeKvEvents")
        streams = self.kv_streams
        q = streams.subscribe(request.start_sequence_number)
        context.add_callback(lambda: streams.end(q))  # the gateway went away
        RPCS.labels("SubscribeKvEvents", "OK").inc()
        try:
            if request.load_records_before_first_batch:
                yield cpb.KvEventBatch(timestamp=time.time(), load=self._engine_load())
            while True:
                batch = q.get()
                if batch is ENDED:
                    return
                yield batch
        finally:
            streams.unsubscribe(q)

    def GetTokenizer(self, request, context):
        engine = self._engine(context, "GetTokenizer")
        folder = Path(engine.model_info.model_path or ".")
        names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if "tokenizer.json" not in names and "tokenizer.model" not in names:
            self._abort(context, "GetTokenizer", grpc.StatusCode.FAILED_PRECONDITION,
                        f"no tokenizer files readable by the scheduler in {str(folder)!r} "
                        "(the worker's model directory): start the gateway with "
                        "--model-path, or give the scheduler the model volume")
        data = _zip(folder, names)
        digest = hashlib.sha256(data).hexdigest()
        log.info("tokenizer_sent", files=names, bytes=len(data))
        RPCS.labels("GetTokenizer", "OK").inc()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield cpb.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK_BYTES],
                                        sha256=digest if last else "")

    def StartProfile(self, request, context):
        self._abort(context, "StartProfile", grpc.StatusCode.UNIMPLEMENTED,
                    "profiling over the engine protocol is not supported")

    def StopProfile(self, request, context):
        self._abort(context, "StopProfile", grpc.StatusCode.UNIMPLEMENTED,
                    "profiling over the engine protocol is not supported")


def _zip(folder: Path, names: list[str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in names:
            # a fixed date: the same files give the same bytes and fingerprint
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, (folder / name).read_bytes())
    return buf.getvalue()


def _read_json(folder: str, name: str) -> dict:
    try:
        data = json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return {}  # not readable here (the scheduler may not mount the model): facts left out
    return data if isinstance(data, dict) else {}


def _int_or(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else default
