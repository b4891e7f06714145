"""The floor of the stack: a bare ASGI app served exactly like trio_pd serves its router.

Same server code path as `trio-pd serve` with one worker: `trio_pd.serve.accept.serve_app`
(hypercorn's trio connection handling with trio_pd's fair accept loop) on the sockets
`trio_pd.serve.listeners.make_sockets` makes, with the config `hypercorn_config` builds (keep-alive
5 s, no access log, backlog 4096), the app wrapped by `wrap_asgi`. What the app does is as little as
an HTTP answer can be, so its CPU is hypercorn + trio + the ASGI hop, with no routing, JSON or
upstream connection:

- any POST but /stream: read the body (every `http.request` message), answer a small fixed JSON;
- POST /stream: read the body, then K small SSE events T ms apart and `data: [DONE]` (chunked).
  Event times fall on a shared grid (multiples of T on trio's clock), like the instant decode
  engine's decode steps, so concurrent streams wake together as a router's streams would;
  every stream sleeps on its own trio timer (its wake-ups are part of the floor);
- GET /health: 200; GET /stats: `{"requests", "events", "streams"}` (not counted itself).
  With `--stats-file PATH` the same three counters also live in that file (three native int64,
  shared memory): the benchmark reads them there, because a saturated server answers its own
  /stats late (at 256 connections hypercorn can hold a request for seconds).

    python -m bench.floor --port N [--events 64 --interval-ms 20] [--stats-file PATH]
"""

from __future__ import annotations

import argparse
import math
import mmap
import signal
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from trio_pd.config import RouterConfig
from trio_pd.serve.accept import run_lifespan, serve_app, wrap_asgi
from trio_pd.serve.listeners import hypercorn_config, make_sockets

JSON = b'{"text":" the quick brown fox jumps over the lazy dog","meta_info":{"id":"floor"}}'
JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(JSON))]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
EVENT = b'data: {"text":" tok","meta_info":{"id":"floor","finish_reason":null}}\n\n'
DONE = b"data: [DONE]\n\n"


REQUESTS, EVENTS, STREAMS = range(3)


def counters(path: str | None) -> Any:
    """Three int64 counters: in a shared file when asked (read_counters), else in memory."""
    if path is None:
        return [0, 0, 0]
    Path(path).write_bytes(b"\0" * 24)
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 24)
    return memoryview(shared).cast("q")


def read_counters(path: Path) -> dict[str, int]:
    view = memoryview(path.read_bytes()[:24]).cast("q")
    return {"requests": view[REQUESTS], "events": view[EVENTS], "streams": view[STREAMS]}


class FloorApp:
    def __init__(self, events: int, interval: float, stats_file: str | None = None) -> None:
        self.events = events
        self.interval = interval
        self.counts = counters(stats_file)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.http(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["method"] == "GET":
            if scope["path"] == "/stats":
                c = self.counts
                body = {"requests": c[REQUESTS], "events": c[EVENTS], "streams": c[STREAMS]}
                await _answer(send, orjson.dumps(body))
            else:
                await _answer(send, b"" if scope["path"] == "/health" else b"{}")
            return
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            more = message.get("more_body", False)
        if scope["path"] == "/stream":
            await self.stream(send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": JSON})
        self.counts[REQUESTS] += 1

    async def stream(self, send: Any) -> None:
        self.counts[STREAMS] += 1
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        step = self.interval
        first = math.ceil(trio.current_time() / step) * step if step > 0 else 0.0
        for i in range(self.events):
            if step > 0:
                await trio.sleep_until(first + i * step)
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            self.counts[EVENTS] += 1
        await send({"type": "http.response.body", "body": DONE})
        self.counts[REQUESTS] += 1


async def _answer(send: Any, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve(args: argparse.Namespace) -> None:
    config = RouterConfig(host=args.host, port=args.port, log_level="warning")
    hc = hypercorn_config(config)
    sockets = make_sockets(config, hc)
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.listen(hc.backlog)
    floor = FloorApp(args.events, args.interval_ms / 1000.0, args.stats_file)
    app = wrap_asgi(floor, hc)
    stop = trio.Event()

    async def on_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    state: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signals)
        async with run_lifespan(app, hc, state):  # as `serve/process.py` runs the router's
            await serve_app(app, hc, sockets, stop.wait, state=state)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--stats-file", default=None, help="also keep the counters in this file")
    trio.run(partial(serve, p.parse_args(argv)))


if __name__ == "__main__":
    main()
