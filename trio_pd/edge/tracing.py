"""OpenTelemetry tracing of PD requests (`--enable-trace`): spans exported over OTLP/gRPC.

What SGLang's router 0.3.2 does (`src/observability/otel_trace.rs`, `src/middleware.rs`), and
what this module keeps of it:

- a TracerProvider with a BatchSpanProcessor (500 ms schedule, batches of 64) and the OTLP
  gRPC exporter; `--otlp-traces-endpoint host:port` gets `http://` in front unless it has a
  scheme (SMG's rule); the W3C trace-context propagator; the SDK's default sampler
  (parent-based, always on; `OTEL_TRACES_SAMPLER` changes it);
- one span per client request named `http_request`, with SMG's attribute names (`method`,
  `uri`, `request_id`, `status_code`, `latency` in microseconds, `error`);
- a `traceparent` sent to the workers.

Where this module goes further, because a PD request is two requests:

- the client's `traceparent`/`tracestate` are honoured: the request span is their child (SMG
  starts a new trace and overwrites the client's header);
- each attempt is a `pd_attempt` span and each leg a `pd_prefill` / `pd_decode` span (kind
  CLIENT) under it, so a retry shows as a second attempt with its own legs;
- each leg's request carries **its own** span context (SMG sends both workers the request
  span's), so a worker's spans hang under the leg that called it;
- a leg span says how the leg ended (`outcome`: ok, failed, cancelled), and when the router
  cancelled it, why (`cancel_cause`: prefill_failed, decode_failed, client_gone, deadline,
  stall, shutdown);
- the request span is ended by the router with the request's outcome (`respond.RequestOutcome`)
  once the client's answer went out, so its status and workers are the access line's and the
  metrics' (one value, one final status).

Cost: nothing when tracing is off (the router holds None and checks it once per request and
once per attempt; this module and OpenTelemetry are not even imported). When it is on, spans
are built at the request's start and end (the legs' ends are read off the finished attempt,
not hooked into the legs), and exported from the batch processor's own thread.

Every router process builds its own provider in its lifespan startup (`lifespan.py`), so with
`--workers N` each spawned process exports its own spans over its own gRPC channel; the spans
of a process are flushed (bounded) when its lifespan ends, after the drain.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import trio
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import trio_pd
from trio_pd.pd.outcome import LegFailure, LegSuccess

if TYPE_CHECKING:
    from trio_pd.pd.attempt import Attempt
    from trio_pd.pd.outcome import AttemptOutcome, LegEnd
    from trio_pd.respond import RequestOutcome

log = logging.getLogger(__name__)

SERVICE_NAME = "trio-pd"  # SMG's is "smg"; OTEL_SERVICE_NAME overrides it
SCHEDULE_DELAY_MILLIS = 500  # SMG's BatchConfig (OTEL_BSP_SCHEDULE_DELAY overrides it)
MAX_BATCH = 64  # (OTEL_BSP_MAX_EXPORT_BATCH_SIZE overrides it)
DROP_WARNING_SECS = 60.0  # "queue full, dropping span" is logged at most this often
FLUSH_SECS = 5.0  # at shutdown, spans still queued get this long to leave
TRACE_HEADERS = (b"traceparent", b"tracestate")


def otlp_url(endpoint: str) -> str:
    """SMG's rule: `host:port` means plain-text gRPC (`http://`); a scheme given is kept."""
    if endpoint.startswith(("http://", "https://")):
        return endpoint
    return "http://" + endpoint


def env_or(name: str, default: int) -> int | None:
    """None (the SDK then reads the standard variable) when `name` is set, else our default."""
    return None if os.environ.get(name) else default


