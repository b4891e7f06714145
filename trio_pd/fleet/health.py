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
- a removed worker's checker is cancelled and never flips it again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_pd.config import HealthConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

Probe = Callable[[Worker], Awaitable[bool]]
JOIN_PROBE_SECS = 1.0


async def probe_once(worker: Worker, config: HealthConfig, probe: Probe) -> bool:
    """One probe under `timeout_secs`; exceptions and timeouts are failures."""
    with trio.move_on_after(config.timeout_secs):
        try:
            return bool(await probe(worker))
        except Exception as exc:
            log.debug("health probe of %s (%s) raised %r", worker.id, worker.url, exc)
            return False
    log.debug("health probe of %s (%s) timed out", worker.id, worker.url)
    return False


async def check_worker(worker: Worker, config: HealthConfig, probe: Probe) -> None:
    """Probe one worker until it is removed, given up at start-up, or (`periodic=False`)
    has passed once."""
    ever_passed = False
    passes = failures = 0
    give_up_at = trio.current_time() + config.startup_timeout_secs
    while not worker.removed:
        started = trio.current_time()
        ok = await probe_once(worker, config, probe)
        if worker.removed:
            return
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
                "(--worker-startup-timeout-secs): giving up on it; remove and add it to retry",
                worker.id, worker.url, config.startup_timeout_secs,
            )  # fmt: skip
            return
        else:
            failures += 1
            passes = 0
            if worker.healthy and failures >= config.failure_threshold:
                worker.healthy = False
                log.warning(
                    "worker %s (%s) is unhealthy after %d failed checks",
                    worker.id,
                    worker.url,
                    failures,
                )
        period = config.interval_secs if ever_passed else min(config.interval_secs, JOIN_PROBE_SECS)
        await trio.sleep_until(started + period)


async def run_health_checks(fleet: Fleet, config: HealthConfig, probe: Probe) -> None:
    """Run forever: one checker per registered worker, started and cancelled as membership
    changes (`fleet.version`)."""
    scopes: dict[Worker, trio.CancelScope] = {}

    async def supervised(worker: Worker, scope: trio.CancelScope) -> None:
        with scope:
            await check_worker(worker, config, probe)

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
