"""OpenTelemetry tracing (`--enable-trace`): the spans a real collector receives over OTLP/gRPC,
and the `traceparent` each engine received, checked against each other.

Every test runs a real router against simulator engines and a real OTLP gRPC receiver
(`tests/otlp_receiver.py`) on 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.otlp_receiver import ExportedSpan, Receiver, otlp_receiver
from tests.router.fleet_tools import build_cluster, who_started
from tests.router.helpers import generate_body, leave_when, read_sse
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import RetryConfig
from trio_pd.edge.lifespan import start_tracing

LOOSE = 10.0
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
RETRY = RetryConfig(max_retries=3, initial_backoff_ms=1, max_backoff_ms=5, jitter_factor=0.0)


async def traced_cluster(nursery: trio.Nursery, receiver: Receiver, **options) -> Cluster:
    return await start_cluster(
        nursery, enable_trace=True, otlp_traces_endpoint=receiver.endpoint, **options
    )


def one(spans: list[ExportedSpan], name: str, **attributes) -> ExportedSpan:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, f"{len(found)} {name} spans with {attributes} in {spans}"
    return found[0]


def complete(rid: str, attempts: int = 1):
    """A check: the request's span and each attempt's span with its two legs were exported."""

    def check(spans: list[ExportedSpan]) -> bool:
        mine = {s.trace_id for s in spans if s.attributes.get("request_id") == rid}
        trace = [s for s in spans if s.trace_id in mine]
        names = sorted(s.name for s in trace)
        return names == sorted(
            ["http_request"] + ["pd_attempt", "pd_prefill", "pd_decode"] * attempts
        )

    return check


def traceparent_seen(engine, rid: str) -> list[str | None]:
    """The `traceparent` of every request for `rid` this engine received, in arrival order."""
    return [r["headers"].get("traceparent") for r in engine.events.find("request_start", rid=rid)]


def parent_header(span: ExportedSpan) -> str:
    """The traceparent naming `span` as the parent, less its flags (sampled; the SDK may add
    W3C's "random trace id" bit to a trace it started)."""
    return f"00-{span.trace_id}-{span.span_id}"


def ids_seen(engine, rid: str) -> list[str | None]:
    """`traceparent_seen` less the flags (compare with `parent_header`); flags must say sampled."""
    seen = traceparent_seen(engine, rid)
    assert all(int(tp[-2:], 16) & 1 for tp in seen if tp is not None)
    return [tp[:-3] if tp is not None else None for tp in seen]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_request_attempt_and_leg_spans_link_up_and_reach_the_engines(
    nursery: trio.Nursery, stream: bool
) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = f"traced-{stream}"
        headers = {"x-request-id": rid, "traceparent": CLIENT_PARENT, "tracestate": "vendor=x"}
        async with cluster.client.stream(
            "POST", "/generate", json=generate_body(stream=stream), headers=headers
        ) as response:
            assert response.status_code == 200
            if stream:
                assert (await read_sse(response))[-1] == "[DONE]"
            else:
                await response.aread()
        spans = await receiver.wait_for(complete(rid), f"the spans of {rid}")
        request = one(spans, "http_request", request_id=rid)
        attempt = one(spans, "pd_attempt")
        prefill, decode = one(spans, "pd_prefill"), one(spans, "pd_decode")

        # The client's trace is the parent; attempt under request; both legs under the attempt.
        assert (request.trace_id, request.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
        assert request.kind == "server"
        assert attempt.parent_id == request.span_id
        assert {s.span_id for s in attempt.children(spans)} == {prefill.span_id, decode.span_id}
        assert {prefill.kind, decode.kind} == {"client"}
        assert {s.trace_id for s in spans if s.trace_id == CLIENT_TRACE} == {CLIENT_TRACE}

        # Each engine received its own leg's span context, and the client's tracestate.
        assert ids_seen(cluster.prefill, rid) == [parent_header(prefill)]
        assert ids_seen(cluster.decode, rid) == [parent_header(decode)]
        for engine in (cluster.prefill, cluster.decode):
            assert engine.events.find("request_start", rid=rid)[0]["headers"]["tracestate"] == (
                "vendor=x"
            )

        assert request.attributes | {"latency": 0} == {
            "method": "POST",
            "uri": "/generate",
            "route": "/generate",
            "request_id": rid,
            "status_code": 200,
            "latency": 0,
            "model": "-",
            "attempts": 1,
            "prefill": cluster.router.fleet.workers("prefill")[0].id,
            "decode": cluster.router.fleet.workers("decode")[0].id,
        }
        assert request.attributes["latency"] > 0
        assert attempt.attributes == {"attempt": 1, "outcome": "ok"}
        for span, engine in ((prefill, cluster.prefill), (decode, cluster.decode)):
            assert span.attributes["worker_url"] == engine.url
            assert span.attributes["outcome"] == "ok"
            assert span.attributes["status_code"] == 200
            assert "cancel_cause" not in span.attributes
            assert span.status == "unset"
            assert request.start_ns <= span.start_ns <= span.end_ns <= request.end_ns
        assert request.resource["service.name"] == "trio-pd"
        await cluster.client.aclose()


async def test_a_request_without_traceparent_starts_a_trace(nursery: trio.Nursery) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = "no-parent"
        response = await cluster.client.post(
            "/generate", json=generate_body(), headers={"x-request-id": rid}
        )
        assert response.status_code == 200
        spans = await receiver.wait_for(complete(rid), "the request's spans")
        request = one(spans, "http_request", request_id=rid)
        assert request.parent_id == ""
        assert ids_seen(cluster.decode, rid) == [parent_header(one(spans, "pd_decode"))]
        await cluster.client.aclose()


async def test_an_unsampled_client_trace_is_propagated_but_not_exported(
    nursery: trio.Nursery,
) -> None:
    """The client's sampling decision holds (parent-based sampling, SMG's SDK default): no spans,
    yet each worker still gets its leg's span id in the client's trace, flagged unsampled."""
    unsampled_trace = "0af7651916cd43dd8448eb211c80319c"
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        for rid, parent in (
            ("unsampled", f"00-{unsampled_trace}-b7ad6b7169203331-00"),
            ("sampled", CLIENT_PARENT),
        ):
            headers = {"x-request-id": rid, "traceparent": parent}
            response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
            assert response.status_code == 200
        # Spans leave in the order they ended: once the later request's are in, the earlier's
        # would be too.
        spans = await receiver.wait_for(complete("sampled"), "the sampled request's spans")
        assert {s.trace_id for s in spans} == {CLIENT_TRACE}
        engines = (cluster.prefill, cluster.decode)
        seen = {tp for e in engines for tp in traceparent_seen(e, "unsampled")}
        assert len(seen) == 2  # one span id per leg
        for traceparent in seen:
            _, trace_id, span_id, flags = traceparent.split("-")
            assert (trace_id, flags) == (unsampled_trace, "00")
            assert span_id != "b7ad6b7169203331"
        await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_failing_prefill_shows_decode_cancelled_because_of_it(
    nursery: trio.Nursery, stream: bool
) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = f"prefill-fails-{stream}"
        response = await cluster.client.post(
            "/generate",
            json=generate_body(stream=stream, sim_fault="prefill:500@200"),
            headers={"x-request-id": rid},
        )
        assert response.status_code == 502
        # What was provoked: decode was connected and waiting when prefill failed, then closed.
        assert cluster.prefill.events.find("fault", rid=rid)
        assert cluster.decode.events.find("room_registered", rid=rid)
        await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)

        spans = await receiver.wait_for(complete(rid), "the failed request's spans")
        prefill, decode = one(spans, "pd_prefill"), one(spans, "pd_decode")
        assert prefill.attributes["outcome"] == "failed"
        assert prefill.attributes["failure_kind"] == "status"
        assert prefill.attributes["status_code"] == 500
        assert prefill.status == "error"
        assert decode.attributes["outcome"] == "cancelled"
        assert decode.attributes["cancel_cause"] == "prefill_failed"
        assert decode.status == "unset"  # a victim, not a failure of its own
        assert decode.end_ns >= prefill.end_ns - 1_000_000  # cancelled once prefill had failed
        assert one(spans, "pd_attempt").attributes["outcome"] == "prefill_failed"
        request = one(spans, "http_request", request_id=rid)
        assert request.attributes["status_code"] == 502
        assert request.status == "error"
        assert ids_seen(cluster.decode, rid) == [parent_header(decode)]
        await cluster.client.aclose()


async def test_a_retry_shows_as_a_second_attempt_with_its_own_legs(nursery: trio.Nursery) -> None:
    with otlp_receiver() as receiver:
        cluster = await build_cluster(
            nursery,
            prefills=[{"faults": ("prefill:500",)}, {}],
            retry=RETRY,
            enable_trace=True,
            otlp_traces_endpoint=receiver.endpoint,
        )
        bad, good = cluster.prefills
        retried = None
        for i in range(4):  # round robin sends every other first attempt to the bad prefill
            rid = f"retry-{i}"
            response = await cluster.client.post(
                "/generate", json=generate_body(), headers={"x-request-id": rid}
            )
            assert response.status_code == 200
            if who_started(cluster.prefills, rid) == [0, 1]:
                retried = rid
                break
        assert retried is not None, "no request was retried"

        spans = receiver.trace_of(retried)
        spans = await receiver.wait_for(complete(retried, attempts=2), "two attempts")
        spans = receiver.trace_of(retried)
        request = one(spans, "http_request", request_id=retried)
        first = one(spans, "pd_attempt", attempt=1)
        second = one(spans, "pd_attempt", attempt=2)
        assert first.parent_id == second.parent_id == request.span_id
        assert first.attributes["outcome"] == "prefill_failed"
        assert second.attributes["outcome"] == "ok"
        assert first.end_ns <= second.start_ns
        assert request.attributes["attempts"] == 2
        assert request.attributes["status_code"] == 200
        assert [(name, e["attempt"], e["culprit"]) for name, e in request.events] == [
            ("retry", 1, "prefill")
        ]
        legs = {
            (attempt.attributes["attempt"], leg.name): leg
            for attempt in (first, second)
            for leg in attempt.children(spans)
        }
        assert legs[1, "pd_prefill"].attributes["worker_url"] == bad.url
        assert legs[1, "pd_prefill"].attributes["outcome"] == "failed"
        assert legs[1, "pd_decode"].attributes["cancel_cause"] == "prefill_failed"
        assert legs[2, "pd_prefill"].attributes["worker_url"] == good.url
        assert legs[2, "pd_decode"].attributes["outcome"] == "ok"
        # Each engine got the traceparent of the leg span that called it, attempt by attempt.
        assert ids_seen(bad, retried) == [parent_header(legs[1, "pd_prefill"])]
        assert ids_seen(good, retried) == [parent_header(legs[2, "pd_prefill"])]
        assert ids_seen(cluster.decode, retried) == [
            parent_header(legs[1, "pd_decode"]),
            parent_header(legs[2, "pd_decode"]),
        ]
        await cluster.client.aclose()


async def test_client_gone_shows_both_legs_cancelled_and_499(nursery: trio.Nursery) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = "client-gone"
        gave_up = await leave_when(  # once the prefill (which hangs) has the request
            lambda: cluster.client.post(
                "/generate",
                json=generate_body(sim_fault="prefill:hang"),
                headers={"x-request-id": rid},
            ),
            lambda: cluster.prefill.events.wait_for("request_start", timeout=LOOSE, rid=rid),
        )
        assert gave_up.cancelled_caught
        await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
        spans = await receiver.wait_for(complete(rid), "the abandoned request's spans")
        for leg in ("pd_prefill", "pd_decode"):
            assert one(spans, leg).attributes["outcome"] == "cancelled"
            assert one(spans, leg).attributes["cancel_cause"] == "client_gone"
        request = one(spans, "http_request", request_id=rid)
        assert request.attributes["status_code"] == 499
        assert request.attributes["cancel_cause"] == "client_gone"
        await cluster.client.aclose()


async def test_client_gone_before_its_body_arrived_is_a_499_not_an_error(
    nursery: trio.Nursery,
) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = "half-a-body"
        host, port = cluster.url.removeprefix("http://").split(":")
        conn = await trio.open_tcp_stream(host, int(port))
        await conn.send_all(
            b"POST /generate HTTP/1.1\r\nhost: x\r\nx-request-id: half-a-body\r\n"
            b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"text": '
        )
        await trio.sleep(0.5)  # the request (and its span) has begun: it waits for the body
        await conn.aclose()
        spans = await receiver.wait_for(
            lambda s: any(x.attributes.get("request_id") == rid for x in s), "the 499's span"
        )
        request = one(spans, "http_request", request_id=rid)
        assert request.attributes["status_code"] == 499
        assert request.status == "unset"  # the client left: not the router's error
        assert not request.children(spans)
        assert not cluster.prefill.events.find("request_start", rid=rid)
        await cluster.client.aclose()


async def test_bad_input_is_a_request_span_without_attempts(nursery: trio.Nursery) -> None:
    with otlp_receiver() as receiver:
        cluster = await traced_cluster(nursery, receiver)
        rid = "bad-json"
        response = await cluster.client.post(
            "/generate", content=b"{not json", headers={"x-request-id": rid}
        )
        assert response.status_code == 400
        spans = await receiver.wait_for(
            lambda s: any(x.attributes.get("request_id") == rid for x in s), "the 400's span"
        )
        request = one(spans, "http_request", request_id=rid)
        assert request.attributes["status_code"] == 400
        assert "not valid JSON" in request.attributes["error"]
        assert request.status == "unset"  # the client's error, not the router's
        assert not request.children(spans)
        assert not cluster.prefill.events.find("request_start", rid=rid)
        await cluster.client.aclose()


async def test_without_enable_trace_nothing_is_exported_and_no_traceparent_added(
    nursery: trio.Nursery,
) -> None:
    with otlp_receiver() as receiver:
        # The endpoint is set, tracing is not: nothing may reach the receiver.
        cluster = await start_cluster(nursery, otlp_traces_endpoint=receiver.endpoint)
        assert start_tracing(cluster.router.config) is None  # what the lifespan opens
        plain = await cluster.client.post(
            "/generate", json=generate_body(), headers={"x-request-id": "plain"}
        )
        forwarded = await cluster.client.post(
            "/generate",
            json=generate_body(),
            headers={"x-request-id": "forwarded", "traceparent": CLIENT_PARENT},
        )
        assert plain.status_code == forwarded.status_code == 200
        for engine in (cluster.prefill, cluster.decode):
            assert len(engine.events.find("request_start", rid="plain")) == 1
            assert traceparent_seen(engine, "plain") == [None]
            assert traceparent_seen(engine, "forwarded") == [CLIENT_PARENT]  # passed on as is
        await trio.sleep(1.5)  # three times the batch processor's export interval
        assert receiver.exports == 0
        assert receiver.spans() == []
        await cluster.client.aclose()


# -- flags --------------------------------------------------------------------------------------


def serve_args(*extra: str):
    return build_parser().parse_args(["serve", "--prefill", "http://127.0.0.1:1", *extra])


def test_trace_flags_have_smg_names_and_defaults() -> None:
    config = router_config(serve_args())
    assert (config.enable_trace, config.otlp_traces_endpoint) == (False, "localhost:4317")
    config = router_config(serve_args("--enable-trace", "--otlp-traces-endpoint", "otel:4317"))
    assert (config.enable_trace, config.otlp_traces_endpoint) == (True, "otel:4317")
    # Without --enable-trace the endpoint is not checked (as in SMG).
    assert router_config(serve_args("--otlp-traces-endpoint", "nonsense")).enable_trace is False


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("collector", "expected format <host>:<port>"),
        (":4317", "host part cannot be empty"),
        ("collector:0", "port must be a number between 1 and 65535"),
        ("collector:70000", "port must be a number between 1 and 65535"),
        ("http://collector:x", "port must be a number between 1 and 65535"),
    ],
)
def test_a_bad_collector_endpoint_is_a_usage_error(
    endpoint: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        router_config(serve_args("--enable-trace", "--otlp-traces-endpoint", endpoint))
    assert problem in capsys.readouterr().err


def test_enable_trace_without_opentelemetry_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    router_config(serve_args("--enable-trace"))  # installed: fine
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(SystemExit):
        router_config(serve_args("--enable-trace"))
    err = capsys.readouterr().err
    assert "--enable-trace needs OpenTelemetry" in err
    assert "pip install 'trio_pd[trace]'" in err
    router_config(serve_args())  # without the flag nothing is needed


def test_a_router_without_tracing_never_imports_opentelemetry() -> None:
    """The hot path pays nothing, and a router without the `trace` extra still starts."""
    program = (
        "import sys\n"
        "from trio_pd.cli.main import build_parser, router_config\n"
        "from trio_pd.edge.router import build_router\n"
        "from trio_pd.edge.lifespan import start_tracing\n"
        "from trio_pd.serve.run import run\n"
        "args = build_parser().parse_args(['serve', '--prefill', 'http://127.0.0.1:1'])\n"
        "config = router_config(args)\n"
        "build_router(config)\n"
        "assert start_tracing(config) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
