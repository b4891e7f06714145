"""Crash-only supervision of the lifespan's long-lived services (Envoy's rule: never half-alive).

Every service (health checks, load polling, the abort sender, membership sources, eviction,
pruning) runs under `ServiceGuard.supervised`: an unexpected exception is logged with its
traceback, counted (`trio_pd_background_restarts_total{task}`) and the service restarted after a
capped, doubling backoff, so one bug can neither end the lifespan nursery (which would close
every busy connection) nor leave the router routing with its health checks silently stopped.

A service that cannot be kept alive (more than `MAX_CRASHES` crashes within `CRASH_WINDOW_SECS`)
is fatal: the guard records why, readiness answers 503 at once, liveness too, and the process
drains and exits non-zero so its orchestrator (Kubernetes, systemd, the supervisor of `--workers
N`) restarts it. A router whose services died but whose generation routes still answer is the
one state it must never be in: nothing would notice a dead decode, send an abort, or probe a new
worker, while `/health` said 200.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_pd.observe.metrics import RouterMetrics

log = logging.getLogger(__name__)
RESTART_BACKOFF_SECS = (0.1, 30.0)  # first delay, cap (doubling)
MAX_CRASHES = 5  # within CRASH_WINDOW_SECS: the service cannot be kept alive
CRASH_WINDOW_SECS = 60.0
STEADY_SECS = 60.0  # a run that lasted this long resets the backoff


class ServiceGuard:
    """The supervisor of one router process's services, and the judge of their failure."""

    def __init__(self, metrics: RouterMetrics, on_fatal: Callable[[str], None]) -> None:
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.failed: str | None = None  # why the services could not be kept alive

    def fatal(self, reason: str) -> None:
        """Give up on this process: readiness and liveness 503, drain, exit non-zero."""
        if self.failed is None:
            self.failed = reason
            log.critical("%s: this router process cannot keep its services alive; exiting", reason)
            self.on_fatal(reason)

    async def supervised(
        self,
        name: str,
        task: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run `task` forever: restart it (with a doubling, capped backoff) whenever it raises
        or returns; more than `MAX_CRASHES` within `CRASH_WINDOW_SECS` is fatal. Cancellation
        ends it.

        Started with `nursery.start`, the first run gets the task status (a `task_status`
        parameter), so a source's first reconcile is done before startup goes on; restarts do
        not. A first run that ends before reporting itself started still releases startup (else
        one crashing source would hold the router's startup forever).
        """
        delay, cap = RESTART_BACKOFF_SECS
        status = _StartOnce(task_status) if task_status is not trio.TASK_STATUS_IGNORED else None
        crashes: list[float] = []
        while True:
            started = trio.current_time()
            try:
                if status is not None and not status.done:
                    await task(task_status=status)
                else:
                    await task()
                problem = "returned"
            except Exception:
                log.exception("background task %s crashed", name)
                problem = "crashed"
            if status is not None and not status.done:
                status.started()
            now = trio.current_time()
            if now - started > STEADY_SECS:
                delay = RESTART_BACKOFF_SECS[0]
            crashes = [t for t in crashes if now - t < CRASH_WINDOW_SECS] + [now]
            self.metrics.background_restarts.labels(name).inc()
            if len(crashes) > MAX_CRASHES:
                self.fatal(f"background task {name} {problem} {len(crashes)} times in a row")
                await trio.sleep_forever()  # the drain ends the process
            log.error("background task %s %s; restarting it in %.1fs", name, problem, delay)
            await trio.sleep(delay)
            delay = min(cap, delay * 2)


class _StartOnce:
    """A task status that remembers whether it was used."""

    def __init__(self, status: trio.TaskStatus[None]) -> None:
        self.status = status
        self.done = False

    def started(self, value: None = None) -> None:
        if not self.done:
            self.done = True
            self.status.started(value)
