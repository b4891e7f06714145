"""The four doors of a real `trio-pd serve` (the data port, the admin, probe and metrics
listeners; `serve/doors.py`), each case run for every door, with one process and with two.

A port a door cannot have stops the start before anything is served: one line naming the door,
the address, the reason and the flags that move it, exit status 1, no traceback, no socket left
listening (docs/operations.md). Once the drain has closed the data port, every other door still
answers, until the process exits; then none is left listening. What a door serves beyond that is
tested beside it: tests/ops/test_door.py (admin), test_probe_listener.py, test_metrics_listener.py.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import free_port, start_serve
from tests.ops.sockets import listeners
from tests.router.helpers import generate_body, read_sse

EXIT_SECS = 90.0  # a hang guard: a cold start imports everything, slowly on a busy machine

# door -> (the flags that put it on the taken port, what the error names it, its hint)
DOORS = {
    "data": ((), "requests", "(--host, --port)"),
    "admin": (("--admin-port",), "the admin API", "(--admin-port, --admin-host;"),
    "metrics": (("--prometheus-port",), "metrics", "(--prometheus-port, --prometheus-host)"),
    "probes": (("--health-check-port",), "probes", "(--health-check-port)"),
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("door", sorted(DOORS))
async def test_a_taken_port_stops_the_start_with_one_line(
    nursery: trio.Nursery, tmp_path: Path, door: str, workers: int
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    flags, serves, hint = DOORS[door]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mine = listeners(port)
        assert len(mine) == 1  # provoked: the port is taken, by this socket only
        extra = [*flags, str(port)] if flags else []
        router = await start_serve(
            [prefill], [decode], str(tmp_path / "router.log"),
            *extra, "--workers", str(workers),
            port=port if door == "data" else None,
        )  # fmt: skip
        try:
            assert await router.wait_exit(within=EXIT_SECS) == 1
        finally:
            await router.stop()
        assert listeners(port) == mine  # nothing else got it
    log = router.log()
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert errors == [
        f"trio-pd serve: error: cannot listen for {serves} on 127.0.0.1:{port}: "
        f"[Errno 98] Address already in use {hint}" + errors[0].partition(hint)[2]
    ], log
    assert "Traceback" not in log and "routing on" not in log, log
    for other in (router.port, router.metrics_port, router.admin_port):
        if other is not None and other != port:  # every door bound before is closed again
            assert not listeners(other), other


@pytest.mark.parametrize("workers", [1, 2])
async def test_every_side_door_answers_through_the_drain(
    nursery: trio.Nursery, tmp_path: Path, workers: int
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    probe_port = free_port()
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--workers", str(workers),
        "--health-check-port", str(probe_port), "--shutdown-grace-period-secs", "60",
    )  # fmt: skip
    assert router.admin_port is not None and router.metrics_port is not None
    side = {
        "admin": f"http://127.0.0.1:{router.admin_port}",
        "probes": f"http://127.0.0.1:{probe_port}",
        "metrics": f"http://127.0.0.1:{router.metrics_port}",
    }
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=EXIT_SECS) as data:
            await router.wait_ready(data)
            # A stream surely running through the drain: held after its first token until the
            # test lets it go (`hold@1tok`), whatever the machine's speed.
            body = generate_body(stream=True, max_new_tokens=8, sim_fault="decode:hold@1tok")
            async with data.stream("POST", "/generate", json=body) as stream:
                assert stream.status_code == 200
                router.signal(signal.SIGTERM)
                with trio.fail_after(EXIT_SECS):  # provoked: the drain closed the data port
                    while listeners(router.port):
                        await trio.sleep(0.05)
                with pytest.raises(httpx2.ConnectError):
                    async with httpx2.AsyncClient(base_url=router.url) as late:
                        await late.get("/health")
                for name, url in side.items():  # every other door still answers
                    async with httpx2.AsyncClient(base_url=url, timeout=EXIT_SECS) as client:
                        if name == "metrics":
                            page = await client.get("/metrics")
                            assert page.status_code == 200 and "trio_pd_" in page.text
                            continue
                        assert (await client.get("/health")).status_code == 200, name
                        ready = await client.get("/readiness")
                        assert ready.status_code == 503, name
                        assert ready.json()["reason"] == "draining", name
                assert not decode.events.find("request_end")  # the stream is still running
                decode.state.release_held()
                events = await read_sse(stream)
            assert events[-1] == "[DONE]"
        assert await router.wait_exit(within=EXIT_SECS) == 0
    finally:
        await router.stop()
    for port in (router.port, router.admin_port, probe_port, router.metrics_port):
        assert not listeners(port), port
    log = router.log()
    assert f"admin API on {side['admin']}" in log and f"probes on {side['probes']}" in log
    assert f"metrics on {side['metrics']}/metrics" in log
