"""The KV rendezvous between a prefill engine and a decode engine.

The prefill engine runs a tiny HTTP bootstrap server. A decode request registers a room with
`POST /register?room=N` and keeps that exchange open as a long poll: the server answers the
headers (200) at once, which means "registered", and sends the body only when the prefill request
for that room has "transferred" the KV. The decode side reads the body with no timeout and
enforces its own waiting timeout by closing the connection. The prefill side sees the
registration through the shared RoomTable, keyed by (room, data-parallel rank).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import attrs
import httpx2
import trio

from trio_pd.testing.engine.asgi import Responder, header
from trio_pd.testing.engine.events import EventLog

KV_READY = b"kv_ready\n"


@attrs.define
class RoomState:
    registered: trio.Event = attrs.Factory(trio.Event)
    kv: trio.Event = attrs.Factory(trio.Event)
    refs: int = 0
    prefill_rid: str | None = None  # x-request-id of the prefill request serving it, if any


class RoomTable:
    """Rooms known to one prefill engine, per data-parallel rank.

    Rendezvous is keyed by (room, rank), as SGLang's bootstrap server keys decode registrations
    by DP group: a registration for another rank than the prefill request's never meets it.
    An entry lives while any request or poll uses it.
    """

    def __init__(self) -> None:
        self.rooms: dict[int, dict[int, RoomState]] = {}

    def acquire(self, room: int, rank: int, prefill_rid: str | None = None) -> RoomState:
        ranks = self.rooms.setdefault(room, {})
        state = ranks.get(rank)
        if state is None:
            state = ranks[rank] = RoomState()
        state.refs += 1
        if prefill_rid is not None:
            state.prefill_rid = prefill_rid
        return state

    def release(self, room: int, rank: int, prefill_rid: str | None = None) -> None:
        ranks = self.rooms.get(room, {})
        state = ranks.get(rank)
        if state is None:
            return
        if prefill_rid is not None and state.prefill_rid == prefill_rid:
            state.prefill_rid = None
        state.refs -= 1
        if state.refs <= 0:
            del ranks[rank]
            if not ranks:
                del self.rooms[room]

    def other_ranks(self, room: int, rank: int) -> dict[int, RoomState]:
        """The entries of `room` on ranks other than `rank` (a rank mismatch when any is live)."""
        return {r: s for r, s in self.rooms.get(room, {}).items() if r != rank}


class BootstrapApp:
    """ASGI app of the prefill engine's bootstrap server.

    `POST /register?room=N[&rank=R]`: R is the prefill rank the decode targets (its
    disagg_prefill_dp_rank); without it the server picks `room % dp_size`, as an unpinned SGLang
    decode does after learning the prefill's dp_size. The 200 answer carries the rank used and
    the prefill's dp_size in `x-dp-rank` / `x-dp-size` headers. A registration for a room whose
    prefill request runs on another rank logs `rank_mismatch`.
    """

    def __init__(self, table: RoomTable, events: EventLog, dp_size: int = 1) -> None:
        self.table = table
        self.events = events
        self.dp_size = dp_size

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
            rank = int(query["rank"][0]) if "rank" in query else room % self.dp_size
        except (KeyError, ValueError):
            await resp.error(400, "room (and optional rank) query parameters must be integers")
            return
        if not 0 <= rank < self.dp_size:
            await resp.error(400, f"prefill rank {rank} out of range (dp_size {self.dp_size})")
            return
        self._check_rank(room, rank, header(scope, b"x-request-id"))
        state = self.table.acquire(room, rank)
        try:
            state.registered.set()
            headers = [
                (b"content-type", b"text/plain"),
                (b"x-dp-rank", str(rank).encode()),
                (b"x-dp-size", str(self.dp_size).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await state.kv.wait()
                await send({"type": "http.response.body", "body": KV_READY})
                nursery.cancel_scope.cancel()
        finally:
            self.table.release(room, rank)

    def _check_rank(self, room: int, rank: int, decode_request_id: str | None) -> None:
        for other, state in self.table.other_ranks(room, rank).items():
            if state.prefill_rid is not None:
                self.events.emit(
                    "rank_mismatch",
                    rid=state.prefill_rid,
                    room=room,
                    dp_rank=other,
                    registered_rank=rank,
                    decode_request_id=decode_request_id,
                )


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
    prefill_rank: int | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Register `room` with prefill rank `prefill_rank` (None: the server's `room % dp_size`).

    Reports started with the prefill rank used once registered; sets kv_ready when the KV arrives.
    """
    url = f"http://{host}:{port}/register"
    timeout = httpx2.Timeout(connect=connect_timeout, read=None, write=connect_timeout, pool=None)
    # Header values are bytes on the wire: the id goes back as the latin-1 it was read as.
    headers = [(b"x-request-id", request_id.encode("latin-1"))] if request_id else []
    where = f"bootstrap server {host}:{port} (room {room})"
    params = {"room": str(room)}
    if prefill_rank is not None:
        params["rank"] = str(prefill_rank)
    try:
        async with client.stream(
            "POST", url, params=params, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise BootstrapError(f"{where} answered {response.status_code}: {detail}")
            task_status.started(int(response.headers.get("x-dp-rank", prefill_rank or 0)))
            data = await response.aread()
    except httpx2.HTTPError as exc:
        raise BootstrapError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if data != KV_READY:
        raise BootstrapError(f"{where} closed the KV wait without data")
    kv_ready.set()
