"""After an abort burst, ask the engines whether they let go (issue 25).

The router knows which legs it gave up and which aborts it sent; only the engine knows whether
it released them. So once the aborts to a worker have gone out (`SETTLE_SECS` after the first
of a burst), the worker's own `/v1/loads` is read and what it still holds is compared with the
router's own legs on it:

    held beyond the router = max(0, requests the engine holds - this router's legs in flight)

where the engine's count is, over its DP ranks, running + waiting (on a PD decode this includes
the requests waiting for their KV, its prealloc and transfer queues; on a PD prefill its
bootstrap queue) + a PD prefill's KV transfers still in flight (`prefill_inflight_queue_reqs`,
which `num_waiting_reqs` leaves out: SGLang 0.5.23 `scheduler_components/load_inquirer.py`).
While the figure is above 0 the worker is read again every `SETTLE_SECS`, at most `RECHECKS`
times, so the gauge comes back to 0 when the engine lets go late (its 4 s disconnect poll) and
stays up when it never does.

Exported (docs/operations.md): the gauge `trio_pd_worker_held_beyond_router{worker,role,url}`
(the last audit's figure, 0 before any) and the counter
`trio_pd_release_audits_total{role,result}` (released, held, failed: the loads could not be
read). Limits: requests another router (or a client going straight to the engine) sent count as
held beyond this router, so with shared engines a non-zero figure is a question, not a proof; a
request this router sent a moment ago may not be in the engine's snapshot yet (SGLang publishes
it on its scheduler's events, every 50 ms while it stalls), which only lowers the figure; and an
engine that does not answer is counted `failed`, never "released".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import RouterMetrics

log = logging.getLogger(__name__)

SETTLE_SECS = 0.5  # after the first abort of a burst; SGLang frees an aborted request in ~20 ms
RECHECKS = 10  # a worker still holding more is read again this many times, SETTLE_SECS apart

FetchLoad = Callable[[Worker], Awaitable[EngineLoad | int | None]]


def engine_held(load: EngineLoad | int) -> int:
    """Requests the engine holds by its own load answer (an old engine's `/get_load` total)."""
    if isinstance(load, int):
        return load
    return sum(rank.held for rank in load.ranks)


class ReleaseAudit:
    """Reads a worker's loads after aborts were sent to it; see the module docstring."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: RouterMetrics,
        fetch: FetchLoad,
        *,
        settle_secs: float = SETTLE_SECS,
        rechecks: int = RECHECKS,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.fetch = fetch
        self.settle_secs = settle_secs
        self.rechecks = rechecks
        self._due: dict[str, tuple[float, int]] = {}  # url -> (when, rechecks left)
        self._changed = trio.Event()

    def aborted(self, role: str, url: str) -> None:
        """An abort went out to `url` (the abort service calls this); never blocks."""
        if url not in self._due:
            self._due[url] = (trio.current_time() + self.settle_secs, self.rechecks)
            self._changed.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            now = trio.current_time()
            ready = [(url, left) for url, (when, left) in self._due.items() if when <= now]
            for url, _ in ready:
                del self._due[url]
            if ready:
                async with trio.open_nursery() as nursery:
                    for url, left in ready:
                        nursery.start_soon(self.audit, url, left)
                continue
            self._changed = trio.Event()
            wake = min((when for when, _ in self._due.values()), default=now + 3600.0)
            with trio.move_on_at(wake):
                await self._changed.wait()

    def _worker(self, url: str) -> Worker | None:
        for worker in self.fleet.workers():
            if worker.url == url and not worker.removed:
                return worker
        return None

    async def audit(self, url: str, rechecks_left: int) -> int | None:
        """Read one worker's load; the figure held beyond the router (None: not read)."""
        worker = self._worker(url)
        if worker is None:
            return None
        try:
            load = await self.fetch(worker)
        except Exception as exc:  # a probe of a sick engine: counted, never fatal
            load = None
            log.debug("release audit of %s failed: %r", url, exc)
        if load is None:
            self.metrics.release_audits.labels(worker.role, "failed").inc()
            return None
        beyond = max(0, engine_held(load) - worker.in_flight)
        worker.held_beyond_router = beyond
        self.metrics.release_audits.labels(worker.role, "held" if beyond else "released").inc()
        if beyond:
            if rechecks_left > 0 and url not in self._due:
                self._due[url] = (trio.current_time() + self.settle_secs, rechecks_left - 1)
                self._changed.set()
            elif rechecks_left == 0:
                log.warning(
                    "%s worker %s still holds %d requests beyond this router's legs after its "
                    "aborts (other routers' requests count too)",
                    worker.role,
                    worker.id,
                    beyond,
                )
        return beyond
