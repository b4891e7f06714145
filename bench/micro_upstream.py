"""Client CPU per upstream call: httpcore2's AsyncHTTP11Connection (what the control plane's
client uses) vs trio_pd.upstream.http11.Connection (httptools, the hot path's).

One trio process drives 32 keep-alive connections against an instant HTTP server running in a
separate process (an asyncio protocol in this file, `--serve`), so only the client's CPU is
counted: `time.process_time()` before and after a batch of N small POSTs, divided by N.

Scenarios (each client runs the same batch, alternating, `--repeat` times):
- json: a fixed small JSON answer (Content-Length);
- sse: 64 SSE events per answer, each its own HTTP chunk, written in one burst;
- sse-paced: the same 64 events written `--pace-ms` apart (one event per network read, as a
  decode stream arrives), with N/4 requests to keep the run short.

    .venv/bin/python -m bench.micro_upstream [--quick] [--repeat 2] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpcore2
import trio

from bench.harness.output import print_flush, table, write_result
from bench.harness.procs import HOST, Proc, free_port
from bench.stats import median
from trio_pd.upstream.connect import connect

CONNECTIONS = 32
EVENTS = 64
JSON_BODY = b'{"id":"cmpl-1","object":"text_completion","text":"Hello there","meta_info":{}}'
EVENT = b'data: {"text":"tok","meta_info":{"completion_tokens":1}}\n\n'
EVENT_CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
DONE_CHUNK = b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n") + b"0\r\n\r\n"
JSON_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"date: Tue, 01 Dec 2026 00:00:00 GMT\r\nserver: micro\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY)
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"date: Tue, 01 Dec 2026 00:00:00 GMT\r\nserver: micro\r\n\r\n"
)
SCENARIOS = ("json", "sse", "sse-paced")
CLIENTS = ("httpcore2", "http11")


# -- the server (its own process) ---------------------------------------------------------------


class _Server(asyncio.Protocol):
    pace = 0.002

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 : head.find(b"\r\n", at)]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            target = head.split(b" ", 2)[1]
            if target == b"/json":
                self.transport.write(JSON_ANSWER)
            elif target == b"/sse":
                self.transport.write(SSE_HEAD + EVENT_CHUNK * EVENTS + DONE_CHUNK)
            else:
                self.transport.write(SSE_HEAD)
                self._paced(EVENTS)

    def _paced(self, left: int) -> None:
        if self.transport.is_closing():
            return
        if left == 0:
            self.transport.write(DONE_CHUNK)
            return
        self.transport.write(EVENT_CHUNK)
        asyncio.get_running_loop().call_later(self.pace, self._paced, left - 1)


def serve(port: int, pace: float) -> None:
    _Server.pace = pace

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Server, HOST, port, backlog=512)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the two clients ------------------------------------------------------------------------------

Call = Callable[[], Awaitable[int]]  # one request; returns the number of body items read


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    # What UpstreamPool.post sends: host and length, then leg_headers.
    return [
        (b"host", f"{HOST}:0".encode()),
        (b"content-length", str(len(body)).encode()),
        (b"content-type", b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
    ]


async def open_httpcore2(port: int, path: bytes, body: bytes) -> tuple[Call, Any]:
    backend = httpcore2.TrioBackend()
    origin = httpcore2.Origin(b"http", HOST.encode(), port)
    stream = await backend.connect_tcp(HOST, port, timeout=5.0)
    connection = httpcore2.AsyncHTTP11Connection(origin, stream, 30.0)

    async def call() -> int:
        # As UpstreamPool.post: a Request per call, then the body read to its end.
        request = httpcore2.Request(
            b"POST",
            httpcore2.URL(scheme=b"http", host=origin.host, port=port, target=path),
            headers=_headers(body),
            content=body,
        )
        response = await connection.handle_async_request(request)
        items = 0
        try:
            async for _chunk in response.aiter_stream():
                items += 1
        finally:
            await response.aclose()
        assert response.status == 200 and connection.is_idle()
        return items

    return call, connection


async def open_http11(port: int, path: bytes, body: bytes) -> tuple[Call, Any]:
    connection = await connect(HOST, port, connect_timeout=5.0, keepalive_expiry=30.0)

    async def call() -> int:
        response = await connection.request(b"POST", path, _headers(body), body)
        items = 0
        async for _chunk in response.chunks():
            items += 1
        await response.aclose()
        assert response.status == 200 and connection.is_reusable()
        return items

    return call, connection


OPENERS = {"httpcore2": open_httpcore2, "http11": open_http11}


async def run_batch(client: str, scenario: str, port: int, requests: int) -> dict[str, Any]:
    path = b"/" + scenario.encode()
    body = b'{"text":"hello","sampling_params":{"max_new_tokens":64},"stream":true}'
    opened = [await OPENERS[client](port, path, body) for _ in range(CONNECTIONS)]
    for call, _ in opened:  # warm up every connection
        await call()
    per_connection = [requests // CONNECTIONS] * CONNECTIONS
    for i in range(requests % CONNECTIONS):
        per_connection[i] += 1
    items = 0

    async def worker(call: Call, count: int) -> None:
        nonlocal items
        for _ in range(count):
            got = await call()
            items += got

    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for (call, _), count in zip(opened, per_connection, strict=True):
            nursery.start_soon(worker, call, count)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for _, connection in opened:
        await connection.aclose()
    events = requests * (EVENTS + 1) if scenario != "json" else 0  # +1: the [DONE] event
    return {
        "client": client,
        "scenario": scenario,
        "requests": requests,
        "cpu_s": round(cpu, 4),
        "us_per_call": round(cpu / requests * 1e6, 2),
        "us_per_event": round(cpu / events * 1e6, 3) if events else None,
        "items_per_call": round(items / requests, 2),
        "calls_per_s": round(requests / wall, 1),
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for scenario in SCENARIOS:
        base = None
        for client in CLIENTS:
            mine = [r for r in runs if r["client"] == client and r["scenario"] == scenario]
            if not mine:
                continue
            per_call = median(r["us_per_call"] for r in mine)
            row = {
                "scenario": scenario,
                "client": client,
                "requests": mine[0]["requests"],
                "us/call": per_call,
                "us/call runs": " ".join(f"{r['us_per_call']:.1f}" for r in mine),
                "us/event": median(r["us_per_event"] for r in mine),
                "items/call": median(r["items_per_call"] for r in mine),
                "calls/s": median(r["calls_per_s"] for r in mine),
            }
            if client == "httpcore2":
                base = per_call
            elif base and per_call:
                row["vs httpcore2"] = f"{base / per_call:.1f}x less"
            rows.append(row)
    return rows


async def run_all(port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(args.repeat):
        for scenario in args.scenarios:
            requests = args.requests // 4 if scenario == "sse-paced" else args.requests
            # Alternate which client goes first, so neither always runs on a warmer machine.
            order = CLIENTS if repeat % 2 == 0 else CLIENTS[::-1]
            for client in order:
                result = await run_batch(client, scenario, port, requests)
                print_flush(
                    f"  repeat {repeat + 1} {scenario:9} {client:9} "
                    f"{result['us_per_call']:8.1f} us/call  {result['calls_per_s']:8.0f} calls/s"
                )
                runs.append(result)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 requests instead of 4,000")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pace-ms", type=float, default=2.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.pace_ms / 1000)
        return
    args.requests = args.requests or (1000 if args.quick else 4000)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        server = Proc(
            "micro-server",
            [sys.executable, "-m", "bench.micro_upstream", "--serve", str(port),
             "--pace-ms", str(args.pace_ms)],
            Path(logs),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection((HOST, port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or not server.alive():
                        raise RuntimeError(f"server did not start\n{server.tail()}") from None
                    time.sleep(0.05)
            print_flush(
                f"{CONNECTIONS} keep-alive connections, {args.requests} POSTs per batch "
                f"({args.requests // 4} for sse-paced, {args.pace_ms:g} ms apart), "
                f"{args.repeat} repetitions; client CPU only (server in pid {server.pid})"
            )
            runs = trio.run(run_all, port, args)
        finally:
            server.stop()
    rows = summarize(runs)
    columns = ["scenario", "client", "requests", "us/call", "us/call runs", "us/event"]
    columns += ["items/call", "calls/s", "vs httpcore2"]
    print_flush(table(rows, columns, "client CPU per upstream call (median of repetitions)"))
    settings = {k: v for k, v in vars(args).items() if k != "serve"}
    print_flush(
        "wrote", write_result("micro_upstream", {"args": settings, "rows": rows, "runs": runs})
    )


if __name__ == "__main__":
    main()
