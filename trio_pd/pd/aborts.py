"""Abort on cancel: free an engine's slot at once when the router gives up on a leg.

Closing a leg's connection frees the engine's slot only when the engine notices: at once for a
stream, at its next disconnect poll (within 4 s) for a non-stream request, and never for a decode
still waiting for a KV cache its prefill will not send. SGLang's `POST /abort_request
{"rid": ...}` frees it at once (docs/protocol.md §10), so when a leg is cancelled after its request
went out (prefill failed, decode failed first, client gone, deadline, stall, shutdown, a timeout)
the router asks the engine to abort it.

This is work that outlives the request on purpose: the client's answer never waits for it. The
request hands the job to this long-lived service and goes on. How the service is built, and why:

- **One POST per rid.** The engine takes one string rid per call, and its tokenizer manager
  drops an abort for a rid it does not hold, so a batch's common prefix cannot stand for its
  items: an abandoned batch leg costs one POST per item (bounded by `--max-batch-size`).
- **Each POST twice**, the second `REPEAT_SECS` after the first: an abort that reaches the
  engine before it registered the rid is dropped yet answered 200 (AIBrix's finding).
- **A delay queue, not a sleeping sender.** Every POST not yet due (a repeat; a first POST held
  back by `AbortJob.delay`, see below) waits in a heap keyed by its due time; `SENDERS` tasks
  send the due ones. Nothing holds a sender while it waits, so the service sends at the rate
  failures happen (a sender holding its slot through the repeat's sleep capped it at ~32 POSTs
  a second per role).
- **The hot path's HTTP/1.1 client**, not the control plane's httpx2 client: a POST costs tens of
  microseconds of router CPU instead of about a millisecond, which is what lets a storm of
  failing requests be aborted as fast as it fails. Each POST is bounded by `TIMEOUT_SECS`.
- **Its own connections** (a pool with the hot path pool's settings, at most `SENDERS` per
  worker in use): on the shared pool a decode leg took the idle connection an abort had just
  left, sent its request on it and closed it when cancelled, so in a storm most aborts paid a
  fresh connect, and most doomed decodes reached the engine only to need an abort
  (bench/abort_rate.py at 250 failing requests a second: the router's CPU per failed request,
  aborts on over aborts off, went from 1.16 to 1.01, and the doomed decodes that reached the
  engine from 1,492 to 103 of 2,500; docs/benchmarks.md).
- **Coalesced and bounded.** A (worker, rid) already pending is not queued twice; at most
  `MAX_PENDING` POSTs wait, beyond which a job is dropped and counted
  (`trio_pd_aborts_total{role,result="dropped"}`), never blocking the request that gave it.
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
from collections.abc import Callable

import attrs
import orjson
import trio

from trio_pd.observe.metrics import RouterMetrics
from trio_pd.upstream.pool import UpstreamError, UpstreamPool

log = logging.getLogger("trio_pd.aborts")
SENDERS = 32  # POSTs in flight at once, at most
MAX_PENDING = 65_536  # POSTs waiting (due or not), at most
TIMEOUT_SECS = 2.0
REPEAT_SECS = 2.0
FLUSH_SECS = 5.0
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


@attrs.frozen
class _Post:
    job: AbortJob
    rid: str
    repeat: bool  # the second POST of this rid


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
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.metrics = metrics
        self.repeat_secs = repeat_secs
        self.max_pending = max_pending
        self._heap: list[tuple[float, int, _Post]] = []
        self._order = itertools.count()
        self._pending: set[tuple[str, str]] = set()  # (url, rid) queued or being sent
        self._changed = trio.Event()
        self._pool: UpstreamPool | None = None
        self._flushing = False
        self._in_flight = 0
        # Told (role, worker URL) after each first POST the engine accepted: the release audit.
        self.on_sent: Callable[[str, str], None] | None = None

    @property
    def pending(self) -> int:
        """POSTs waiting or being sent (the `trio_pd_aborts_pending` gauge)."""
        return len(self._heap) + self._in_flight

    def request(self, job: AbortJob) -> None:
        """Queue the job's POSTs; never blocks and never raises (callable from a cancelled
        task's cleanup)."""
        due = trio.current_time() + job.delay
        queued = 0
        for rid in job.rids:
            key = (job.url, rid)
            if key in self._pending:
                self.metrics.aborts.labels(job.role, "coalesced").inc()
                continue
            if len(self._heap) >= self.max_pending:
                self.metrics.aborts.labels(job.role, "dropped").inc()
                log.warning("abort queue full: not aborting %s on %s", rid, job.url)
                continue
            self._pending.add(key)
            heapq.heappush(self._heap, (due, next(self._order), _Post(job, rid, repeat=False)))
            queued += 1
        if queued:
            self._wake()

    def connections(self) -> list[tuple[str, str]]:
        """(worker URL, "idle" | "active") of the service's own connections."""
        return self._pool.connections() if isinstance(self._pool, UpstreamPool) else []

    async def run(
        self, pool: UpstreamPool, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The dispatcher and its senders; runs until cancelled (the lifespan's end, after
        `flush`). `pool` is the hot path's: the service sends on a pool of its own with the same
        settings (a pool of another kind, a test's recorder, is used as it is)."""
        own = own_pool(pool) if isinstance(pool, UpstreamPool) else pool
        self._pool = own
        try:
            await self._dispatch(task_status)
        finally:
            if own is not pool:
                with trio.CancelScope(shield=True):
                    await own.aclose()

    async def _dispatch(self, task_status: trio.TaskStatus[None]) -> None:
        send, receive = trio.open_memory_channel[_Post](SENDERS)
        async with trio.open_nursery() as nursery, send:
            for _ in range(SENDERS):
                nursery.start_soon(self._sender, receive.clone())
            receive.close()
            task_status.started()
            while True:
                now = trio.current_time()
                while self._heap and (self._heap[0][0] <= now or self._flushing):
                    _, _, post = heapq.heappop(self._heap)
                    if self._flushing and post.repeat:
                        self._pending.discard((post.job.url, post.rid))
                        continue
                    self._in_flight += 1
                    await send.send(post)
                changed = self._changed
                wake_at = self._heap[0][0] if self._heap else trio.current_time() + 3600
                with trio.move_on_at(wake_at):
                    await changed.wait()

    async def flush(self, limit_secs: float = FLUSH_SECS) -> None:
        """Send every first POST still pending now (repeats dropped), within `limit_secs`.

        Called by the lifespan at shutdown, after the drain cut what still ran, while `run` is
        still running: it returns once `run` has sent everything (or the limit passed)."""
        self._flushing = True
        self._wake()
        with trio.move_on_after(limit_secs):
            while self._heap or self._in_flight:  # noqa: ASYNC110 - shutdown only, bounded
                await trio.sleep(0.01)
        left = len(self._heap) + self._in_flight
        if left:
            log.warning("shutdown: %d aborts not sent within %gs", left, limit_secs)

    def _wake(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def _sender(self, receive: trio.MemoryReceiveChannel[_Post]) -> None:
        async with receive:
            async for post in receive:
                try:
                    await self._post(post)
                except Exception:  # a bug here must not end the service
                    log.exception("abort of %s on %s raised", post.rid, post.job.url)
                finally:
                    self._in_flight -= 1
                    self._after(post)

    def _after(self, post: _Post) -> None:
        """Schedule the repeat of a first POST, or retire the rid after its repeat."""
        key = (post.job.url, post.rid)
        if post.repeat or self._flushing:
            self._pending.discard(key)
            return
        due = trio.current_time() + self.repeat_secs
        heapq.heappush(self._heap, (due, next(self._order), _Post(post.job, post.rid, True)))
        self._wake()

    async def _post(self, post: _Post) -> None:
        assert self._pool is not None
        job = post.job
        body = orjson.dumps({"rid": post.rid})
        headers = [JSON, *job.headers]
        with trio.move_on_after(TIMEOUT_SECS):
            try:
                async with self._pool.post(job.url, ABORT_PATH, headers, body) as response:
                    await response.read(limit=4096)
                    status = response.status
            except UpstreamError as exc:
                self._failed(job, post.rid, f"{exc.kind}: {exc}")
                return
            if 200 <= status < 300:
                self.metrics.aborts.labels(job.role, "sent").inc()
                if self.on_sent is not None and not post.repeat:
                    self.on_sent(job.role, job.url)
            else:
                self._failed(job, post.rid, f"status {status}")
            return
        self._failed(job, post.rid, f"timed out after {TIMEOUT_SECS:g}s")

    def _failed(self, job: AbortJob, rid: str, why: str) -> None:
        self.metrics.aborts.labels(job.role, "failed").inc()
        log.warning("abort of %s on %s (%s) failed: %s", rid, job.url, job.role, why)
