"""A scripted upstream for driving one `Attempt` without sockets (tests/pd/test_outcome_table.py).

Each leg's worker URL has a `Script`: the answer's head (or a refusal before anything was sent)
and its body as steps: bytes (one chunk read), `Wait(name)` (until another step did
`Mark(name)`), `Mark(name)`, `Hang()` (until cancelled) and `Break()` (the connection breaks: a
transport error, as `http11` raises it). The pool records what each leg was sent, whether its
connection was closed under it, and the client's side is a list of ASGI messages. With trio's
autojump clock every timeout fires at once, so a row runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from trio_pd.upstream.pool import UpstreamError

JSON = b"application/json"
SSE = b"text/event-stream"


@attrs.frozen
class Wait:
    name: str


@attrs.frozen
class Mark:
    name: str


@attrs.frozen
class Hang:
    pass


@attrs.frozen
class Break:
    message: str = "connection reset by peer"


Step = bytes | Wait | Mark | Hang | Break


@attrs.frozen
class Script:
    """One leg's answer. `refuse`: the connection fails before the request is written."""

    status: int = 200
    content_type: bytes = JSON
    body: tuple[Step, ...] = ()
    head: tuple[Step, ...] = ()  # steps before the head arrives (Wait, Hang, Break)
    refuse: bool = False


@attrs.define
class Board:
    """The marks steps wait for, shared by both legs' scripts."""

    events: dict[str, trio.Event] = attrs.Factory(dict)

    def event(self, name: str) -> trio.Event:
        return self.events.setdefault(name, trio.Event())


def sent_mark(url: str) -> str:
    """The mark set once the request to `url` was written (the engine may hold it)."""
    return f"sent {url}"


async def play(step: Step, board: Board) -> bytes | None:
    """Run one non-bytes step; bytes are returned to be read."""
    if isinstance(step, bytes):
        return step
    if isinstance(step, Wait):
        await board.event(step.name).wait()
    elif isinstance(step, Mark):
        board.event(step.name).set()
    elif isinstance(step, Hang):
        await trio.sleep_forever()
    elif isinstance(step, Break):
        await trio.lowlevel.checkpoint()
        raise UpstreamError("transport", step.message)
    return None


@attrs.define(eq=False)
class ScriptedResponse:
    """What `Attempt` reads of an `http11.Response`: status, headers, chunks, read."""

    status: int
    headers: list[tuple[bytes, bytes]]
    steps: list[Step]
    board: Board
    closed_under_it: bool = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def chunks(self) -> ScriptedResponse:
        return self

    def __aiter__(self) -> ScriptedResponse:
        return self

    async def __anext__(self) -> bytes:
        while self.steps:
            step = self.steps.pop(0)
            data = await play(step, self.board)
            if data:
                return data
        raise StopAsyncIteration

    async def read(self, limit: int | None = None) -> bytes:
        parts = [chunk async for chunk in self]
        data = b"".join(parts)
        return data if limit is None else data[:limit]

    def close_connection_now(self) -> None:
        self.closed_under_it = True


@attrs.define(eq=False)
class Sent:
    """What one leg's worker was sent, and how its exchange ended."""

    body: bytes
    headers: list[tuple[bytes, bytes]]
    response: ScriptedResponse | None = None


@attrs.define(eq=False)
class ScriptedPool:
    """`UpstreamPool.post` against scripts, keyed by worker URL."""

    scripts: dict[str, Script]
    board: Board = attrs.Factory(Board)
    sent: dict[str, Sent] = attrs.Factory(dict)
    destinations: Any = None  # no DNS: a vLLM handoff's host is checked for its shape only

    def post(
        self,
        url: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        sending: Callable[[], None] | None = None,
    ) -> Exchange:
        return Exchange(self, url, headers, body, sending)


@attrs.define(eq=False)
class Exchange:
    pool: ScriptedPool
    url: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    sending: Callable[[], None] | None

    async def __aenter__(self) -> ScriptedResponse:
        script = self.pool.scripts[self.url]
        await trio.lowlevel.checkpoint()  # the connect: a cancel point, as the real pool's
        if script.refuse:
            raise UpstreamError("transport", "connection refused")
        if self.sending is not None:
            self.sending()
        sent = self.pool.sent[self.url] = Sent(self.body, self.headers)
        self.pool.board.event(sent_mark(self.url)).set()
        for step in script.head:
            await play(step, self.pool.board)
        response = ScriptedResponse(
            script.status, [(b"content-type", script.content_type)], list(script.body),
            self.pool.board,
        )  # fmt: skip
        sent.response = response
        return response

    async def __aexit__(self, *exc: object) -> None:
        await trio.lowlevel.checkpoint()


@attrs.define(eq=False)
class Client:
    """The ASGI side: every message the responder sent; `stop_reading_after` body messages
    the client stops reading (a send blocks until cancelled)."""

    messages: list[dict[str, Any]] = attrs.Factory(list)
    stop_reading_after: int | None = None

    async def send(self, message: dict[str, Any]) -> None:
        bodies = sum(1 for m in self.messages if m["type"] == "http.response.body")
        if (
            self.stop_reading_after is not None
            and message["type"] == "http.response.body"
            and bodies >= self.stop_reading_after
        ):
            await trio.sleep_forever()
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        for message in self.messages:
            if message["type"] == "http.response.start":
                return int(message["status"])
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if "body" in m)
