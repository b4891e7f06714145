"""Abort on cancel: free an engine's slot at once when the router gives up on a leg.

Closing a leg's connection frees the engine's slot only when the engine notices: at once for a
stream, at its next disconnect poll (within 4 s) for a non-stream request, and never for a decode
still waiting for a KV cache its prefill will not send. SGLang's `POST /abort_request
{"rid": ...}` frees it at once (docs/protocol.md §10), so when a leg is cancelled after its request
went out (prefill failed, decode failed first, client gone, deadline, stall, shutdown, a timeout)
the router asks the engine to abort it.

This is work that outlives the request on purpose: the client's answer never waits for it. The
request hands the job to this long-lived service and goes on. How the service is built, and why:

- **One POST per rid.** The engine takes one string rid per call (`AbortReq.rid`; its only
  other form, `abort_all`, aborts every request of every client), and its tokenizer manager
  drops an abort for a rid it does not hold (`tokenizer_manager.abort_request`), so a batch's
  common prefix cannot stand for its items: an abandoned batch leg costs one POST per item
  (bounded by `--max-batch-size`). SGLang 0.5.23's source, `srt/entrypoints/http_server.py`
  and `srt/managers/io_struct.py`, read for issue 26.
- **Each POST three times**: at once, again `EARLY_REPEAT_SECS` (0.1 s) after it, and a last
  time `REPEAT_SECS` (2 s) after the first. An abort that reaches the engine before it
  registered the rid is dropped yet answered 200 (AIBrix #2746, present in SGLang 0.5.23:
  `tokenizer_manager.abort_request` returns when the rid is not in `rid_to_state`; the engine
  keeps no note of it, docs/protocol.md §10). It happens when the abort overtakes its leg in
  the engine's front (an abort on this service's open connection, a leg on a new one), and
  the engine registers the rid when the leg's handler first runs, milliseconds later: the
  early repeat frees it then. With the 2 s repeat alone a real decode held such requests 2.1 s
  (0.16-0.19 s with the early one; tests/sglang/test_fault_matrix.py
  `test_abort_before_the_decode_registered`). The last repeat stays for a front busy longer
  than 0.1 s. The early repeat is one more POST per rid (tens of microseconds of router CPU).
- **A lane per worker** (issue 26, N11). Each worker has its own delay queue and
  `SENDERS_PER_WORKER` senders, and all lanes together have at most `SENDERS` POSTs in flight:
  a worker whose `/abort_request` hangs holds its own senders (each POST bounded by
  `TIMEOUT_SECS`), never another worker's. With one queue and 32 senders for everyone, one
  hanging worker and one abandoned 1,024-batch to it held every sender, and another worker's
  abort went out 64.6 s late (control 2.0 s). It takes `SENDERS / SENDERS_PER_WORKER` hanging
  workers at once to fill the total.
- **A delay queue, not a sleeping sender.** Within a lane, every round not yet due (a repeat; a
  first POST held back by `AbortJob.delay`, see below) waits in a heap keyed by its due time;
  the lane's senders send the due ones. Nothing holds a sender while it waits, so the service
  sends at the rate failures happen (a sender holding its slot through the repeat's sleep
  capped it at ~32 POSTs a second per role).
- **The hot path's HTTP/1.1 client**, not the control plane's httpx2 client: a POST costs tens of
  microseconds of router CPU instead of about a millisecond, which is what lets a storm of
  failing requests be aborted as fast as it fails. Each POST is bounded by `TIMEOUT_SECS`.
- **Its own connections** (a pool with the hot path pool's settings, at most
  `SENDERS_PER_WORKER` per worker in use): on the shared pool a decode leg took the idle
  connection an abort had just left, sent its request on it and closed it when cancelled, so
  in a storm most aborts paid a fresh connect, and most doomed decodes reached the engine
  only to need an abort
  (bench/abort_rate.py at 250 failing requests a second: the router's CPU per failed request,
  aborts on over aborts off, went from 1.16 to 1.01, and the doomed decodes that reached the
  engine from 1,492 to 103 of 2,500; docs/benchmarks.md).
- **Coalesced and bounded** (issue 26, F5). A job's rids wait as one round (the job's tuple
  of rids and an index: a few bytes a rid, where a queued object per POST cost ~300), and its
  repeats as one round per job, repeat and tenth of a second (a twentieth for the early
  one). A (worker, rid) already pending is not queued twice; at most
  `MAX_PENDING_PER_WORKER` rids wait for one worker and `MAX_PENDING` in all, beyond which
  the rest of a job is dropped and counted
  (`trio_pd_aborts_total{role,result="dropped"}`), never blocking the request that gave it.
  Forty abandoned 1,024-batches (81,920 rids, both legs) once overflowed the single 65,536 queue
  and dropped 16,375 aborts; they now fit (40,960 a worker).
- **Warnings aggregated.** A drop or a failed POST is one warning line per worker and kind at
  most every `WARN_EVERY_SECS`, with the count since the last line (and a last line when the
  worker's lane empties or the process flushes): 40 abandoned batches to a failing worker once
  logged 16,375 lines, one per rid.
- **Flushed at shutdown.** `flush()` sends every first POST still pending before the process
  exits (repeats are dropped), bounded by `FLUSH_SECS`, so the requests the end of a drain cut
  are freed in their engines too.
- **Never fatal.** A failing POST is logged and counted; nothing a job carries can raise out of
  the service (the lifespan supervises it anyway, `edge/services.py`).

`AbortJob.delay` is the latch hazard's answer (docs/protocol.md §10): an abort that lands after
the engine registered a rid but before the request reached its scheduler is lost *and* latches,
suppressing every later abort of that rid, the engine's own disconnect abort included. That
window only exists where the engine awaits between the two (its async dynamic batch tokenizer,
multimodal inputs); the dispatcher sets a delay for those legs only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable

import attrs
import orjson
import trio

from trio_pd.observe.metrics import RouterMetrics
from trio_pd.upstream.pool import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)
SENDERS = 128  # POSTs in flight at once, all workers together, at most
SENDERS_PER_WORKER = 8  # POSTs in flight to one worker at once, at most
MAX_PENDING = 262_144  # rids waiting (due or not), all workers together, at most
MAX_PENDING_PER_WORKER = 65_536  # rids waiting for one worker, at most
TIMEOUT_SECS = 2.0
EARLY_REPEAT_SECS = 0.1  # the first repeat, after the first POST ended
REPEAT_SECS = 2.0  # the last repeat, after the first POST ended
REPEAT_BUCKET_SECS = 0.1  # POSTs done within this long share one repeat round (at most)
FLUSH_SECS = 5.0
WARN_EVERY_SECS = 10.0
ABORT_PATH = "/abort_request"
JSON = (b"content-type", b"application/json")


@attrs.frozen
class AbortJob:
    """Abort the rids of one abandoned leg on one worker."""

    role: str
    url: str  # the worker's base URL
    rids: tuple[str, ...]
    headers: tuple[tuple[bytes, bytes], ...] = ()  # the worker's (admin) authorization
    delay: float = 0.0  # hold the first POST back this long (the latch hazard)


@attrs.define(eq=False)
class _Round:
    """Rids of one job sent in one go: their first POSTs, or their repeats."""

    job: AbortJob
    rids: list[str]
    stage: int  # 0: the first POSTs; k: the k-th repeat
    serial: int  # a first round's own number (its repeats are grouped by it)
    taken: int = 0  # rids[:taken] were handed to a sender

    @property
    def repeat(self) -> bool:
        return self.stage > 0


@attrs.define(eq=False)
class _Lane:
    """One worker's aborts: its delay queue, its pending rids, its senders' count."""

    url: str
    heap: list[tuple[float, int, _Round]] = attrs.Factory(list)
    pending: set[str] = attrs.Factory(set)  # rids queued, being sent or awaiting the repeat
    waiting: int = 0  # rids in the heap not yet handed to a sender
    in_flight: int = 0
    changed: trio.Event = attrs.Factory(trio.Event)
    # (a first round's serial, stage) -> (its open repeat round, until when it takes more rids)
    open_repeats: dict[tuple[int, int], tuple[_Round, float]] = attrs.Factory(dict)
    running: bool = False  # its senders run

    def wake(self) -> None:
        changed, self.changed = self.changed, trio.Event()
        changed.set()

    def push(self, due: float, order: int, rnd: _Round) -> None:
        heapq.heappush(self.heap, (due, order, rnd))

    def take(self, now: float, flushing: bool) -> tuple[_Round, str] | None:
        """The next due rid, or None. Flushing: every first round is due, repeats dropped."""
        while self.heap:
            due, _, rnd = self.heap[0]
            if rnd.repeat and flushing:
                heapq.heappop(self.heap)
                self._retired(rnd)
                left = rnd.rids[rnd.taken :]
                self.pending.difference_update(left)
                self.waiting -= len(left)
                continue
            if due > now and not flushing:
                return None
            rid = rnd.rids[rnd.taken]
            rnd.taken += 1
            self.waiting -= 1
            if rnd.taken == len(rnd.rids):
                heapq.heappop(self.heap)
                self._retired(rnd)
            return rnd, rid
        return None

    def _retired(self, rnd: _Round) -> None:
        if rnd.repeat:
            entry = self.open_repeats.get((rnd.serial, rnd.stage))
            if entry is not None and entry[0] is rnd:
                del self.open_repeats[(rnd.serial, rnd.stage)]

    @property
    def idle(self) -> bool:
        return not self.heap and self.in_flight == 0


@attrs.define
class _Note:
    """Warnings of one kind for one worker not yet logged."""

    count: int = 0
    role: str = ""
    why: str = ""
    logged_at: float = -math.inf


def own_pool(shared: UpstreamPool) -> UpstreamPool:
    """A pool for the aborts alone, with the shared pool's settings (its keep-alive, connect
    timeout, TLS context and destination check)."""
    return UpstreamPool(
        keepalive_expiry=shared.keepalive_expiry,
        connect_timeout=shared.connect_timeout,
        ssl_context=shared._ssl_context,  # None stays None: the trust store is loaded on use
        destinations=shared.destinations,
    )


class AbortService:
    """The long-lived abort sender of one router process (see the module docstring)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        repeat_secs: float = REPEAT_SECS,
        *,
        early_repeat_secs: float | None = EARLY_REPEAT_SECS,
        max_pending: int = MAX_PENDING,
        max_pending_per_worker: int = MAX_PENDING_PER_WORKER,
        senders_per_worker: int = SENDERS_PER_WORKER,
    ) -> None:
        self.metrics = metrics
        self.repeat_secs = repeat_secs
        # When each repeat goes, in seconds after its first POST ended (ascending).
        self.repeats: tuple[float, ...] = tuple(
            sorted({x for x in (early_repeat_secs, repeat_secs) if x is not None and x > 0})
        )
        self.max_pending = max_pending
        self.max_pending_per_worker = max_pending_per_worker
        self.senders_per_worker = senders_per_worker
        self._lanes: dict[str, _Lane] = {}
        self._order = itertools.count()
        self._limiter = trio.CapacityLimiter(SENDERS)
        self._nursery: trio.Nursery | None = None
        self._pool: UpstreamPool | None = None
        self._flushing = False
        self._notes: dict[tuple[str, str], _Note] = {}
        # Told (role, worker URL) after each first POST the engine accepted: the release audit.
        self.on_sent: Callable[[str, str], None] | None = None

    @property
    def pending(self) -> int:
        """POSTs waiting or being sent (the `trio_pd_aborts_pending` gauge)."""
        return sum(lane.waiting + lane.in_flight for lane in self._lanes.values())

    def request(self, job: AbortJob) -> None:
        """Queue the job's POSTs; never blocks and never raises (callable from a cancelled
        task's cleanup)."""
        lane = self._lanes.get(job.url)
        if lane is None:
            lane = self._lanes[job.url] = _Lane(job.url)
        fresh: list[str] = []
        for rid in job.rids:
            if rid in lane.pending:
                self.metrics.aborts.labels(job.role, "coalesced").inc()
            else:
                lane.pending.add(rid)
                fresh.append(rid)
        waiting = sum(each.waiting for each in self._lanes.values())
        room = max(0, min(self.max_pending - waiting, self.max_pending_per_worker - lane.waiting))
        if len(fresh) > room:
            dropped = fresh[room:]
            del fresh[room:]
            lane.pending.difference_update(dropped)
            self.metrics.aborts.labels(job.role, "dropped").inc(len(dropped))
            self._note(job, "dropped", len(dropped), "abort queue full")
        if fresh:
            due = trio.current_time() + job.delay
            serial = next(self._order)
            lane.push(due, serial, _Round(job, fresh, stage=0, serial=serial))
            lane.waiting += len(fresh)
            lane.wake()
            self._start(lane)
        elif lane.idle and not lane.running:
            del self._lanes[job.url]

    def connections(self) -> list[tuple[str, str]]:
        """(worker URL, "idle" | "active") of the service's own connections."""
        return self._pool.connections() if isinstance(self._pool, UpstreamPool) else []

    async def run(
        self, pool: UpstreamPool, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The lanes' senders; runs until cancelled (the lifespan's end, after `flush`).
        `pool` is the hot path's: the service sends on a pool of its own with the same
        settings (a pool of another kind, a test's recorder, is used as it is)."""
        own = own_pool(pool) if isinstance(pool, UpstreamPool) else pool
        self._pool = own
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for lane in self._lanes.values():
                    lane.running = False  # a restart: the old senders are gone
                    lane.in_flight = 0
                    self._start(lane)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if own is not pool:
                with trio.CancelScope(shield=True):
                    await own.aclose()

    def _start(self, lane: _Lane) -> None:
        if self._nursery is not None and not lane.running:
            lane.running = True
            self._nursery.start_soon(self._run_lane, lane)

    async def _run_lane(self, lane: _Lane) -> None:
        """The lane's senders, until it has nothing left; then the lane is forgotten."""
        try:
            while True:
                async with trio.open_nursery() as senders:
                    for _ in range(self.senders_per_worker):
                        senders.start_soon(self._sender, lane)
                if lane.idle:  # no checkpoint since: nothing was queued in between
                    if self._lanes.get(lane.url) is lane:
                        del self._lanes[lane.url]
                    self._tell(lane.url, force=True)
                    return
        finally:
            lane.running = False

    async def flush(self, limit_secs: float = FLUSH_SECS) -> None:
        """Send every first POST still pending now (repeats dropped), within `limit_secs`.

        Called by the lifespan at shutdown, after the drain cut what still ran, while `run` is
        still running: it returns once `run` has sent everything (or the limit passed)."""
        self._flushing = True
        for lane in self._lanes.values():
            lane.wake()
        with trio.move_on_after(limit_secs):
            while self.pending:  # noqa: ASYNC110 - shutdown only, bounded
                await trio.sleep(0.01)
        left = self.pending
        if left:
            log.warning("shutdown: %d aborts not sent within %gs", left, limit_secs)
        for url, _ in list(self._notes):
            self._tell(url, force=True)

    async def _sender(self, lane: _Lane) -> None:
        while True:
            taken = lane.take(trio.current_time(), self._flushing)
            if taken is None:
                if lane.idle:
                    lane.wake()  # the lane's other senders end too
                    return
                changed = lane.changed
                wake_at = lane.heap[0][0] if lane.heap and not self._flushing else math.inf
                with trio.move_on_at(wake_at):
                    await changed.wait()
                continue
            rnd, rid = taken
            lane.in_flight += 1
            try:
                async with self._limiter:
                    await self._post(rnd.job, rid, rnd.repeat)
            except Exception:  # a bug here must not end the service
                log.exception("abort of %s on %s raised", rid, rnd.job.url)
            finally:
                lane.in_flight -= 1
                if self._after(lane, rnd, rid) or lane.idle:
                    lane.wake()  # a new round to wait for, or nothing left: the others see

    def _after(self, lane: _Lane, rnd: _Round, rid: str) -> bool:
        """Put a POST's rid in its job's open round of the next repeat, or retire it after its
        last. The k-th repeat goes at least `repeats[k-1]` after the first POST ended (each
        waits out the gap from the POST before it). Whether a new round was queued (the lane's
        waiting senders must see its due time)."""
        if rnd.stage >= len(self.repeats) or self._flushing:
            lane.pending.discard(rid)
            return False
        now = trio.current_time()
        stage = rnd.stage + 1
        gap = self.repeats[rnd.stage] - (self.repeats[rnd.stage - 1] if rnd.stage else 0.0)
        key = (rnd.serial, stage)
        entry = lane.open_repeats.get(key)
        opened = entry is None or now >= entry[1]
        if opened:
            repeat = _Round(rnd.job, [], stage=stage, serial=rnd.serial)
            # A round takes rids for at most half its gap: the early repeat stays early.
            closes = now + min(REPEAT_BUCKET_SECS, gap / 2)
            lane.push(closes + gap, next(self._order), repeat)
            entry = lane.open_repeats[key] = (repeat, closes)
        assert entry is not None
        entry[0].rids.append(rid)
        lane.waiting += 1
        return opened

    async def _post(self, job: AbortJob, rid: str, repeat: bool = False) -> None:
        assert self._pool is not None
        body = orjson.dumps({"rid": rid})
        headers = [JSON, *job.headers]
        with trio.move_on_after(TIMEOUT_SECS):
            try:
                async with self._pool.post(job.url, ABORT_PATH, headers, body) as response:
                    await response.read(limit=4096)
                    status = response.status
            except UpstreamError as exc:
                self._failed(job, rid, f"{exc.kind}: {exc}")
                return
            if 200 <= status < 300:
                self.metrics.aborts.labels(job.role, "sent").inc()
                if self.on_sent is not None and not repeat:
                    self.on_sent(job.role, job.url)
            else:
                self._failed(job, rid, f"status {status}")
            return
        self._failed(job, rid, f"timed out after {TIMEOUT_SECS:g}s")

    def _failed(self, job: AbortJob, rid: str, why: str) -> None:
        self.metrics.aborts.labels(job.role, "failed").inc()
        self._note(job, "failed", 1, f"last: {rid}, {why}")

    def _note(self, job: AbortJob, kind: str, count: int, why: str) -> None:
        """Count a warning; log it now unless one was logged for this worker and kind within
        `WARN_EVERY_SECS` (then it goes in the next line, with the count)."""
        note = self._notes.setdefault((job.url, kind), _Note())
        note.count += count
        note.role, note.why = job.role, why
        self._tell(job.url, kind)

    def _tell(self, url: str, kind: str | None = None, *, force: bool = False) -> None:
        now = trio.current_time()
        for each in ("dropped", "failed") if kind is None else (kind,):
            note = self._notes.get((url, each))
            if note is None or not note.count:
                continue
            if not force and now - note.logged_at < WARN_EVERY_SECS:
                continue
            what = "not queued (full)" if each == "dropped" else "failed"
            log.warning("aborts on %s (%s): %d %s (%s)", url, note.role, note.count, what, note.why)
            note.count, note.logged_at = 0, now
            if force:
                del self._notes[(url, each)]
