"""Helpers for the simulator tests: engines on ephemeral ports, PD request pairs, SSE parsing."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx2
import orjson
import trio

from trio_pd_testing.engine import EngineConfig, EngineHandle, serve_engine

_rooms = itertools.count(1_000_000_007, 7919)


def new_room() -> int:
    return next(_rooms)


async def start_engine(nursery: trio.Nursery, role: str, **overrides: Any) -> EngineHandle:
    overrides.setdefault("disconnect_poll_secs", 1.0)
    return await nursery.start(serve_engine, EngineConfig(role=role, **overrides))


def pd_body(prefill: EngineHandle, room: int | list[int], **fields: Any) -> dict[str, Any]:
    return {
        **fields,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }


async def pd_post(
    client: httpx2.AsyncClient,
    prefill: EngineHandle,
    decode: EngineHandle,
    path: str,
    body: dict[str, Any],
) -> tuple[httpx2.Response, httpx2.Response]:
    """Send the same body to both engines at once, as a PD router does."""
    results: dict[str, httpx2.Response] = {}

    async def post(name: str, engine: EngineHandle) -> None:
        results[name] = await client.post(engine.url + path, json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "prefill", prefill)
        nursery.start_soon(post, "decode", decode)
    return results["prefill"], results["decode"]


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body; `[DONE]` stays a string."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def names(records: list[dict[str, Any]]) -> list[str]:
    return [r["event"] for r in records]


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    """Poll a condition that no event reports (e.g. a room leaving the bootstrap table)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


class Background:
    """POSTs running in a nursery; their responses land in `results[name]`."""

    def __init__(self, nursery: trio.Nursery, client: httpx2.AsyncClient) -> None:
        self.nursery, self.client = nursery, client
        self.results: dict[str, httpx2.Response] = {}

    def post(
        self,
        name: str,
        engine: EngineHandle,
        body: dict[str, Any],
        rid: str,
        path: str = "/generate",
    ) -> None:
        async def run() -> None:
            self.results[name] = await self.client.post(
                engine.url + path, json=body, headers={"x-request-id": rid}
            )

        self.nursery.start_soon(run)


async def raw_request(engine, path: str, body: dict) -> trio.SocketStream:
    """Send a request over a raw socket (so the test decides exactly when it closes)."""
    stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + data)
    return stream