class DropWarnings(logging.Filter):
    """Lets the SDK's "Queue full, dropping Span." through once per `DROP_WARNING_SECS`: with the
    collector down or slow the batch queue fills, and the SDK warns once per dropped span (four
    per request here), which would bury every other log line under load."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -DROP_WARNING_SECS

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue"):  # "Queue full, ..." ("Queue is full" before)
            return True
        now = time.monotonic()
        if now - self.last < DROP_WARNING_SECS:
            return False
        self.last = now
        record.msg = f"{record.msg} (the OTLP collector is down or slow; "
        record.msg += f"this is logged at most every {DROP_WARNING_SECS:g}s)"
        return True


DROP_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")


def quiet_drop_warnings() -> None:
    """Install `DropWarnings` on the SDK's batch-processor loggers (the module moved between
    releases), once per process."""
    for name in DROP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropWarnings) for f in logger.filters):
            logger.addFilter(DropWarnings())


def wall_ns(trio_time: float) -> int:
    """A trio clock reading as Unix nanoseconds (spans carry wall time)."""
    return time.time_ns() - int((trio.current_time() - trio_time) * 1e9)


class Tracing:
    """One router process's tracer, provider and propagator (a lifespan owns it)."""

    def __init__(self, provider: TracerProvider, flush_secs: float = FLUSH_SECS) -> None:
        self.provider = provider
        self.flush_secs = flush_secs
        self.tracer = provider.get_tracer("trio_pd", trio_pd.__version__)
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, endpoint: str, exporter: SpanExporter | None = None) -> Tracing:
        """A provider exporting to the OTLP/gRPC collector at `endpoint` (or to `exporter`).

        Built in the process that serves (never before a fork or spawn): the batch processor's
        thread and the gRPC channel belong to it. `shutdown_on_exit=False`: the lifespan flushes
        with a bounded wait instead of an unbounded one at interpreter exit.
        """
        resource = Resource.create({"process.pid": os.getpid()})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(
                Resource({"service.name": SERVICE_NAME, "service.version": trio_pd.__version__})
            )
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter or OTLPSpanExporter(endpoint=otlp_url(endpoint)),
                schedule_delay_millis=env_or("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MILLIS),
                max_export_batch_size=env_or("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_BATCH),
            )
        )
        quiet_drop_warnings()
        log.info("OpenTelemetry tracing on: exporting spans to %s", otlp_url(endpoint))
        return cls(provider)

    def begin(self, scope: dict[str, Any], request_id: bytes) -> RequestTrace:
        """The span of one client request, a child of the client's trace context if it sent one."""
        carrier = {}
        for name, value in scope["headers"]:
            if name in TRACE_HEADERS:
                carrier[name.decode("latin-1")] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        path = scope["path"]
        query = scope.get("query_string") or b""
        span = self.tracer.start_span(
            "http_request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "method": scope["method"],
                "uri": f"{path}?{query.decode('latin-1')}" if query else path,
                "route": path,
                "request_id": request_id.decode("latin-1"),
            },
        )
        return RequestTrace(self, span, trio.current_time())

    async def shutdown(self) -> None:
        """Export what is queued and stop the exporter, waiting at most `flush_secs`.

        The provider's shutdown blocks (it joins the batch thread, which may be retrying an
        unreachable collector), so it runs in a thread that is left behind if it overstays:
        a router must not hang at exit for its traces.
        """
        with trio.move_on_after(self.flush_secs) as waited:
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)
        if waited.cancelled_caught:
            log.warning("tracing: spans not flushed within %gs; some may be lost", self.flush_secs)


