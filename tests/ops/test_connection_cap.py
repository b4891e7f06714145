"""The cap on client connections (issue 26, N6) on a real `trio-pd serve` process.

Nothing bounded client connections, and each idle one holds a file descriptor for 30 s (90 s
after a request): at the router's limit of 2,048, 2,098 idle connections made every `accept`
fail, the probe and admin listeners' too, for 40+ s. Here the router runs with 512 descriptors
(soft and hard: it cannot raise them) and 600 idle connections are opened: the data port's cap,
derived from the limit, refuses those past it at once (a 503 envelope, counted), so the probe
and admin listeners still answer, a new data request is refused cleanly, and the data plane
serves again once the idle connections close.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx2
import orjson
import trio

from tests.conftest import start_engine
from tests.ops.serve import free_port, start_serve
from tests.ops.sockets import LISTEN
from tests.router.helpers import generate_body
from trio_pd.serve.fd_budget import FDS_PER_CLIENT, RESERVED_FDS

LOOSE = 10.0
NOFILE = 512
CAP = (NOFILE - RESERVED_FDS) // FDS_PER_CLIENT  # 85: the derived default
IDLE = 600  # more than the router has descriptors


async def refused_counted(metrics_url: str) -> float:
    async with httpx2.AsyncClient(timeout=LOOSE) as client:
        page = (await client.get(f"{metrics_url}/metrics")).text
    for line in page.splitlines():
        if line.startswith("trio_pd_client_connections_refused_total"):
            return float(line.split()[-1])
    raise AssertionError("no trio_pd_client_connections_refused_total")


def accept_queue(port: int) -> int:
    """Connections waiting in the kernel for the listener on 127.0.0.1:`port` to accept them
    (a listening socket's rx_queue in /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[1].partition(":")[2], 16) == port:
                return int(fields[4].partition(":")[2], 16)
    raise AssertionError(f"nothing listens on {port}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def doors_answer(admin_url: str, probe_port: int) -> None:
    """The probe and admin listeners answer (without the cap they had no descriptor left to
    accept a connection with: 40+ s of timeouts)."""
    async with httpx2.AsyncClient(timeout=LOOSE) as other:
        probe = await other.get(f"http://127.0.0.1:{probe_port}/health")
        assert probe.status_code == 200
        assert (await other.get(f"{admin_url}/workers")).status_code == 200


async def read_all(stream: trio.SocketStream) -> bytes:
    """Everything the router sends before it closes (it must close within LOOSE)."""
    data = b""
    with trio.fail_after(LOOSE):
        try:
            while chunk := await stream.receive_some(65536):
                data += chunk
        except trio.BrokenResourceError:  # a reset after the answer: what came still counts
            pass
    return data


async def test_idle_connections_past_the_cap_leave_the_probe_and_admin_doors_alive(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    probe_port = free_port()
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"),
        "--health-check-port", str(probe_port), "--header-read-timeout-secs", "300",
        nofile=NOFILE,
    )  # fmt: skip
    idle: list[trio.SocketStream] = []
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as data:
            await router.wait_ready(data)
            assert (await data.post("/generate", json=generate_body())).status_code == 200
            # Idle connections, each a descriptor in the router while it keeps it open.
            for _ in range(IDLE):
                idle.append(await trio.open_tcp_stream("127.0.0.1", router.port))
            pid = router.process.pid
            with trio.fail_after(LOOSE * 3):  # the router took all it could from its queue
                while accept_queue(router.port) and open_fds(pid) < NOFILE - 16:
                    await trio.sleep(0.05)
            await doors_answer(router.admin_url, probe_port)
            # A new data connection is refused at once, with the 503 envelope: the router has
            # taken every connection before it from its accept queue (in order).
            fresh = await trio.open_tcp_stream("127.0.0.1", router.port)
            answer = await read_all(fresh)
            await fresh.aclose()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), answer
            assert b"retry-after: 1" in head and b"connection: close" in head
            error = orjson.loads(body)["error"]
            assert error["code"] == 503 and "--max-client-connections" in error["message"]
            assert await refused_counted(router.metrics_url) >= IDLE - CAP + 1
            await doors_answer(router.admin_url, probe_port)  # with every connection in
            started = len(prefill.events.find("request_start"))
            async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as new:
                try:  # (`data` keeps its connection from before: it is served as ever)
                    refused = await new.post("/generate", json=generate_body())
                    assert refused.status_code == 503, refused.text  # or a closed connection
                except httpx2.TransportError:
                    pass
            assert len(prefill.events.find("request_start")) == started  # no worker saw it
            # The idle connections close: the data plane serves again.
            for stream in idle:
                await stream.aclose()
            idle.clear()
            with trio.fail_after(LOOSE * 3):
                while True:
                    try:
                        again = await data.post("/generate", json=generate_body())
                    except httpx2.TransportError:
                        again = None
                    if again is not None and again.status_code == 200:
                        break
                    await trio.sleep(0.1)
        assert "refused" in router.log() and "--max-client-connections" in router.log()
    finally:
        for stream in idle:
            await stream.aclose()
        await router.stop()


async def test_an_explicit_cap_refuses_the_next_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--max-client-connections", "3"
    )
    held: list[trio.SocketStream] = []
    try:
        await router.wait_ready()  # its client has closed: no connection is left open
        with trio.fail_after(LOOSE):
            while await refused_counted(router.metrics_url) != 0:
                await trio.sleep(0.1)
        held = [await trio.open_tcp_stream("127.0.0.1", router.port) for _ in range(3)]
        for stream in held:  # each served: the cap counts connections, not requests
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        fourth = await trio.open_tcp_stream("127.0.0.1", router.port)
        assert (await read_all(fourth)).startswith(b"HTTP/1.1 503")
        await fourth.aclose()
        assert await refused_counted(router.metrics_url) == 1
        await held.pop().aclose()  # one closes: one more may come
        with trio.fail_after(LOOSE):
            while True:
                fifth = await trio.open_tcp_stream("127.0.0.1", router.port)
                await fifth.send_all(
                    b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
                served = (await read_all(fifth)).startswith(b"HTTP/1.1 200")
                await fifth.aclose()
                if served:
                    break
                await trio.sleep(0.1)
    finally:
        for stream in held:
            await stream.aclose()
        await router.stop()


def soft_fd_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


async def test_the_soft_fd_limit_is_raised_to_the_hard_one_and_the_cap_follows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Started at 300 under a hard limit of 600, the router runs at 600, so its derived cap is
    (600 - 256) / 3 = 114 connections, not (300 - 256) / 3 = 14."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), nofile=(300, 600))
    held: list[trio.SocketStream] = []
    try:
        await router.wait_ready()
        assert soft_fd_limit(router.process.pid) == 600
        cap = (600 - RESERVED_FDS) // FDS_PER_CLIENT
        held = [await trio.open_tcp_stream("127.0.0.1", router.port) for _ in range(cap + 5)]
        with trio.fail_after(LOOSE * 3):  # the router took them all from its queue
            while accept_queue(router.port):
                await trio.sleep(0.05)
        # The cap is 114, not 14 (one more if wait_ready's closed connection still counted).
        assert 5 <= await refused_counted(router.metrics_url) <= 6
    finally:
        for stream in held:
            await stream.aclose()
        await router.stop()
