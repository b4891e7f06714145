"""Client CPU per upstream call: an h2c client (the `h2` library on trio sockets) vs trio_pd's
HTTP/1.1 client (trio_pd.upstream.http11, httptools), the measurement behind refusing SMG 1.13's
`--upstream-http2` (docs/smg-1.13.md).

Servers answer instantly in their own processes, so only the client's CPU is counted
(`time.process_time()` around a batch of N small POSTs, divided by N): bench/micro_upstream.py's
asyncio HTTP/1.1 server, and an asyncio h2c server in this file (`--serve-h2`, prior knowledge,
as SMG's h2c to workers). Clients, each running the same batch, alternating, `--repeat` times:

- http11: trio_pd's client, 32 keep-alive connections, one request at a time on each;
- h2c: 32 h2c connections, one stream at a time on each (the same shape);
- h2c-mux: one h2c connection carrying the 32 callers' streams at once (HTTP/2's own case).

The h2c client does what any Python one must: the h2 state machine fed from a reader task per
connection, a channel per stream, flow-control credit returned as data arrives (with a 16 MiB
window, so WINDOW_UPDATEs are rare). Scenarios: json (a small JSON answer) and sse (64 SSE
events per answer, each its own DATA frame or HTTP chunk, in one burst).

    .venv/bin/python -m bench.upstream_http2 [--quick] [--repeat 2] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import trio

from bench.harness.output import print_flush, table, write_result
from bench.harness.procs import HOST, Proc, free_port
from bench.micro_upstream import CONNECTIONS, EVENT, EVENTS, JSON_BODY, open_http11
from bench.stats import median

SCENARIOS = ("json", "sse")
# items/call: DATA frames read (h2c) or network reads (http11) per answer.
CLIENTS = ("http11", "h2c", "h2c-mux")
WINDOW = 16 * 1024 * 1024
BODY = b'{"text":"hello","sampling_params":{"max_new_tokens":64},"stream":true}'

# -- the h2c server (its own process) -----------------------------------------------------------


class _H2Server(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(WINDOW)
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.paths: dict[int, bytes] = {}
        self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.paths[event.stream_id] = dict(event.headers)[b":path"]
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.answer(event.stream_id, self.paths.pop(event.stream_id))
        self.transport.write(self.conn.data_to_send())

    def answer(self, stream_id: int, path: bytes) -> None:
        if path == b"/json":
            length = str(len(JSON_BODY)).encode()
            head = [(b":status", b"200"), (b"content-type", b"application/json"),
                    (b"content-length", length), (b"server", b"micro")]  # fmt: skip
            self.conn.send_headers(stream_id, head)
            self.conn.send_data(stream_id, JSON_BODY, end_stream=True)
            return
        head = [
            (b":status", b"200"),
            (b"content-type", b"text/event-stream"),
            (b"server", b"micro"),
        ]
        self.conn.send_headers(stream_id, head)
        for _ in range(EVENTS):
            self.conn.send_data(stream_id, EVENT)
        self.conn.send_data(stream_id, b"data: [DONE]\n\n", end_stream=True)


def serve_h2(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_H2Server, HOST, port, backlog=512)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the h2c client ---------------------------------------------------------------------------


class H2cConnection:
    """One h2c connection: a reader task feeds h2 and hands each stream's events to its caller."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.authority = f"{HOST}:{port}".encode()
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.lock = trio.Lock()
        self.waiting: dict[int, trio.MemorySendChannel[Any]] = {}

    async def start(self, nursery: trio.Nursery) -> None:
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(WINDOW)
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        await self.flush()
        nursery.start_soon(self.read)

    async def flush(self) -> None:
        async with self.lock:
            data = self.conn.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def read(self) -> None:
        while data := await self.stream.receive_some(65536):
            for event in self.conn.receive_data(data):
                stream_id = getattr(event, "stream_id", None)
                if isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                if stream_id in self.waiting:
                    self.waiting[stream_id].send_nowait(event)
            await self.flush()

    async def request(self, path: bytes, body: bytes) -> int:
        send, receive = trio.open_memory_channel[Any](math.inf)
        async with self.lock:
            stream_id = self.conn.get_next_available_stream_id()
            self.waiting[stream_id] = send
            head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", self.authority),
                    (b":path", path), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", b"0123456789abcdef0123456789abcdef")]  # fmt: skip
            self.conn.send_headers(stream_id, head)
            self.conn.send_data(stream_id, body, end_stream=True)
            await self.stream.send_all(self.conn.data_to_send())
        items, status = 0, None
        async for event in receive:
            if isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers)[b":status"]
            elif isinstance(event, h2.events.DataReceived):
                items += 1
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                break
        del self.waiting[stream_id]
        assert status == b"200", status
        return items


Call = Callable[[], Awaitable[int]]


