"""The KV rendezvous between a prefill engine and a decode engine.

The prefill engine runs a tiny HTTP bootstrap server. A decode request registers a room with
`POST /register?room=N` and keeps that exchange open as a long poll: the server answers the
headers (200) at once, which means "registered", and sends the body only when the prefill request
for that room has "transferred" the KV. The decode side reads the body with no timeout and
enforces its own waiting timeout by closing the connection. The prefill side sees the
registration through the shared RoomTable.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import attrs
import httpx2
import trio

from trio_pd.engine.asgi import Responder

KV_READY = b"kv_ready\n"


@attrs.define
class RoomState:
    registered: trio.Event = attrs.Factory(trio.Event)
    kv: trio.Event = attrs.Factory(trio.Event)
    refs: int = 0


class RoomTable:
    """Rooms known to one prefill engine; an entry lives while any request or poll uses it."""

    def __init__(self) -> None:
        self.rooms: dict[int, RoomState] = {}

    def acquire(self, room: int) -> RoomState:
        state = self.rooms.get(room)
        if state is None:
            state = self.rooms[room] = RoomState()
        state.refs += 1
        return state

    def release(self, room: int) -> None:
        state = self.rooms.get(room)
        if state is not None:
            state.refs -= 1
            if state.refs <= 0:
                del self.rooms[room]


class BootstrapApp:
    """ASGI app of the prefill engine's bootstrap server."""

    def __init__(self, table: RoomTable) -> None:
        self.table = table

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        resp = Responder(send)
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await resp.empty()
            return
        if path != "/register" or method != "POST":
            await resp.error(404, f"no bootstrap route {method} {path}")
            return
        query = parse_qs(scope.get("query_string", b"").decode())
        try:
            room = int(query["room"][0])
        except (KeyError, ValueError):
            await resp.error(400, "room query parameter (int) required")
            return
        state = self.table.acquire(room)
        try:
            state.registered.set()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await state.kv.wait()
                await send({"type": "http.response.body", "body": KV_READY})
                nursery.cancel_scope.cancel()
        finally:
            self.table.release(room)


async def _cancel_on_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class BootstrapError(Exception):
    """Registration with, or the KV wait on, a prefill bootstrap server failed."""


def bootstrap_client() -> httpx2.AsyncClient:
    # Each registration holds a connection while it waits, so no pool limit; keep-alive expiry
    # below the bootstrap server's keep-alive so a pooled connection is never reused as it closes.
    return httpx2.AsyncClient(
        limits=httpx2.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
        ),
        trust_env=False,
    )


async def register_room(
    client: httpx2.AsyncClient,
    host: str,
    port: int,
    room: int,
    kv_ready: trio.Event,
    *,
    connect_timeout: float,
    request_id: str | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Register `room`; report started once registered; set kv_ready when the KV arrives."""
    url = f"http://{host}:{port}/register"
    timeout = httpx2.Timeout(connect=connect_timeout, read=None, write=connect_timeout, pool=None)
    headers = {"x-request-id": request_id} if request_id else {}
    where = f"bootstrap server {host}:{port} (room {room})"
    try:
        async with client.stream(
            "POST", url, params={"room": str(room)}, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                raise BootstrapError(f"{where} answered {response.status_code}")
            task_status.started()
            data = await response.aread()
    except httpx2.HTTPError as exc:
        raise BootstrapError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if data != KV_READY:
        raise BootstrapError(f"{where} closed the KV wait without data")
    kv_ready.set()
