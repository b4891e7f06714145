"""Shared state of one running engine, and the per-request context (`Call`)."""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import httpx2
import trio

from trio_pd.engine.asgi import Responder
from trio_pd.engine.bootstrap import RoomTable
from trio_pd.engine.config import EngineConfig
from trio_pd.engine.events import EventLog
from trio_pd.engine.faults import Fault, FaultPlan, parse_many
from trio_pd.engine.httpserver import ConnectionRegistry
from trio_pd.engine.responses import Shaper
from trio_pd.engine.rids import RidTable
from trio_pd.engine.slots import DisconnectTicker, SlotPool
from trio_pd.engine.workload import Workload


class EngineState:
    def __init__(self, config: EngineConfig, events: EventLog) -> None:
        self.config = config
        self.role = config.role
        self.events = events
        self.faults: tuple[Fault, ...] = parse_many(config.faults)
        self.slots = SlotPool(config.max_running)
        self.rooms = RoomTable()
        self.rids: RidTable[Call] = RidTable()  # body rids of the requests held (abort, dups)
        self.ticker = DisconnectTicker(config.disconnect_poll_secs)
        self.connections = ConnectionRegistry()
        self.bootstrap_client: httpx2.AsyncClient | None = None  # decode only
        self.inflight = 0
        self.inflight_tokens = 0

    def set_faults(self, specs: tuple[str, ...] | list[str]) -> None:
        self.faults = parse_many(tuple(specs))

    @property
    def running(self) -> int:
        return self.slots.running if self.role == "decode" else self.inflight

    @property
    def queued(self) -> int:
        return self.slots.queued if self.role == "decode" else 0

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
    work_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    cancel_reason: str | None = None  # why work_scope was cancelled: slot_freed reason
    ended: str | None = None  # a non-status ending: "closed", "aborted_disconnect", ...
    buffered: list[Any] = attrs.Factory(list)  # stream events held while headers are deferred
    defer_headers: bool = False
    disconnected: bool = False  # the client went away (nothing more can be sent)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def emit(self, event: str, room: Any = "first", **fields: Any) -> dict[str, Any]:
        if room == "first":
            room = self.workload.first_room
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
