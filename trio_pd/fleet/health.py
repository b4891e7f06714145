"""Active health checks: one checker task per worker, following fleet membership.

Rules (SMG's thresholds, with one exception for new workers):
- a worker starts unhealthy; its first check runs at once (at start, or when added at runtime),
  then every `interval_secs` (measured start to start); until it has passed once it is probed
  every `JOIN_PROBE_SECS` at most, so a router started before its engines (or a worker added
  before its engine is up) picks them up within a second, not after a whole interval;
- until a worker has passed once, a single pass makes it healthy (a booting engine joins as soon
  as it answers); after that, `success_threshold` consecutive passes bring it back up;
- a worker that has not passed within `startup_timeout_secs` of being added is given up
  (`--worker-startup-timeout-secs`): never probed again, never routed to, shown in /workers as
  `startup_timed_out`. That is SMG 0.3.2's registration: its first step probes the worker until
  it answers (`core/steps/worker/local/mod.rs`, `detect_connection.rs`) and, past the timeout,
  the worker is never registered (the router keeps running, unready without a pair). Removing
  and adding it again, or a source handing a changed record (a new pod), starts afresh;
- with `periodic=False` (`--disable-health-check`) the start-up check stays (SMG's registration
  still probes) and nothing is checked after a worker's first pass: it stays healthy (SMG starts
  no health checker and `check_health_async` reports healthy, `server.rs`, `core/worker.rs`);
- `failure_threshold` consecutive failures take it down; a probe that raises or outlives
  `timeout_secs` is a failure;
- a removed worker's checker is cancelled and never flips it again;
- every failure says why (`ProbeFailed`, or the exception or timeout), kept on the worker
  (`health_error`, shown by `GET /workers`; never in a client's 503, which must not show workers),
  handed to `on_failure` (the router counts it: `trio_pd_health_check_failures_total`) and
  logged: at WARNING when a worker goes down or, while it has never passed, when the reason
  changes and at most every `REPEAT_LOG_SECS` while it stays the same; so a worker that never
  comes up (a TLS misconfiguration, a wrong port) says why within its first second.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_pd.config import HealthConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

Probe = Callable[[Worker], Awaitable[bool | None]]  # False, or raising: a failure
OnFailure = Callable[[Worker, str, str], None]  # (worker, kind, reason)
JOIN_PROBE_SECS = 1.0
REPEAT_LOG_SECS = 60.0


class ProbeFailed(Exception):
    """A probe's failure with its kind (status, connect, tls, timeout, answer, error) and why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


async def probe_once(worker: Worker, config: HealthConfig, probe: Probe) -> ProbeFailed | None:
    """One probe under `timeout_secs`: None if it passed, else why it failed."""
    with trio.move_on_after(config.timeout_secs):
        try:
            ok = await probe(worker)
        except ProbeFailed as failed:
            return failed
        except Exception as exc:
            return ProbeFailed("error", f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))
        return None if ok is not False else ProbeFailed("error", "the probe reported a failure")
    return ProbeFailed("timeout", f"no answer within {config.timeout_secs:g}s")


class FailureLog:
    """When a worker's failing checks are worth a WARNING line (see the module docstring)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.logged_at = -float("inf")

    def due(self, reason: str) -> bool:
        now = trio.current_time()
        if reason != self.reason or now - self.logged_at >= REPEAT_LOG_SECS:
            self.reason, self.logged_at = reason, now
            return True
        return False


async def check_worker(
    worker: Worker, config: HealthConfig, probe: Probe, on_failure: OnFailure | None = None
) -> None:
    """Probe one worker until it is removed, given up at start-up, or (`periodic=False`)
    has passed once."""
    ever_passed = False
    passes = failures = 0
    give_up_at = trio.current_time() + config.startup_timeout_secs
    failure_log = FailureLog()
    while not worker.removed:
        started = trio.current_time()
        failed = await probe_once(worker, config, probe)
        if worker.removed:
            return
        ok = failed is None
        worker.health_error = None if failed is None else f"{failed.kind}: {failed.reason}"
        if failed is not None:
            if on_failure is not None:
                on_failure(worker, failed.kind, failed.reason)
            if not ever_passed and failure_log.due(failed.reason):
                log.warning(
                    "worker %s (%s) has not passed its health check yet: %s",
                    worker.id, worker.url, worker.health_error,
                )  # fmt: skip
            elif ever_passed:
                log.info("worker %s (%s) failed a health check: %s", worker.id, worker.url,
                         worker.health_error)  # fmt: skip
        if ok:
            passes += 1
            failures = 0
            if not worker.healthy and (not ever_passed or passes >= config.success_threshold):
                worker.healthy = True
                log.info("worker %s (%s) is healthy", worker.id, worker.url)
            ever_passed = True
            if not config.periodic:
                log.info("worker %s: health checks are disabled from now on", worker.id)
                return
        elif not ever_passed and trio.current_time() >= give_up_at:
            worker.startup_timed_out = True
            log.error(
                "worker %s (%s) did not pass a health check within %gs of being added "
                "(--worker-startup-timeout-secs): giving up on it; remove and add it to retry. "
                "The last check: %s",
                worker.id, worker.url, config.startup_timeout_secs, worker.health_error,
            )  # fmt: skip
            return
        else:
            failures += 1
            passes = 0
            if worker.healthy and failures >= config.failure_threshold:
                worker.healthy = False
                log.warning(
                    "worker %s (%s) is unhealthy after %d failed checks; the last: %s",
                    worker.id,
                    worker.url,
                    failures,
                    worker.health_error,
                )
        period = config.interval_secs if ever_passed else min(config.interval_secs, JOIN_PROBE_SECS)
        await trio.sleep_until(started + period)


async def run_health_checks(
    fleet: Fleet,
    config: HealthConfig,
    probe: Probe,
    on_failure: OnFailure | None = None,
    *,
    remove_given_up: bool = False,
) -> None:
    """Run forever: one checker per registered worker, started and cancelled as membership
    changes (`fleet.version`). `remove_given_up` (`--remove-unhealthy-workers`): a worker
    given up at start-up is removed from the fleet (its source's next full set adds it again,
    with a fresh checker)."""
    scopes: dict[Worker, trio.CancelScope] = {}

    async def supervised(worker: Worker, scope: trio.CancelScope) -> None:
        with scope:
            await check_worker(worker, config, probe, on_failure)
        if remove_given_up and worker.startup_timed_out and not worker.removed:
            log.warning(
                "worker %s (%s) removed after giving up on it (--remove-unhealthy-workers): "
                "its source %s adds it again to be probed afresh", worker.id, worker.url,
                worker.source,
            )  # fmt: skip
            fleet.remove(worker.id)

    async with trio.open_nursery() as nursery:
        version = -1
        while True:
            version = fleet.version
            current = fleet.workers()
            present = set(current)
            for worker in [w for w in scopes if w not in present]:
                scopes.pop(worker).cancel()
            for worker in current:
                if worker not in scopes:
                    scopes[worker] = trio.CancelScope()
                    nursery.start_soon(supervised, worker, scopes[worker])
            await fleet.wait_changed(version)
