"""A real OTLP/gRPC trace receiver for the tracing tests: what a collector would be sent.

A grpcio server on 127.0.0.1 implementing the OTLP `TraceService.Export` (the protobuf classes
come with `opentelemetry-proto`); every exported span is decoded into an `ExportedSpan` with
hex ids, plain attribute values and its resource's attributes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import attrs
import grpc
import trio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

KINDS = {
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
}
STATUSES = {Status.STATUS_CODE_UNSET: "unset", Status.STATUS_CODE_OK: "ok"}
STATUSES[Status.STATUS_CODE_ERROR] = "error"


@attrs.frozen
class ExportedSpan:
    name: str
    trace_id: str  # 32 hex digits, as in a traceparent
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    kind: str
    attributes: dict[str, Any]
    status: str
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int

    def children(self, spans: list[ExportedSpan]) -> list[ExportedSpan]:
        return [s for s in spans if s.parent_id == self.span_id and s.trace_id == self.trace_id]


def value_of(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def attributes_of(pairs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in pairs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every span exported to it (gRPC calls arrive on the server's threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ExportedSpan] = []
        self.exports = 0  # Export calls received
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:
        spans = []
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ExportedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=KINDS.get(span.kind, str(span.kind)),
                            attributes=attributes_of(span.attributes),
                            status=STATUSES.get(span.status.code, str(span.status.code)),
                            events=[(e.name, attributes_of(e.attributes)) for e in span.events],
                            resource=resource,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.exports += 1
            self._spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ExportedSpan]:
        with self._lock:
            return list(self._spans)

    def trace_of(self, request_id: str) -> list[ExportedSpan]:
        """Every span of the trace whose `http_request` span has this request id."""
        spans = self.spans()
        roots = {
            s.trace_id
            for s in spans
            if s.name == "http_request" and s.attributes.get("request_id") == request_id
        }
        return [s for s in spans if s.trace_id in roots]

    async def wait_for(
        self, check: Callable[[list[ExportedSpan]], bool], what: str, timeout: float = 10.0
    ) -> list[ExportedSpan]:
        """Every span received, once `check` holds for them (the batch processor exports every
        500 ms); fails the test after `timeout`."""
        with trio.move_on_after(timeout):
            while not check(spans := self.spans()):
                await trio.sleep(0.05)
            return spans
        raise AssertionError(f"not exported within {timeout} s: {what}; got {self.spans()}")


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver
    finally:
        server.stop(grace=None)
