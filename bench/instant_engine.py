"""An engine that answers instantly: the load sink of the `router-bound` benchmark.

asyncio on uvloop with httptools' request parser, one process, no KV, no bootstrap rendezvous:
whatever a router sends, it answers at once, so the router is the only busy program.

    python -m bench.instant_engine --role prefill|decode --port N [--bootstrap-port M]
        [--events K --interval-ms T] [--prefill-status S] [--decode-hold SECS] [--record-aborts]

- POST /generate, /v1/completions, /v1/chat/completions: a small fixed JSON (Content-Length,
  keep-alive) in the endpoint's shape; with `"stream": true`, SSE (chunked): K small `data:`
  events then `data: [DONE]`. A decode engine paces them like a batched decode engine: one decode
  step every T ms, and every running stream gets one event per step (all streams' events leave
  together, as SGLang's batch does); T = 0 writes them all at once. A prefill engine answers a
  stream with one event and `[DONE]` at once (its own one-token answer in PD mode).
- GET /health, /health_generate, /get_server_info, /get_model_info, /model_info, /v1/models,
  /get_load; POST /flush_cache: what the routers probe at startup and in health checks.
- GET /stats: `{"requests", "events", "streams"}` served so far (the benchmark counts completed
  requests here: one PD request is one decode request).
- `--bootstrap-port`: the same server listens there too (no router in the benchmark uses it, but
  a router that probes it gets an answer, not a refused connection).

A failure storm (`bench/abort_rate.py`; all three off by default, the behaviour above):

- `--prefill-status S`: a prefill engine answers every generation request with status S at once
  (a JSON error body), noting when it failed each rid.
- `--decode-hold SECS`: a decode engine answers no non-stream generation request; it holds the
  request's slot until an abort names its rid or SECS pass (like a decode waiting for a KV cache
  its prefill will never send: closing the connection does not free it, docs/protocol.md §10).
- `--record-aborts`: `POST /abort_request {"rid"}` answers 200 and frees a held rid (an abort
  for a rid it does not hold is dropped, as SGLang's tokenizer manager does); every failure,
  held request and abort is kept with its `time.monotonic()` (one clock for every process on
  the machine) and served at `GET /records`. Without it `/abort_request` is a 404, as before.

Each (port, method, path) it has not seen before is logged once to stderr, so a router's startup
probes can be read from the engine's log. A connection that does not speak HTTP/1.1 (e.g. SMG's
gRPC probe, HTTP/2 prior knowledge) is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time

import httptools
import orjson

GENERATION = (b"/generate", b"/v1/completions", b"/v1/chat/completions")
TEXT = " the quick brown fox jumps over the lazy dog"
USAGE = {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}
META = {
    "id": "instant",
    "finish_reason": {"type": "length", "length": 16},
    "prompt_tokens": 12,
    "completion_tokens": 16,
    "cached_tokens": 0,
}


def _full_bodies() -> dict[bytes, bytes]:
    return {
        b"/generate": orjson.dumps({"text": TEXT, "meta_info": META}),
        b"/v1/completions": orjson.dumps({
            "id": "cmpl-instant", "object": "text_completion", "created": 0, "model": "instant",
            "choices": [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "length"}],
            "usage": USAGE,
        }),
        b"/v1/chat/completions": orjson.dumps({
            "id": "chatcmpl-instant", "object": "chat.completion", "created": 0,
            "model": "instant",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT},
                         "logprobs": None, "finish_reason": "length"}],
            "usage": USAGE,
        }),
    }  # fmt: skip


def _events() -> dict[bytes, bytes]:
    return {
        b"/generate": orjson.dumps(
            {"text": " tok", "meta_info": {"id": "instant", "finish_reason": None}}
        ),
        b"/v1/completions": orjson.dumps({
            "id": "cmpl-instant", "object": "text_completion", "created": 0, "model": "instant",
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}],
        }),
        b"/v1/chat/completions": orjson.dumps({
            "id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0,
            "model": "instant",
            "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                         "finish_reason": None}],
        }),
    }  # fmt: skip


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}
    reason = reason.get(status, b"Error")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, reason, content_type)
    return head + b"content-length: %d\r\n\r\n%s" % (len(body), body)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
DONE = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
FULL = {path: answer(200, body) for path, body in _full_bodies().items()}
EVENT = {path: chunk(b"data: " + body + b"\n\n") for path, body in _events().items()}
EMPTY = answer(200, b"", b"text/plain")
FAILURE_BODY = b'{"error":{"message":"instant prefill failure","code":%d}}'


def body_rid(body: bytes) -> str:
    """The `rid` a router put in a generation body (a batch's list joined: the storm sends
    single requests); "" when there is none."""
    try:
        rid = orjson.loads(body).get("rid")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return rid if isinstance(rid, str) else ",".join(map(str, rid or ()))


class Holds:
    """The storm's records: prefill failures, held decode slots and the aborts that free them."""

    def __init__(self, hold_secs: float, record: bool) -> None:
        self.hold_secs = hold_secs
        self.record = record
        self.failures: dict[str, float] = {}  # rid -> when the prefill answered its failure
        self.received: dict[str, float] = {}  # rid -> when the decode took its slot
        self.held: dict[str, float] = {}  # rid -> taken at, still held
        self.aborts: list[tuple[str, float, bool]] = []  # (rid, when, it freed a slot)
        self.expired = 0  # slots freed by the hold timeout

    def failed(self, rid: str) -> None:
        if self.record:
            self.failures[rid] = time.monotonic()

    def hold(self, rid: str) -> None:
        now = time.monotonic()
        self.held[rid] = now
        if self.record:
            self.received[rid] = now
        asyncio.get_running_loop().call_later(self.hold_secs, self.expire, rid)

    def expire(self, rid: str) -> None:
        if self.held.pop(rid, None) is not None:
            self.expired += 1

    def abort(self, body: bytes) -> bytes:
        rid = body_rid(body)
        freed = self.held.pop(rid, None) is not None
        if self.record:
            self.aborts.append((rid, time.monotonic(), freed))
        return ABORTED

    def records(self) -> bytes:
        return answer(200, orjson.dumps({
            "failures": self.failures, "received": self.received, "held": self.held,
            "aborts": self.aborts, "expired": self.expired,
        }))  # fmt: skip


