"""Shared state of one running engine, the per-request context (`Call`) and its engine requests
(`Item`s: one per prompt and parallel sample, as SGLang's scheduler sees them).

An item's `stage` is the scheduler queue it is in (what GET /v1/loads counts, and what an abort
does to it, see scheduler.py):
- queued: registered by the tokenizer manager, not yet at the scheduler (the tokenize window);
- prealloc (decode): bootstrapping with the prefill, or waiting for a slot (KV memory);
- bootstrap (prefill): waiting for the decode's KV registration;
- transfer (decode): slot held, KV metadata published, waiting for the KV;
- waiting (decode): the KV arrived, not yet running (the scheduler's waiting queue);
- running: generating tokens (decode), computing the prefill (prefill);
- done: finished, failed or aborted.
"""

from __future__ import annotations

from typing import Any

import attrs
import httpx2
import trio

from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.bootstrap import RoomTable
from trio_pd_testing.engine.config import EngineConfig
from trio_pd_testing.engine.dp import DpPins
from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.faults import Fault, FaultPlan, parse_many
from trio_pd_testing.engine.heartbeat import Heartbeat
from trio_pd_testing.engine.httpserver import ConnectionRegistry
from trio_pd_testing.engine.kv_events import KvEvents
from trio_pd_testing.engine.responses import Output
from trio_pd_testing.engine.rids import RidTable
from trio_pd_testing.engine.slots import SlotPool
from trio_pd_testing.engine.workload import Workload

STAGES = ("queued", "prealloc", "bootstrap", "transfer", "waiting", "running", "done")
END = "done"


@attrs.define(eq=False)
class Item:
    """One engine request: a prompt, or one parallel sample of it."""

    call: Call = attrs.field(repr=False)
    index: int  # position in the request's answer
    rid: str  # the engine's rid for it (regenerated for parallel samples)
    room: int | None
    rank: int | None  # this engine's DP rank serving it
    prompt_tokens: int
    stage: str = "queued"
    waiting_for_input: bool = False  # decode prealloc: bootstrapped, waiting for a slot
    generated: int = 0
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    bootstrap_addr: str | None = None  # decode: the prefill bootstrap server "host:port"
    interrupted: str | None = None  # "abort" | "lost": why `scope` was cancelled
    interrupt_detail: str = ""  # the failure reason SGLang records for the room
    abort_reason: str | None = None  # slot_freed reason of an abort: "aborted_request", ...
    to_finish: bool = False  # aborted while running: stop after one more step
    held_tokens: int = 0  # KV tokens it holds (num_used_tokens)
    cached_tokens: int = 0  # prefill: prompt tokens its radix cache reused (`kv_events.py`)

    @property
    def seqlen(self) -> int:
        return self.prompt_tokens + self.generated

    def new_scope(self) -> trio.CancelScope:
        """A fresh scope for the next waiting stage (one already interrupted is cancelled)."""
        self.scope = trio.CancelScope()
        if self.interrupted is not None:
            self.scope.cancel()
        return self.scope

    def interrupt(self, kind: str, detail: str) -> None:
        """Stop its waiting at once (an abort in a queue, a lost prefill)."""
        if self.interrupted is None:
            self.interrupted, self.interrupt_detail = kind, detail
        self.scope.cancel()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        fields.setdefault("dp_rank", self.rank)
        fields.setdefault("sglang_rid", self.rid)
        return self.call.engine.events.emit(event, rid=self.call.rid, room=self.room, **fields)