class RequestTrace:
    """The `http_request` span of one client request and the attempts under it."""

    __slots__ = ("span", "started", "tracing")

    def __init__(self, tracing: Tracing, span: Span, started: float) -> None:
        self.tracing = tracing
        self.span = span
        self.started = started

    def attempt(self, number: int, attempt: Attempt) -> AttemptTrace:
        """Spans for one attempt and its two legs, started now; each leg's headers are given
        its own span's `traceparent` (and the client's `tracestate`) in place of the client's."""
        tracer = self.tracing.tracer
        inject = self.tracing.propagator.inject
        span = tracer.start_span(
            "pd_attempt",
            context=set_span_in_context(self.span),
            attributes={"attempt": number},
        )
        inside = set_span_in_context(span)
        legs = []
        for leg in (attempt.prefill, attempt.decode):
            leg_span = tracer.start_span(
                f"pd_{leg.role}",
                context=inside,
                kind=SpanKind.CLIENT,
                attributes={
                    "role": leg.role,
                    "worker_url": leg.url,
                    "worker_id": leg.worker.id,
                    "http_route": attempt.path,
                },
            )
            carrier: dict[str, str] = {}
            inject(carrier, context=set_span_in_context(leg_span))
            leg.headers = [
                *(h for h in leg.headers if h[0] not in TRACE_HEADERS),
                *((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()),
            ]
            legs.append(leg_span)
        return AttemptTrace(span, legs[0], legs[1])

    def retrying(self, number: int, role: str, delay: float) -> None:
        """Attempt `number` failed on its `role` leg and another follows after `delay` s."""
        self.span.add_event(
            "retry", {"attempt": number, "culprit": role, "backoff_ms": round(delay * 1000, 3)}
        )

    def migrating(self, number: int, reason: str, sent: int) -> None:
        """Decode broke mid-stream (`reason`) after `sent` tokens: resume `number` follows."""
        self.span.add_event("migration", {"resume": number, "reason": reason, "sent_tokens": sent})

    def end(self, outcome: RequestOutcome) -> None:
        """End the request span with its outcome (`respond.RequestOutcome`), once the client's
        answer was sent: the status its metrics and access line count (499 when the client left
        first), the route, why it was cancelled and the router's error it ended with. An error
        status, or an error event the router ended a started stream with (`inband_status`),
        of 500 or more marks the span an error."""
        span = self.span
        attributes: dict[str, Any] = {
            "status_code": outcome.status,
            "latency": int((trio.current_time() - self.started) * 1e6),
        }
        route = {
            "model": outcome.model,
            "attempts": outcome.attempts,
            "prefill": outcome.prefill,
            "decode": outcome.decode,
            "migrations": outcome.migrations,
            "cancel_cause": outcome.cancel_cause,
            "error": outcome.error,
        }
        attributes.update((key, value) for key, value in route.items() if value is not None)
        span.set_attributes(attributes)
        worst = max(outcome.status, outcome.inband_status or 0)
        if worst >= 500:
            span.set_status(Status(StatusCode.ERROR, f"status {worst}"))
        span.end()


class AttemptTrace:
    """The spans of one attempt; ended from the legs' state once the attempt is over."""

    __slots__ = ("decode", "prefill", "span")

    def __init__(self, span: Span, prefill: Span, decode: Span) -> None:
        self.span = span
        self.prefill = prefill
        self.decode = decode

    def end(self, ended: AttemptOutcome) -> None:
        """End the legs' spans (at each leg's own end) and the attempt's span."""
        end_leg(self.prefill, ended.prefill)
        end_leg(self.decode, ended.decode)
        culprit = ended.culprit()
        if culprit is not None:
            outcome = f"{culprit.role}_failed"
        elif ended.prefill.cancel_cause is not None or ended.decode.cancel_cause is not None:
            outcome = "cancelled"
        elif ended.decode.result is not None:
            outcome = "ok"
        else:
            outcome = "cancelled"
        self.span.set_attribute("outcome", outcome)
        if culprit is not None:
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        self.span.end()


def end_leg(span: Span, leg: LegEnd) -> None:
    """A leg span's ending: how the leg ended, its status, and the cause if it was cancelled."""
    result = leg.result
    attributes: dict[str, Any] = {}
    if isinstance(result, LegSuccess):
        attributes["outcome"] = "ok"
        attributes["status_code"] = result.status
    elif isinstance(result, LegFailure):
        attributes["outcome"] = "failed"
        attributes["failure_kind"] = result.kind
        attributes["error"] = result.message
        if result.status is not None:
            attributes["status_code"] = result.status
        span.set_status(Status(StatusCode.ERROR, result.message))
    else:
        attributes["outcome"] = "cancelled"
    if leg.cancel_cause is not None:
        attributes["cancel_cause"] = leg.cancel_cause
    span.set_attributes(attributes)
    ended = leg.ended_at if leg.ended_at is not None else leg.cancelled_at
    span.end(end_time=wall_ns(ended) if ended is not None else None)
