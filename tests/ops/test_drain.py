"""Graceful drain of real `trio-pd serve` processes on SIGTERM/SIGINT (issue 10, drain).

A stream in flight across SIGTERM completes intact; new connections are refused; with a short
grace period a long stream ends with an error frame and the decode engine frees its slot; a
second signal ends the grace period at once. One process and `--workers 2`.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx2
import orjson
import pytest
import trio

from tests.conftest import start_cluster, start_engine
from tests.ops.serve import start_serve
from tests.ops.sockets import listeners
from tests.router.helpers import CANCELLED, generate_body
from trio_pd.config import RouterConfig

# A hang guard, never a bound: each wait is for an event (a token, a freed slot, a close).
HANG_SECS = 60.0


async def data_events(
    response: httpx2.Response, seen: list, after: int, started: trio.Event
) -> None:
    """Collect SSE data payloads into `seen`; set `started` once `after` of them arrived."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            seen.append(data if data == "[DONE]" else orjson.loads(data))
            if len(seen) == after:
                started.set()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stream_in_flight_across_sigterm_completes(
    nursery: trio.Nursery, tmp_path: Path, workers: int
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=50.0)
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--workers", str(workers)
    )
    try:
        await router.wait_ready()
        seen: list = []
        started = trio.Event()
        async with httpx2.AsyncClient(base_url=router.url, timeout=30) as client:
            body = generate_body(stream=True, max_new_tokens=30)
            async with client.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                async with trio.open_nursery() as reader:
                    reader.start_soon(data_events, response, seen, 3, started)
                    await started.wait()
                    router.signal(signal.SIGTERM)
                    # New connections are refused while the stream goes on: once the drain
                    # closed the listening sockets (the event waited for, not a guess at when).
                    with trio.fail_after(HANG_SECS):
                        while listeners(router.port):
                            await trio.sleep(0.05)
                    with pytest.raises(httpx2.ConnectError):
                        async with httpx2.AsyncClient(base_url=router.url) as late:
                            await late.post("/generate", json=generate_body())
        assert seen[-1] == "[DONE]"
        assert len(seen) == 31 and all("error" not in e for e in seen[:-1])
        assert await router.wait_exit() == 0
        assert len(decode.events.find("slot_freed", reason="finished")) == 1
        assert "draining" in router.log()
    finally:
        await router.stop()


@pytest.mark.parametrize("second_signal", [False, True], ids=["grace-1s", "second-signal"])
async def test_the_end_of_grace_cuts_streams_with_an_error_frame(
    nursery: trio.Nursery, tmp_path: Path, second_signal: bool
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=50.0)
    grace = "60" if second_signal else "1"
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--shutdown-grace-period-secs", grace
    )
    try:
        await router.wait_ready()
        seen: list = []
        started = trio.Event()
        async with httpx2.AsyncClient(base_url=router.url, timeout=30) as client:
            body = generate_body(stream=True, max_new_tokens=1000)
            async with client.stream(
                "POST", "/generate", json=body, headers={"x-request-id": "long"}
            ) as response:
                assert response.status_code == 200
                async with trio.open_nursery() as reader:
                    reader.start_soon(data_events, response, seen, 3, started)
                    await started.wait()
                    signalled_at = trio.current_time()
                    router.signal(signal.SIGTERM)
                    if second_signal:
                        await trio.sleep(0.5)
                        router.signal(signal.SIGINT)
        ended_after = trio.current_time() - signalled_at
        assert seen[-1] == "[DONE]"
        assert seen[-2]["error"]["code"] == 504
        assert "shut down" in seen[-2]["error"]["message"]
        # Cut before its own end (1,000 tokens 50 ms apart: 50 s, inside the 60 s grace of the
        # second-signal case, so only that signal can have cut it there) and never before the
        # grace or the second signal (a busy machine can only make it later).
        assert 3 < len(seen) < 1000
        assert ended_after >= (0.5 if second_signal else 1.0), ended_after
        freed = await decode.events.wait_for("slot_freed", timeout=HANG_SECS, rid="long")
        assert freed["reason"] in CANCELLED
        assert await router.wait_exit() == 0
    finally:
        await router.stop()


async def test_a_request_cut_before_its_answer_gets_504(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=50.0)
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--shutdown-grace-period-secs", "1"
    )
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url, timeout=30) as client:

            async def signal_soon() -> None:
                await decode.events.wait_for("first_token", timeout=HANG_SECS, rid="json-long")
                router.signal(signal.SIGTERM)

            async with trio.open_nursery() as n:
                n.start_soon(signal_soon)
                response = await client.post(
                    "/generate",
                    json=generate_body(max_new_tokens=1000),
                    headers={"x-request-id": "json-long"},
                )
        assert response.status_code == 504
        assert response.json()["error"]["type"] == "timeout_error"
        await decode.events.wait_for("connection_closed", timeout=HANG_SECS, rid="json-long")
        assert await router.wait_exit() == 0
    finally:
        await router.stop()


async def test_readiness_turns_503_and_new_requests_get_503_while_draining(
    nursery: trio.Nursery,
) -> None:
    """In-process: the drain state as a client on a connection still open sees it."""
    cluster = await start_cluster(nursery)
    assert (await cluster.client.get("/readiness")).status_code == 200
    cluster.router.drain.begin()
    ready = await cluster.client.get("/readiness")
    assert ready.status_code == 503 and ready.json()["reason"] == "draining"
    assert (await cluster.client.get("/liveness")).status_code == 200
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.headers["connection"] == "close"
    assert not cluster.prefill.events.find("request_start")
    await cluster.client.aclose()


def test_grace_period_flag() -> None:
    from trio_pd.cli.main import build_parser, router_config

    args = build_parser().parse_args(["serve", "--shutdown-grace-period-secs", "7"])
    assert router_config(args).shutdown_grace_period_secs == 7
    assert RouterConfig().shutdown_grace_period_secs == 180