class EngineState:
    def __init__(self, config: EngineConfig, events: EventLog) -> None:
        self.config = config
        self.role = config.role
        self.events = events
        self.faults: tuple[Fault, ...] = parse_many(config.faults)
        self.slots = [SlotPool(config.max_running) for _ in range(config.num_dp_ranks)]
        self.rooms = RoomTable()
        self.rids: RidTable[Item] = RidTable()  # the tokenizer manager's rid_to_state
        self.live: list[Item] = []  # dispatched items the scheduler holds, oldest first
        self.deferred: list[Item] = []  # decode: aborted transfers whose KV pages stay held
        self.connections = ConnectionRegistry()
        self.bootstrap_client: httpx2.AsyncClient | None = None  # decode only
        self.heartbeat: Heartbeat | None = None  # decode only
        self.background: trio.Nursery | None = None  # tasks that outlive a request (aborts)
        self.round_robin = 0  # the DP controller's round-robin counter
        self.prefill_uncached_tokens = 0  # cumulative, /v1/loads total_prefill_uncached_tokens
        self.prefill_busy_us = 0
        # decode: the scheduler's decode step moment sums (`decode_moment_totals`: steps,
        # sum of batch sizes, of step times in us, of squared sizes, of size x time, tokens)
        self.decode_moments = [0.0] * 6
        self.health_status = 200  # what GET /health answers (a test sets 503: "still loading")
        self.stopping = False  # shutting down: /health and /ready answer 503
        # A wedged engine (a test sets it): POST /abort_request is read, logged as
        # `abort_hung`, and never answered (abort.py).
        self.abort_hangs = False
        # Load another router's requests put on this engine, per DP rank, which /v1/loads
        # reports beside the engine's own (`saturate`): a test drives a worker's load up.
        self.extra_queued = config.extra_queued  # requests queued for compute (waiting queue)
        self.extra_running = 0
        self.extra_used_tokens = 0  # KV held: token_usage rises with it
        # A hostile engine: these top-level figures replace its own in every rank's /v1/loads
        # (a test sets `{"num_waiting_uncached_tokens": -10**12}`: a worker that lies).
        self.load_lie: dict[str, Any] = {}
        self.released = trio.Event()  # a `hold` fault's requests wait for it (release_held)
        # prefill: the radix cache's blocks and, with --kv-events-config, their KV events
        self.kv = KvEvents(
            config.kv_events_config if self.role == "prefill" else None,
            config.page_size, config.num_dp_ranks, config.max_total_tokens,
        )  # fmt: skip

    async def die(self) -> None:
        """The engine dies as a SIGKILLed server does: what it held goes with it (its live
        requests are dropped, nothing stays counted), every client connection closes at once,
        and later ones are closed on accept. /ready and /health would answer nothing; here the
        connection simply ends."""
        self.stopping = True
        self.connections.dead = True
        calls = list(dict.fromkeys(item.call for item in self.live))
        self.events.emit("engine_died", live=len(self.live), calls=len(calls))
        for call in calls:  # nothing more is written to them; their slots free as they end
            call.ended = "died"
            call.resp.closed = True
            call.cancel("engine_died")
        await self.connections.drop_all()

    def release_held(self) -> None:
        """Let every request a `hold` fault holds go on (and any later one pass)."""
        self.released.set()

    def saturate(self, queued: int = 0, running: int = 0, used_tokens: int = 0) -> None:
        """Report this much more load on every DP rank from now on (0, 0, 0: none)."""
        self.extra_queued, self.extra_running = queued, running
        self.extra_used_tokens = min(used_tokens, self.config.max_total_tokens)

    def set_faults(self, specs: tuple[str, ...] | list[str]) -> None:
        self.faults = parse_many(tuple(specs))

    @property
    def running(self) -> int:
        """Decode: slots taken. Prefill: items past their tokenize window, not yet done."""
        if self.role == "decode":
            return sum(s.running for s in self.slots)
        return sum(1 for item in self.live if item.stage != "done")

    @property
    def queued(self) -> int:
        return sum(s.queued for s in self.slots) if self.role == "decode" else 0

    def retire(self, item: Item) -> None:
        """The scheduler is done with `item`: it leaves every queue and its rid is released."""
        if item.stage == END:
            return
        item.stage = END
        item.waiting_for_input = False
        if item in self.live:
            self.live.remove(item)
        self.rids.release([item.rid], item)

    def next_round_robin(self) -> int:
        rank = self.round_robin % self.config.num_dp_ranks
        self.round_robin += 1
        return rank


@attrs.define(eq=False)
class Call:
    """One HTTP generation request on one engine.

    `rid` is the x-request-id header (the event key); `sglang_rids` the rids the tokenizer
    registered for it (rids.py); `items` its engine requests.
    """

    engine: EngineState
    rid: str
    path: str
    client: Any
    workload: Workload
    plan: FaultPlan
    resp: Responder
    output: Output
    sglang_rids: tuple[str, ...] = ()
    items: list[Item] = attrs.Factory(list)
    pins: DpPins = attrs.Factory(DpPins)
    work_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    cancel_reason: str | None = None  # why work_scope was cancelled (a fault's or the client's)
    ended: str | None = None  # a non-status ending: "closed", "aborted_disconnect", ...
    disconnected: bool = False  # the client went away (nothing more can be sent)
    dispatched: trio.Event = attrs.Factory(trio.Event)  # reached the scheduler
    dispatched_at: float = 0.0  # trio time of the dispatch (the disconnect poll counts from it)
    hanging: bool = False  # a `hang` fault holds it: only the client's leaving ends it
    background_abort_scheduled: bool = False

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def dp_ranks(self) -> tuple[int | None, ...]:
        return tuple(item.rank for item in self.items)

    def rank_of(self, room: int | None) -> int | None:
        """The rank serving the item of `room` (the first item's if the room is not one)."""
        for item in self.items:
            if item.room == room:
                return item.rank
        return self.items[0].rank if self.items else None

    def emit(self, event: str, room: Any = "first", **fields: Any) -> dict[str, Any]:
        if room == "first":
            room = self.workload.first_room
        fields.setdefault("dp_rank", self.rank_of(room))
        return self.engine.events.emit(event, rid=self.rid, room=room, **fields)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.work_scope.cancel()