ABORTED = answer(200, b"{}")


class Stream:
    __slots__ = ("close", "event", "left", "transport")

    def __init__(self, transport: asyncio.Transport, event: bytes, left: int, close: bool) -> None:
        self.transport = transport
        self.event = event
        self.left = left
        self.close = close  # the client sent `connection: close`


class Engine:
    """State shared by every connection: counters, info answers and the decode-step ticker."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.role = args.role
        self.events = args.events
        self.interval = args.interval_ms / 1000.0
        self.requests = 0
        self.sent_events = 0
        self.streams_started = 0
        self.running: list[Stream] = []
        self.ticking = False
        self.next_tick = 0.0
        self.seen: set[tuple[str, bytes, bytes]] = set()
        self.prefill_failure = (
            answer(args.prefill_status, FAILURE_BODY % args.prefill_status)
            if args.role == "prefill" and args.prefill_status
            else None
        )
        self.decode_hold = args.decode_hold if args.role == "decode" else 0.0
        self.holds = Holds(self.decode_hold, args.record_aborts)
        self.record_aborts = args.record_aborts
        server_info = {
            "model_path": "instant",
            "disaggregation_mode": args.role,
            "disaggregation_bootstrap_port": args.bootstrap_port,
            "max_running_requests": 4096,
            "dp_size": 1,
            "tp_size": 1,
            "simulator": "bench.instant_engine",
        }
        model_info = {"model_path": "instant", "tokenizer_path": "instant", "is_generation": True}
        models = {
            "object": "list",
            "data": [{"id": "instant", "object": "model", "created": 0, "owned_by": "bench"}],
        }
        self.info = {
            (b"GET", b"/health"): EMPTY,
            (b"GET", b"/health_generate"): EMPTY,
            (b"POST", b"/flush_cache"): EMPTY,
            (b"GET", b"/get_server_info"): answer(200, orjson.dumps(server_info)),
            (b"GET", b"/server_info"): answer(200, orjson.dumps(server_info)),
            (b"GET", b"/get_model_info"): answer(200, orjson.dumps(model_info)),
            (b"GET", b"/model_info"): answer(200, orjson.dumps(model_info)),
            (b"GET", b"/v1/models"): answer(200, orjson.dumps(models)),
        }

    def note(self, where: str, method: bytes, path: bytes) -> None:
        key = (where, method, path)
        if key not in self.seen:
            self.seen.add(key)
            print(f"{self.role} {where}: first {method.decode()} {path.decode()}", file=sys.stderr)

    def get_load(self) -> bytes:
        n = len(self.running)
        return answer(200, orjson.dumps({"num_reqs": n, "num_waiting_reqs": 0, "num_tokens": n}))

    def stats(self) -> bytes:
        body = {
            "requests": self.requests,
            "events": self.sent_events,
            "streams": self.streams_started,
            "held": len(self.holds.held),
        }
        return answer(200, orjson.dumps(body))

    # ---- streams -------------------------------------------------------------------------
    def start_stream(self, transport: asyncio.Transport, path: bytes, close: bool) -> None:
        self.streams_started += 1
        event = EVENT[path]
        if self.role == "prefill" or self.interval <= 0:
            count = 1 if self.role == "prefill" else self.events
            transport.write(SSE_HEAD + event * count + DONE)
            self.sent_events += count
            self.requests += 1
            if close:
                transport.close()
            return
        transport.write(SSE_HEAD)
        self.running.append(Stream(transport, event, self.events, close))
        if not self.ticking:
            self.ticking = True
            loop = asyncio.get_running_loop()
            self.next_tick = loop.time() + self.interval
            loop.call_at(self.next_tick, self.tick)

    def tick(self) -> None:
        """One decode step: one event to every running stream; the last one ends it."""
        keep = []
        sent = 0
        for s in self.running:
            if s.transport.is_closing():
                continue
            s.left -= 1
            sent += 1
            if s.left > 0:
                s.transport.write(s.event)
                keep.append(s)
            else:
                s.transport.write(s.event + DONE)
                self.requests += 1
                if s.close:
                    s.transport.close()
        self.sent_events += sent
        self.running = keep
        if not keep:
            self.ticking = False
            return
        loop = asyncio.get_running_loop()
        self.next_tick += self.interval
        now = loop.time()
        if self.next_tick < now:  # late: skip the missed steps rather than burst
            self.next_tick = now + self.interval
        loop.call_at(self.next_tick, self.tick)


class Http(asyncio.Protocol):
    """One client connection: httptools parses, every complete request is answered at once."""

    def __init__(self, engine: Engine, where: str) -> None:
        self.engine = engine
        self.where = where
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        engine = self.engine
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if path in GENERATION and method == b"POST":
            body = b"".join(self.body)
            if engine.prefill_failure is not None:
                engine.requests += 1
                engine.holds.failed(body_rid(body))
                transport.write(engine.prefill_failure)
                if not self.parser.should_keep_alive():
                    transport.close()
                return
            stream = False
            if b'"stream"' in body:
                try:
                    stream = orjson.loads(body).get("stream") is True
                except (orjson.JSONDecodeError, AttributeError):
                    transport.write(answer(400, b'{"error":"body is not a JSON object"}'))
                    return
            if stream:
                engine.start_stream(transport, path, not self.parser.should_keep_alive())
                return
            engine.requests += 1
            if engine.decode_hold > 0:
                engine.holds.hold(body_rid(body))  # no answer: the slot waits for its abort
                return
            transport.write(FULL[path])
        elif path == b"/abort_request" and method == b"POST" and engine.record_aborts:
            transport.write(engine.holds.abort(b"".join(self.body)))
        elif path == b"/records" and engine.record_aborts:
            transport.write(engine.holds.records())
        else:
            engine.note(self.where, method, path)
            reply = engine.info.get((method, path))
            if reply is None:
                if path == b"/get_load":
                    reply = engine.get_load()
                elif path == b"/stats":
                    reply = engine.stats()
                else:
                    reply = answer(404, b'{"error":"not found"}')
            transport.write(reply)
        if not self.parser.should_keep_alive():
            transport.close()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(args)
    servers = [
        await loop.create_server(
            lambda: Http(engine, "http"), args.host, args.port, backlog=4096, reuse_address=True
        )
    ]
    if args.bootstrap_port:
        servers.append(
            await loop.create_server(
                lambda: Http(engine, "bootstrap"), args.host, args.bootstrap_port, backlog=1024,
                reuse_address=True,
            )
        )  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"instant {args.role} engine on {args.host}:{args.port}", file=sys.stderr, flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.instant_engine", description=__doc__)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument("--events", type=int, default=64, help="SSE events per stream (decode)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="decode step (0: burst)")
    p.add_argument(
        "--prefill-status",
        type=int,
        default=0,
        help="prefill: answer every generation request with this status (0: off)",
    )
    p.add_argument(
        "--decode-hold",
        type=float,
        default=0.0,
        metavar="SECS",
        help="decode: hold non-stream requests until aborted or SECS pass (0: off)",
    )
    p.add_argument(
        "--record-aborts",
        action="store_true",
        help="answer POST /abort_request, keep the storm's records at GET /records",
    )
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the bench extra
        print("uvloop missing: plain asyncio (pip install -e '.[bench]')", file=sys.stderr)
        asyncio.run(main(args))
        return
    uvloop.run(main(args))


if __name__ == "__main__":
    run()
