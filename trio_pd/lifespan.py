"""The long-lived tasks of a router process, run in the app-lifespan nursery."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from trio_pd.fleet.health import run_health_checks
from trio_pd.fleet.policies import run_eviction
from trio_pd.fleet.workers import Worker

STARTUP_POLL_SECS = 0.01

if TYPE_CHECKING:
    from trio_pd.app import Router


async def run_background(router: Router, *, task_status: trio.TaskStatus[None]) -> None:
    """Health checks of every worker and the cache-aware trees' periodic eviction."""
    client = router.client
    assert client is not None
    health = router.config.health

    async def probe(worker: Worker) -> bool:
        response = await client.get(worker.url + health.endpoint)
        return 200 <= response.status_code < 300

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, router.fleet, health, probe)
        nursery.start_soon(run_eviction, router.fleet, router.config.policy.eviction_interval_secs)
        nursery.start_soon(prune_idle_connections, router)
        await wait_for_first_pair(router, health.timeout_secs)
        task_status.started()


async def prune_idle_connections(router: Router) -> None:
    """Close upstream connections idle past their keep-alive, so none lingers after a burst."""
    while True:
        await trio.sleep(router.pool.keepalive_expiry)
        await router.pool.prune()


async def wait_for_first_pair(router: Router, limit_secs: float) -> None:
    """Hold startup until the first health round found a prefill and a decode, or `limit_secs`.

    Workers start unhealthy; without this the first requests after a start would get 503 while
    the first probes are still in flight. A fleet that stays down does not block startup.
    """
    fleet = router.fleet
    with trio.move_on_after(limit_secs):
        # Polling, startup only: health flips carry no event to wait on.
        while not (fleet.available("prefill") and fleet.available("decode")):  # noqa: ASYNC110
            await trio.sleep(STARTUP_POLL_SECS)
