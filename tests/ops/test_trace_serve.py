"""`trio-pd serve --enable-trace` as a real process: with `--workers 2` each process exports its
own spans (its exporter made after the spawn), and a SIGTERM flushes them; a collector that is
down costs neither requests nor a prompt exit."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import clients_per_process, free_port, start_serve
from tests.otlp_receiver import otlp_receiver
from tests.router.helpers import generate_body

LOOSE = 10.0
EXIT_SECS = 20.0  # the drain of idle processes, plus the bounded flush (5 s), on a busy box


async def test_each_process_exports_its_own_spans_and_flushes_them_on_sigterm(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    # No timed export (a minute): every span the receiver gets was flushed by the drain.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    with otlp_receiver() as receiver:
        router = await start_serve(
            [prefill], [decode], str(tmp_path / "router.log"), "--workers", "2",
            "--enable-trace", "--otlp-traces-endpoint", receiver.endpoint,
        )  # fmt: skip
        clients = {}
        try:
            await router.wait_ready()
            clients = await clients_per_process(router)
            sent = {}
            for pid, client in clients.items():
                rid = f"via-{pid}"
                response = await client.post(
                    "/generate", json=generate_body(), headers={"x-request-id": rid}
                )
                assert response.status_code == 200
                sent[rid] = pid
            await trio.sleep(1.0)  # twice SMG's export interval: nothing left yet
            assert receiver.spans() == []
            router.signal(signal.SIGTERM)
            assert await router.wait_exit(EXIT_SECS) == 0
        finally:
            for client in clients.values():
                await client.aclose()
            await router.stop()
        for rid, pid in sent.items():
            mine = receiver.trace_of(rid)
            assert sorted(s.name for s in mine) == [
                "http_request", "pd_attempt", "pd_decode", "pd_prefill"
            ]  # fmt: skip
            # Exported by the process that served it, over its own exporter.
            assert {s.resource["process.pid"] for s in mine} == {pid}
            seen = decode.events.find("request_start", rid=rid)[0]["headers"]["traceparent"]
            (leg,) = [s for s in mine if s.name == "pd_decode"]
            assert seen.startswith(f"00-{leg.trace_id}-{leg.span_id}-")
        assert len(sent) == 2


async def test_a_collector_that_is_down_costs_no_request_and_no_exit(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"),
        "--enable-trace", "--otlp-traces-endpoint", nobody,
    )  # fmt: skip
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as client:
            for i in range(3):
                response = await client.post(
                    "/generate", json=generate_body(), headers={"x-request-id": f"down-{i}"}
                )
                assert response.status_code == 200
        assert decode.events.find("request_start", rid="down-2")[0]["headers"]["traceparent"]
        started = trio.current_time()
        router.signal(signal.SIGTERM)
        assert await router.wait_exit(EXIT_SECS) == 0
        assert trio.current_time() - started < EXIT_SECS
        assert "OpenTelemetry tracing on" in router.log()
    finally:
        await router.stop()
