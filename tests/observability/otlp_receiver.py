"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService on a
loopback port, keeping every span it is sent, flattened with its service name."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@dataclass(slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict
    events: list[tuple[str, dict]]
    links: list[tuple[str, str]]  # (trace_id, span_id)


@dataclass(slots=True)
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[ReceivedSpan] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _server: grpc.Server | None = None
    port: int = 0

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=res.get("service.name", ""), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))
        with self._cond:
            self.spans.extend(got)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OtlpReceiver:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Block until predicate(spans) is true (spans arrive on export, not on a
        timer we sleep on); returns a copy of the spans."""
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate(self.spans), timeout=timeout_s)
            spans = list(self.spans)
        if not ok:
            names = sorted({(s.service, s.name) for s in spans})
            raise AssertionError(f"spans did not arrive in {timeout_s}s; got {names}")
        return spans
