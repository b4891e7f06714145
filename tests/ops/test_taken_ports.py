"""A port a door cannot have stops `trio-pd serve` before anything is served, for every door
(the data port, the admin, probe and metrics listeners) and with one process or several: one
line naming the door, the address, the reason and the flags that move it, exit status 1, no
traceback, and no socket left listening (`serve/doors.py`, docs/operations.md)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import start_serve
from tests.ops.sockets import listeners

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
