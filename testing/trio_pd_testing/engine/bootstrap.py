"""The KV rendezvous between a prefill engine and a decode engine.

The prefill engine runs a tiny HTTP bootstrap server (SGLang's CommonKVBootstrapServer, plus
the KV handshake SGLang does over ZMQ, folded into one simulated exchange):

- `POST /register?room=N[&rank=R]`: a decode request registers a room and keeps the exchange
  open as a long poll: the 200 headers mean "registered"; the body comes when the prefill
  request for that room has "transferred" the KV. A registration that goes away (the decode
  closed it) is withdrawn.
- `POST /abort?room=N&rank=R`: the decode's ABORT notification for a room it gave up on
  (`disaggregation/common/conn.py`, `mooncake/conn.py` `_handle_abort_notification`): an active
  room (KV not yet sent) is marked failed, so its prefill request fails; the 200 answer is the
  ACK, sent once no prefill request is still computing (writing) that room.
- `GET /health`: what the decode's heartbeat polls (heartbeat.py).

The prefill side sees registrations through the shared RoomTable, keyed by (room, DP rank).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import attrs
import httpx2
import trio

from trio_pd_testing.engine.asgi import Responder, header
from trio_pd_testing.engine.events import EventLog

KV_READY = b"kv_ready\n"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # disaggregation/utils.py: no prefill, a fake KV transfer


@attrs.define
class RoomState:
    registered: trio.Event = attrs.Factory(trio.Event)
    kv: trio.Event = attrs.Factory(trio.Event)
    failed: trio.Event = attrs.Factory(trio.Event)  # the decode aborted it (ABORT notification)
    drained: trio.Event = attrs.Factory(trio.Event)  # no prefill request computes it any more
    computing: int = 0
    refs: int = 0
    prefill_rid: str | None = None  # x-request-id of the prefill request serving it, if any

    def start_computing(self) -> None:
        self.computing += 1
        self.drained = trio.Event()

    def stop_computing(self) -> None:
        self.computing -= 1
        if self.computing <= 0:
            self.drained.set()


class RoomTable:
    """Rooms known to one prefill engine, per data-parallel rank.

    Rendezvous is keyed by (room, rank), as SGLang's bootstrap server keys decode registrations
    by DP group: a registration for another rank than the prefill request's never meets it.
    An entry lives while any request or poll uses it.
    """

    def __init__(self) -> None:
        self.rooms: dict[int, dict[int, RoomState]] = {}
        self._arrived = trio.Event()  # a prefill request took a room (rank lookups wait on it)

    def acquire(self, room: int, rank: int, prefill_rid: str | None = None) -> RoomState:
        ranks = self.rooms.setdefault(room, {})
        state = ranks.get(rank)
        if state is None:
            state = ranks[rank] = RoomState()
            state.drained.set()
        state.refs += 1
        if prefill_rid is not None:
            state.prefill_rid = prefill_rid
            self._arrived.set()
            self._arrived = trio.Event()
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

    def prefill_rank(self, room: int) -> int | None:
        for rank, state in self.rooms.get(room, {}).items():
            if state.prefill_rid is not None:
                return rank
        return None

    async def wait_prefill_rank(self, room: int) -> int:
        """The rank a prefill request registered for `room` (not follow_bootstrap_room)."""
        while (rank := self.prefill_rank(room)) is None:
            await self._arrived.wait()
        return rank


class BootstrapApp:
    """ASGI app of the prefill engine's bootstrap server.

    `POST /register?room=N[&rank=R]`: R is the prefill rank the decode targets (its
    disagg_prefill_dp_rank); without it the server answers `room % dp_size` when the prefill
    balances by follow_bootstrap_room (what an unpinned SGLang decode computes itself), else the
    rank the prefill request registered for the room (`/register_dp_rank`, queried by the
    decode). The 200 answer carries the rank used and the prefill's dp_size in `x-dp-rank` /
    `x-dp-size` headers. A registration for a room whose prefill request runs on another rank
    logs `rank_mismatch`.
    """

    def __init__(
        self, table: RoomTable, events: EventLog, dp_size: int = 1, follow_room: bool = True
    ) -> None:
        self.table = table
        self.events = events
        self.dp_size = dp_size
        self.follow_room = follow_room

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        resp = Responder(send)
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await resp.empty()
            return
        if path not in ("/register", "/abort") or method != "POST":
            await resp.error(404, f"no bootstrap route {method} {path}")
            return
        query = parse_qs(scope.get("query_string", b"").decode())
        try:
            room = int(query["room"][0])
            rank = int(query["rank"][0]) if "rank" in query else None
        except (KeyError, ValueError):
            await resp.error(400, "room (and optional rank) query parameters must be integers")
            return
        if rank is None:
            rank = room % self.dp_size
            if not self.follow_room and self.dp_size > 1:
                rank = await self.table.wait_prefill_rank(room)
        if not 0 <= rank < self.dp_size:
            await resp.error(400, f"prefill rank {rank} out of range (dp_size {self.dp_size})")
            return
        if path == "/abort":
            await self._abort(room, rank, header(scope, b"x-request-id"), resp)
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

    async def _abort(
        self, room: int, rank: int, decode_request_id: str | None, resp: Responder
    ) -> None:
        ranks = self.table.rooms.get(room, {})
        state = ranks.get(rank)
        active = state is not None and not state.kv.is_set()
        self.events.emit(
            "abort_notified",
            rid=state.prefill_rid if state else None,
            room=room,
            dp_rank=rank,
            active=active,
            decode_request_id=decode_request_id,
        )
        if state is not None:
            state.refs += 1  # keep it while we wait for the drain
            try:
                if active:
                    state.failed.set()
                await state.drained.wait()
            finally:
                self.table.release(room, rank)
        await resp.text(200, "ack")

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
    """Registration with a prefill bootstrap server failed."""


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
    """Register `room` with prefill rank `prefill_rank` (None: the server chooses).

    Reports started with the prefill rank used once registered; sets kv_ready when the KV
    arrives. Raises BootstrapError if the registration is refused or cannot be made; once
    registered, a lost connection just ends the wait (the KV can no longer come: SGLang's
    decode only learns of a dead prefill from its heartbeat).
    """
    url = f"http://{host}:{port}/register"
    timeout = httpx2.Timeout(connect=connect_timeout, read=None, write=connect_timeout, pool=None)
    # Header values are bytes on the wire: the id goes back as the latin-1 it was read as.
    headers = [(b"x-request-id", request_id.encode("latin-1"))] if request_id else []
    where = f"bootstrap server {host}:{port} (room {room})"
    params = {"room": str(room)}
    if prefill_rank is not None:
        params["rank"] = str(prefill_rank)
    registered = False
    try:
        async with client.stream(
            "POST", url, params=params, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise BootstrapError(f"{where} answered {response.status_code}: {detail}")
            registered = True
            task_status.started(int(response.headers.get("x-dp-rank", prefill_rank or 0)))
            data = await response.aread()
    except httpx2.HTTPError as exc:
        if not registered:
            raise BootstrapError(f"{where}: {type(exc).__name__}: {exc}") from exc
        await trio.sleep_forever()  # registered, then the prefill went away: no KV will come
    if data == KV_READY:
        kv_ready.set()
    else:
        await trio.sleep_forever()


async def notify_abort(
    client: httpx2.AsyncClient,
    host: str,
    port: int,
    room: int,
    rank: int | None,
    *,
    request_id: str | None,
) -> bool:
    """Send the ABORT notification for `room`; True once the prefill acknowledged it."""
    params = {"room": str(room)}
    if rank is not None:
        params["rank"] = str(rank)
    headers = [(b"x-request-id", request_id.encode("latin-1"))] if request_id else []
    try:
        response = await client.post(
            f"http://{host}:{port}/abort",
            params=params,
            headers=headers,
            timeout=httpx2.Timeout(connect=2.0, read=None, write=2.0, pool=None),
        )
    except httpx2.HTTPError:
        return False
    return response.status_code == 200
