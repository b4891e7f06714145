"""The long-lived tasks of a router process, run in the app-lifespan nursery."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from trio_pd.fleet.health import run_health_checks
from trio_pd.fleet.policies import run_eviction
from trio_pd.fleet.workers import Worker

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
        task_status.started()
