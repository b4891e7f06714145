"""Shared state of one running engine, and the per-request context (`Call`)."""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import httpx2
import trio

from trio_pd.testing.engine.asgi import Responder
from trio_pd.testing.engine.bootstrap import RoomTable
from trio_pd.testing.engine.config import EngineConfig
from trio_pd.testing.engine.dp import DpPins
from trio_pd.testing.engine.events import EventLog
from trio_pd.testing.engine.faults import Fault, FaultPlan, parse_many
from trio_pd.testing.engine.httpserver import ConnectionRegistry
from trio_pd.testing.engine.responses import Shaper
from trio_pd.testing.engine.rids import RidTable
from trio_pd.testing.engine.slots import DisconnectTicker, SlotPool
from trio_pd.testing.engine.workload import Workload


class EngineState:
    def __init__(self, config: EngineConfig, events: EventLog) -> None:
        self.config = config
        self.role = config.role
        self.events = events
        self.faults: tuple[Fault, ...] = parse_many(config.faults)
        self.slots = [SlotPool(config.max_running) for _ in range(config.num_dp_ranks)]  # per rank
        self.rooms = RoomTable()
        self.rids: RidTable[Call] = RidTable()  # body rids of the requests held (abort, dups)
        self.ticker = DisconnectTicker(config.disconnect_poll_secs)
        self.connections = ConnectionRegistry()
        self.bootstrap_client: httpx2.AsyncClient | None = None  # decode only
        self.inflight = 0
        self.inflight_tokens = 0
        self.health_status = 200  # what GET /health answers (a test sets 503: "still loading")

    def set_faults(self, specs: tuple[str, ...] | list[str]) -> None:
        self.faults = parse_many(tuple(specs))

    @property
    def running(self) -> int:
        return sum(s.running for s in self.slots) if self.role == "decode" else self.inflight

    @property
    def queued(self) -> int:
        return sum(s.queued for s in self.slots) if self.role == "decode" else 0

    def new_rid(self) -> str:
        return uuid.uuid4().hex


@attrs.define(eq=False)
class Call:
    """One generation request on one engine.

    `rid` is the x-request-id header (the event key); `sglang_rids` the body rids, one per item.
    """

    engine: EngineState
    rid: str
    path: str
    client: Any
    workload: Workload
    plan: FaultPlan
    resp: Responder
    shaper: Shaper
    sglang_rids: tuple[str, ...] = ()
    pins: DpPins = attrs.Factory(DpPins)
    dp_ranks: tuple[int | None, ...] = ()  # the rank of this engine serving each item
    work_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    cancel_reason: str | None = None  # why work_scope was cancelled: slot_freed reason
    ended: str | None = None  # a non-status ending: "closed", "aborted_disconnect", ...
    buffered: list[Any] = attrs.Factory(list)  # stream events held while headers are deferred
    defer_headers: bool = False
    disconnected: bool = False  # the client went away (nothing more can be sent)
    # per item, the scheduler queue it is in (GET /v1/loads): decode prealloc -> transfer (slot
    # held, waiting for the KV) -> running -> done; prefill bootstrap -> running -> done
    stages: list[str] = attrs.Factory(list)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def rank_of(self, room: int | None) -> int | None:
        """The rank serving the item of `room` (the first item's if the room is not one)."""
        rooms = self.workload.rooms
        if not self.dp_ranks:
            return None
        if rooms is not None and room in rooms:
            return self.dp_ranks[rooms.index(room)]
        return self.dp_ranks[0]

    def emit(self, event: str, room: Any = "first", **fields: Any) -> dict[str, Any]:
        if room == "first":
            room = self.workload.first_room
        fields.setdefault("dp_rank", self.rank_of(room))
        return self.engine.events.emit(event, rid=self.rid, room=room, **fields)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.work_scope.cancel()

    async def stream_event(self, obj: Any) -> None:
        if self.defer_headers and not self.resp.started:
            self.buffered.append(obj)
        else:
            await self.resp.event(obj)

    async def flush_stream(self) -> None:
        for obj in self.buffered:
            await self.resp.event(obj)
        self.buffered.clear()
