"""A worker and a client for bench/hostile_stream.py, on raw trio sockets.

    python -m bench.hostile_worker serve --port N --role prefill|decode [--mode M --rate BPS]
    python -m bench.hostile_worker client --port N --model NAME --streams K

`serve` answers every GET with `200 {}` (health checks, server info) and every POST:
- `--role prefill`: at once, a small JSON answer (its KV cache goes nowhere: the decode is fake);
- `--role decode --mode hostile`: an SSE stream whose first event never ends: `data: ` then
  `--rate` bytes a second of `x`, in 64 KiB chunks, until the router closes the connection;
- `--role decode --mode benign`: the same bytes a second, as complete 1 KiB events (the control:
  the same work for the router's sockets, none for its event parser), for 60 s then [DONE].

`client` keeps `--streams` streaming requests for model NAME in flight through the router,
reading each to its end and starting the next: the hostile tenant.
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial

import trio

HOST = "127.0.0.1"
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
PREFILL_BODY = b'{"text":"","meta_info":{"id":"p"}}'
PREFILL_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(PREFILL_BODY)).encode()
    + b"\r\n\r\n"
    + PREFILL_BODY
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
PIECE = 64 * 1024


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(stream: trio.SocketStream, buffer: bytearray) -> tuple[bytes, bytes] | None:
    """(method, path) of the next request, its body read and dropped; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    end = buffer.index(b"\r\n\r\n")
    lines = bytes(buffer[:end]).split(b"\r\n")
    del buffer[: end + 4]
    method, path, _ = lines[0].split(b" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    del buffer[:length]
    return method, path


async def paced(stream: trio.SocketStream, rate: float, piece: bytes, seconds: float) -> None:
    """Send `piece` (one HTTP chunk) at `rate` bytes a second for `seconds`."""
    interval = len(piece) / rate
    deadline = trio.current_time() + seconds
    next_at = trio.current_time()
    while trio.current_time() < deadline:
        await stream.send_all(piece)
        next_at += interval
        await trio.sleep_until(next_at)


async def handle(args: argparse.Namespace, stream: trio.SocketStream) -> None:
    buffer = bytearray()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while (request := await read_request(stream, buffer)) is not None:
            method, _ = request
            if method != b"POST":
                await stream.send_all(OK)
            elif args.role == "prefill":
                await stream.send_all(PREFILL_ANSWER)
            elif args.mode == "hostile":
                await stream.send_all(SSE_HEAD + chunk(b"data: "))
                await paced(stream, args.rate, chunk(b"x" * PIECE), 3600)
            else:
                event = b'data: {"text":"' + b"x" * 1000 + b'"}\n\n'
                await stream.send_all(SSE_HEAD)
                await paced(stream, args.rate, chunk(event * (PIECE // len(event))), 60)
                await stream.send_all(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def serve(args: argparse.Namespace) -> None:
    await trio.serve_tcp(partial(handle, args), args.port, host=HOST)


async def client(args: argparse.Namespace) -> None:
    body = (
        b'{"text":"hostile","stream":true,"model":"' + args.model.encode() + b'",'
        b'"sampling_params":{"max_new_tokens":16}}'
    )
    request = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    async def one_stream() -> None:
        while True:
            with contextlib.suppress(OSError, trio.BrokenResourceError):
                stream = await trio.open_tcp_stream(HOST, args.port)
                async with stream:
                    await stream.send_all(request)
                    while await stream.receive_some(1 << 20):
                        pass
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        for _ in range(args.streams):
            nursery.start_soon(one_stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--role", choices=("prefill", "decode"), required=True)
    s.add_argument("--mode", choices=("hostile", "benign"), default="hostile")
    s.add_argument("--rate", type=float, default=8e6, help="bytes a second of each stream")
    c = commands.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--streams", type=int, default=2)
    args = parser.parse_args()
    trio.run(serve if args.command == "serve" else client, args)


if __name__ == "__main__":
    main()
