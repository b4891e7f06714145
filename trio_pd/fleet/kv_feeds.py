"""Which prefill workers' KV events the router follows, and what it knows of each.

Every RECONCILE_SECS, and at once on a membership change, the prefill workers whose
`/server_info` advertises a publisher (`ServerInfo.kv_events`, learned by the health checks)
are subscribed, one `RankFeed` per DP rank; a worker that leaves, or whose advertisement
changes (an engine restarted on other ports), is unsubscribed (its feeds' scope cancelled,
sockets closed). A worker whose health checks failed after it was healthy is resubscribed
when it is healthy again (`rejoins`): an engine restarted on the same ports publishes nothing
until its first prefill, and until then the index would still show the cache it lost (its
sequence going back to 0 catches a restart the health checks missed). A worker is `precise`
(routed by its index) only while every rank synced, no event it should have sent is overdue
(`stale_secs` after a prefill that stored new blocks), and its self-check holds; otherwise the
policy uses the approximate tree for it and this says why, in the log (once per change),
`GET /workers` (`kv_events`) and the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import attrs
import trio
import zmq

from trio_pd.fleet.kv_check import SelfCheck
from trio_pd.fleet.kv_events import RankFeed
from trio_pd.fleet.reports import KvEventsInfo

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

RECONCILE_SECS = 1.0


class Membership(Protocol):
    version: int

    def workers(self, role: Any = None) -> list[Worker]: ...

    async def wait_changed(self, seen_version: int) -> int: ...


@attrs.define(eq=False)
class WorkerKv:
    worker_id: str
    info: KvEventsInfo
    feeds: list[RankFeed]
    check: SelfCheck
    stale_secs: float
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    awaiting_since: float | None = None  # a prefill stored blocks at this time; no event since
    last_state: str = "syncing"
    was_healthy: bool = False  # healthy at some reconciliation since it was subscribed
    down: bool = False  # its health checks failed after that
    rejoins: int = 0  # resubscribed after its health checks failed (kept across them)

    @property
    def block_size(self) -> int:
        return self.info.block_size

    def prefix(self, hashes: Sequence[int]) -> int:
        """Blocks of `hashes` (from the first) the worker holds: its best rank."""
        return max((feed.index.prefix(hashes) for feed in self.feeds), default=0)

    def last_batch_at(self) -> float | None:
        times = [f.last_batch_at for f in self.feeds if f.last_batch_at is not None]
        return max(times) if times else None

    def expect_event(self, since: float) -> None:
        """A prefill that stored new blocks ended: an event is due from `since` on."""
        last = self.last_batch_at()
        if (last is None or last < since) and self.awaiting_since is None:
            self.awaiting_since = trio.current_time()

    def state(self) -> str:
        """`precise`, or why not: `syncing`, `stale`, `self_check_failed`. Logged on change."""
        if self.awaiting_since is not None:
            last = self.last_batch_at()
            if last is not None and last >= self.awaiting_since:
                self.awaiting_since = None
        if not all(f.synced.is_set() for f in self.feeds):
            state = "syncing"
        elif (
            self.awaiting_since is not None
            and trio.current_time() - self.awaiting_since > self.stale_secs
        ):
            state = "stale"
        elif self.check.tripped:
            state = "self_check_failed"
        else:
            state = "precise"
        if state != self.last_state:
            level = logging.INFO if state == "precise" else logging.WARNING
            log.log(level, "kv_aware: worker %s is %s%s", self.worker_id, state,
                    "" if state == "precise" else ": routed by the approximate tree")  # fmt: skip
            self.last_state = state
        return state

    def to_json(self) -> dict[str, object]:
        blocks = sum(len(f.index) for f in self.feeds)
        counters: dict[str, int] = {}
        for feed in self.feeds:
            for name, value in attrs.asdict(feed.counters).items():
                counters[name] = counters.get(name, 0) + value
        return {
            "state": self.state(),
            "block_size": self.info.block_size,
            "ranks": len(self.feeds),
            "blocks": blocks,
            "partial": any(f.partial for f in self.feeds),
            "down": self.down,
            "rejoins": self.rejoins,
            **counters,
            "self_check": self.check.to_json(),
        }


class KvFeeds:
    def __init__(self, max_blocks: int, stale_secs: float) -> None:
        self.max_blocks = max_blocks
        self.stale_secs = stale_secs
        self.by_id: dict[str, WorkerKv] = {}
        self.checks: dict[str, SelfCheck] = {}  # kept across resubscriptions of a worker

    def get(self, worker: Worker) -> WorkerKv | None:
        return self.by_id.get(worker.id)

    async def run(self, fleet: Membership) -> None:
        context: zmq.Context[Any] = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                seen = -1
                while True:
                    seen = fleet.version
                    self._reconcile(fleet.workers("prefill"), nursery, context)
                    with trio.move_on_after(RECONCILE_SECS):
                        await fleet.wait_changed(seen)
        finally:
            for kv in self.by_id.values():
                kv.scope.cancel()
            context.destroy(linger=0)

    def _reconcile(
        self, workers: list[Worker], nursery: trio.Nursery, context: zmq.Context[Any]
    ) -> None:
        wanted: dict[str, Worker] = {}
        for worker in workers:
            if worker.removed:
                continue
            info = worker.server_info.kv_events
            if info is None:
                worker.kv_report = _no_publisher
                continue
            wanted[worker.id] = worker
            current = self.by_id.get(worker.id)
            if current is not None and current.info == info:
                if not worker.healthy:
                    current.down = current.was_healthy
                    continue
                current.was_healthy = True
                if not current.down:
                    continue
                log.warning("kv_aware: worker %s is healthy again: resyncing its index", worker.id)
            if current is not None:
                current.scope.cancel()
            kv = self._subscribe(worker, info, nursery, context)
            if current is not None and current.info == info:
                kv.rejoins = current.rejoins + 1
        for worker_id in [w for w in self.by_id if w not in wanted]:
            log.info("kv_aware: worker %s unsubscribed", worker_id)
            self.by_id.pop(worker_id).scope.cancel()

    def _subscribe(
        self, worker: Worker, info: KvEventsInfo, nursery: trio.Nursery, context: zmq.Context[Any]
    ) -> WorkerKv:
        host = urlsplit(worker.url).hostname or "127.0.0.1"
        feeds = [
            RankFeed(endpoint, replay, info.topic, self.max_blocks)
            for endpoint, replay in info.endpoints(host)
        ]
        check = self.checks.setdefault(worker.id, SelfCheck(worker.id))
        check.reset()
        kv = WorkerKv(worker.id, info, feeds, check, self.stale_secs, was_healthy=worker.healthy)
        self.by_id[worker.id] = kv
        worker.kv_report = kv.to_json
        log.info("kv_aware: worker %s subscribed to %s", worker.id, [f.endpoint for f in feeds])

        async def follow() -> None:
            with kv.scope:
                async with trio.open_nursery() as feeds_nursery:
                    for feed in feeds:
                        feeds_nursery.start_soon(feed.run, context)

        nursery.start_soon(follow)
        return kv


def _no_publisher() -> dict[str, object]:
    return {"state": "no_publisher"}