async def open_calls(
    client: str, ports: dict[str, int], path: bytes, nursery: trio.Nursery
) -> tuple[list[Call], list[Any]]:
    """The 32 callers' `call()`s and what to close after the batch."""
    if client == "http11":
        opened = [await open_http11(ports["http11"], path, BODY) for _ in range(CONNECTIONS)]
        return [call for call, _ in opened], [conn for _, conn in opened]
    count = CONNECTIONS if client == "h2c" else 1
    conns = []
    for _ in range(count):
        connection = H2cConnection(await trio.open_tcp_stream(HOST, ports["h2c"]), ports["h2c"])
        await connection.start(nursery)
        conns.append(connection)

    def call_on(connection: H2cConnection) -> Call:
        return lambda: connection.request(path, BODY)

    return [call_on(conns[i % count]) for i in range(CONNECTIONS)], [c.stream for c in conns]


async def run_batch(client: str, scenario: str, ports: dict[str, int], requests: int) -> dict:
    async with trio.open_nursery() as readers:
        calls, closers = await open_calls(client, ports, b"/" + scenario.encode(), readers)
        for call in calls:  # warm up every caller
            await call()
        counts = [requests // CONNECTIONS + (i < requests % CONNECTIONS) for i in range(len(calls))]
        items = 0

        async def worker(call: Call, count: int) -> None:
            nonlocal items
            for _ in range(count):
                got = await call()  # (`items += await ...` would read `items` before the await)
                items += got

        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for call, count in zip(calls, counts, strict=True):
                nursery.start_soon(worker, call, count)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        readers.cancel_scope.cancel()  # the h2c readers first: then their sockets may close
    for closer in closers:
        await closer.aclose()
    return {
        "client": client, "scenario": scenario, "requests": requests, "cpu_s": round(cpu, 4),
        "us_per_call": round(cpu / requests * 1e6, 2), "items_per_call": round(items / requests, 2),
        "calls_per_s": round(requests / wall, 1),
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for scenario in SCENARIOS:
        base = median(
            r["us_per_call"] for r in runs if (r["client"], r["scenario"]) == ("http11", scenario)
        )
        for client in CLIENTS:
            mine = [r for r in runs if r["client"] == client and r["scenario"] == scenario]
            per_call = median(r["us_per_call"] for r in mine)
            rows.append({
                "scenario": scenario, "client": client, "requests": mine[0]["requests"],
                "us/call": per_call,
                "us/call runs": " ".join(f"{r['us_per_call']:.1f}" for r in mine),
                "items/call": median(r["items_per_call"] for r in mine),
                "calls/s": median(r["calls_per_s"] for r in mine),
                "vs http11": f"{per_call / base:.2f}x" if base and per_call else "",
            })  # fmt: skip
    return rows


async def run_all(ports: dict[str, int], args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(args.repeat):
        for scenario in SCENARIOS:
            # Rotate which client goes first, so none always runs on a warmer machine.
            order = CLIENTS[repeat % 3 :] + CLIENTS[: repeat % 3]
            for client in order:
                result = await run_batch(client, scenario, ports, args.requests)
                print_flush(
                    f"  repeat {repeat + 1} {scenario:5} {client:8} "
                    f"{result['us_per_call']:8.1f} us/call  {result['calls_per_s']:8.0f} calls/s"
                )
                runs.append(result)
    return runs


def wait_listening(port: int, server: Proc) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or not server.alive():
                raise RuntimeError(f"server did not start\n{server.tail()}") from None
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 requests instead of 4,000")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve-h2", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_h2 is not None:
        serve_h2(args.serve_h2)
        return
    args.requests = args.requests or (1000 if args.quick else 4000)
    ports = {"http11": free_port(), "h2c": free_port()}
    with tempfile.TemporaryDirectory() as logs:
        servers = [
            Proc("http11-server", [sys.executable, "-m", "bench.micro_upstream", "--serve",
                                   str(ports["http11"])], Path(logs)),
            Proc("h2c-server", [sys.executable, "-m", "bench.upstream_http2", "--serve-h2",
                                str(ports["h2c"])], Path(logs)),
        ]  # fmt: skip
        try:
            for server, port in zip(servers, ports.values(), strict=True):
                wait_listening(port, server)
            print_flush(
                f"{CONNECTIONS} callers, {args.requests} POSTs per batch, {args.repeat} "
                "repetitions; client CPU only (servers in their own processes)"
            )
            runs = trio.run(run_all, ports, args)
        finally:
            for server in servers:
                server.stop()
    rows = summarize(runs)
    columns = ["scenario", "client", "requests", "us/call", "us/call runs", "items/call"]
    columns += ["calls/s", "vs http11"]
    print_flush(table(rows, columns, "client CPU per upstream call (median of repetitions)"))
    settings = {k: v for k, v in vars(args).items() if k != "serve_h2"}
    print_flush(
        "wrote", write_result("upstream_http2", {"args": settings, "rows": rows, "runs": runs})
    )


if __name__ == "__main__":
    main()
