"""Polling the engines' own load for power_of_two (`--worker-startup-check-interval`).

Despite its name and help text, SMG 0.3.2 uses that flag for one thing only: the interval of its
LoadMonitor (`app_context.rs: with_load_monitor`, `core/worker_manager.rs: LoadMonitor`), which
asks every worker's `GET /get_load` at once and then every interval, and hands the figures to the
power_of_two policies (nothing happens while no policy is power_of_two). Its start-up probing has
a fixed backoff of its own (1 s, 2 s, ... 5 s), which the flag does not touch.

Here the workers of each role whose policy is power_of_two are polled the same way, the healthy
ones (only they can be chosen), at SGLang 0.5.23's `GET /v1/loads` (its `/get_load` is gone; an
older engine's is asked when `/v1/loads` answers 404: `control/engine_info.py`), and each answer
goes to `Worker.report_load`: `Worker.load()` then counts the engine's figure while it is fresh,
so requests sent by other routers weigh too. Roles with another policy are not polled, as in SMG
0.3.2, unless overload protection is on (SMG 1.13's default, docs/overload.md): then every role
is, since the veto reads every worker's. An engine figure that reaches a worker anyway (`GET
/get_loads` reports every worker's) counts in `Worker.load()` while fresh, for any policy that
reads load (cache-aware's balance check, manual's `min_load`): it is what the engine said it
holds, and freshness bounds how long it speaks."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from trio_pd.config import OverloadConfig, PolicyConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad
from trio_pd.fleet.worker import Worker
from trio_pd.spec import ROLES, Role

log = logging.getLogger(__name__)

FetchLoad = Callable[[Worker], Awaitable[EngineLoad | int | None]]
FETCH_TIMEOUT_SECS = 5.0  # SMG's REQUEST_TIMEOUT for a load poll
LOAD_POLICIES = ("power_of_two", "least_load")


def polled_roles(policy: PolicyConfig, overload: OverloadConfig | None = None) -> tuple[Role, ...]:
    """The roles whose choices use the engines' loads: every role while overload protection
    is on (`fleet/overload.py`), else power_of_two's and least_load's (SMG's
    `needs_backend_loads`)."""
    if overload is not None and overload.protection:
        return ROLES
    return tuple(role for role in ROLES if policy.for_role(role) in LOAD_POLICIES)


async def poll_loads(
    fleet: Fleet, roles: Sequence[Role], interval_secs: float, fetch: FetchLoad
) -> None:
    """Forever: every `interval_secs` (start to start, the first at once) ask each healthy
    worker of `roles` for its load, concurrently."""
    while True:
        started = trio.current_time()
        workers = [worker for role in roles for worker in fleet.routable(role)]
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(poll_one, worker, fetch)
        await trio.sleep_until(started + interval_secs)


async def poll_one(worker: Worker, fetch: FetchLoad) -> None:
    """One worker's load, within FETCH_TIMEOUT_SECS; a failure leaves the last report alone
    (it goes stale on its own)."""
    with trio.move_on_after(FETCH_TIMEOUT_SECS):
        try:
            load = await fetch(worker)
        except Exception as exc:
            log.debug("load of %s (%s) unknown: %r", worker.id, worker.url, exc)
            return
        if load is not None and not worker.removed:
            worker.report_load(load)
