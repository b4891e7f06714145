"""`--health-check-port` on a real `trio-pd serve --workers 2` (issue 21, SMG 1.13): every
process answers the probes on its own copy of the port, and only the probes (through the drain,
when the data port no longer accepts connections at all: tests/ops/test_doors.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx2
import trio

from tests.conftest import start_engine
from tests.ops.serve import clients_per_process, free_port, start_serve
from tests.ops.sockets import listeners
from tests.router.helpers import generate_body

LOOSE = 10.0


async def test_the_probe_listener_with_two_processes(nursery: trio.Nursery, tmp_path: Path) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    probe_port = free_port()
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--workers", "2",
        "--health-check-port", str(probe_port), "--shutdown-grace-period-secs", "30",
    )  # fmt: skip
    probe_url = f"http://127.0.0.1:{probe_port}"
    probes: dict[int, httpx2.AsyncClient] = {}
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE * 3) as data:
            await router.wait_ready(data)
            probes = await clients_per_process(router, url=probe_url)  # each process its copy
            assert len(probes) == 2
            for pid, probe in probes.items():
                health = await probe.get("/health")
                assert health.status_code == 200 and health.json()["pid"] == pid
                ready = await probe.get("/readiness")
                assert ready.status_code == 200 and ready.json()["status"] == "ready"
                # Only the probes: not generation, not the control routes, not metrics.
                for method, path in (("POST", "/generate"), ("GET", "/workers"),
                                     ("GET", "/metrics")):  # fmt: skip
                    refused = await probe.request(method, path, json=generate_body())
                    assert refused.status_code == 404, (path, refused.text)
                    assert refused.json()["error"]["code"] == 404
            assert not decode.events.find("request_start")  # nothing reached an engine

            router.signal(signal.SIGTERM)
        assert await router.wait_exit() == 0
    finally:
        for client in probes.values():
            await client.aclose()
        await router.stop()
    assert not listeners(probe_port)
    assert f"probes on http://127.0.0.1:{probe_port}" in router.log()
