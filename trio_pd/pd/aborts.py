"""Abort on cancel: free an engine's slot at once when the router gives up on a leg.

Closing a leg's connection frees the engine's slot only at the engine's next disconnect poll
(about 4 s in SGLang). SGLang's `POST /abort_request {"rid": ...}` frees it at once, so when a
leg is cancelled after its request went out (prefill failed, decode failed first, client gone,
deadline, stall, shutdown, a timeout), the router asks the engine to abort it.

This is work that outlives the request on purpose: the client's answer never waits for it. The
request hands the job to this long-lived service (a bounded channel in, one consumer task, in
the app-lifespan nursery) and goes on. Each abort is sent at once and once more `REPEAT_SECS`
later: an abort that reaches the engine before it registered the rid is dropped yet answered
200 (AIBrix's finding). Each POST is bounded by `TIMEOUT_SECS`; at most `CONCURRENCY` run at
once; a full queue drops the job. Failures are logged and counted
(`trio_pd_aborts_total{role,result}`), never surfaced to clients.
"""

from __future__ import annotations

import logging

import attrs
import httpx2
import trio

from trio_pd.observe.metrics import RouterMetrics

log = logging.getLogger("trio_pd.aborts")
QUEUE_SIZE = 4096
CONCURRENCY = 64
TIMEOUT_SECS = 2.0
REPEAT_SECS = 2.0


@attrs.frozen
class AbortJob:
    role: str
    url: str  # the worker's base URL
    rids: tuple[str, ...]
    headers: tuple[tuple[bytes, bytes], ...] = ()  # the worker's authorization


class AbortService:
    def __init__(self, metrics: RouterMetrics, repeat_secs: float = REPEAT_SECS) -> None:
        self.metrics = metrics
        self.repeat_secs = repeat_secs
        self._send, self._receive = trio.open_memory_channel[AbortJob](QUEUE_SIZE)
        self._client: httpx2.AsyncClient | None = None

    def request(self, job: AbortJob) -> None:
        """Queue an abort; never blocks (callable from a cancelled task's cleanup)."""
        try:
            self._send.send_nowait(job)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.metrics.aborts.labels(job.role, "dropped").inc()
            log.warning("abort queue full: not aborting %s on %s", job.rids, job.url)

    async def run(self, client: httpx2.AsyncClient, *, task_status: trio.TaskStatus[None]) -> None:
        """The consumer: each job gets its own short task (two POSTs), at most CONCURRENCY."""
        self._client = client
        limiter = trio.CapacityLimiter(CONCURRENCY)
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for job in self._receive:
                await limiter.acquire_on_behalf_of(job)
                nursery.start_soon(self._abort_twice, job, limiter)

    async def _abort_twice(self, job: AbortJob, limiter: trio.CapacityLimiter) -> None:
        try:
            await self._post_all(job)
            await trio.sleep(self.repeat_secs)
            await self._post_all(job)
        finally:
            limiter.release_on_behalf_of(job)

    async def _post_all(self, job: AbortJob) -> None:
        for rid in job.rids:
            await self._post(job, rid)

    async def _post(self, job: AbortJob, rid: str) -> None:
        assert self._client is not None
        with trio.move_on_after(TIMEOUT_SECS):
            try:
                response = await self._client.post(
                    job.url + "/abort_request", json={"rid": rid}, headers=list(job.headers)
                )
            except httpx2.HTTPError as exc:
                self._failed(job, rid, f"{type(exc).__name__}: {exc}")
                return
            if 200 <= response.status_code < 300:
                self.metrics.aborts.labels(job.role, "sent").inc()
            else:
                self._failed(job, rid, f"status {response.status_code}")
            return
        self._failed(job, rid, f"timed out after {TIMEOUT_SECS:g}s")

    def _failed(self, job: AbortJob, rid: str, why: str) -> None:
        self.metrics.aborts.labels(job.role, "failed").inc()
        log.warning("abort of %s on %s (%s) failed: %s", rid, job.url, job.role, why)
