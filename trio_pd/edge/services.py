"""The long-lived tasks of a router process, run in the app-lifespan nursery.

Each runs under `supervised`: an unexpected exception is logged with its traceback, counted
(`trio_pd_background_restarts_total{task}`) and the task restarted after a capped backoff, so a
bug in, say, pool pruning can neither end the lifespan nursery (which would close every busy
connection) nor leave the router serving with health checks silently stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import httpx2
import trio

from trio_pd.config import RouterConfig
from trio_pd.control.fanout import parse_load
from trio_pd.fleet.health import run_health_checks
from trio_pd.fleet.loads import poll_loads, polled_roles
from trio_pd.fleet.policies import run_eviction
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker
from trio_pd.membership.source import MembershipSource
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.upstream.headers import worker_authorization
from trio_pd.upstream.pool import UpstreamPool

log = logging.getLogger("trio_pd.background")
STARTUP_POLL_SECS = 0.01
MAX_DP = 1024  # a dp_size beyond this is not believed
METRICS_SYNC_SECS = 1.0
RESTART_BACKOFF_SECS = (0.1, 30.0)  # first delay, cap (doubling)


@attrs.frozen
class ServiceContext:
    """What the long-lived services read: one per router process, built by its lifespan."""

    config: RouterConfig
    fleet: Fleet
    metrics: RouterMetrics
    pool: UpstreamPool
    client: httpx2.AsyncClient  # the control plane's: probes, load polls, aborts
    aborts: AbortService | None
    sources: tuple[MembershipSource, ...]


async def run_background(router: ServiceContext, *, task_status: trio.TaskStatus[None]) -> None:
    """Health checks of every worker, cache-tree eviction and idle-connection pruning."""
    client = router.client
    health = router.config.health
    metrics = router.metrics

    async def probe(worker: Worker) -> bool:
        key = worker.spec.api_key or router.config.api_key
        headers = worker_authorization(key, None)
        response = await client.get(worker.url + health.endpoint, headers=headers)
        ok = 200 <= response.status_code < 300
        due = ok and info_due(worker, health.interval_secs)
        if due and await learn_info(client, worker, headers):
            router.fleet.models_changed()
        return ok

    async with trio.open_nursery() as nursery:
        if router.aborts is not None:
            await nursery.start(router.aborts.run, client)
        for source in router.sources:  # membership first: the first reconcile is done here
            await nursery.start(
                supervised, f"membership_{source.name}", partial(source.run, router.fleet), metrics
            )
        tasks: dict[str, Callable[..., Awaitable[None]]] = {
            "health_checks": lambda: run_health_checks(router.fleet, health, probe),
            "tree_eviction": lambda: run_eviction(
                router.fleet, router.config.policy.eviction_interval_secs
            ),
            "pool_pruning": lambda: prune_idle_connections(router),
        }
        if metrics.multiprocess_dir:
            tasks["metrics_sync"] = lambda: sync_metrics(metrics)
        roles = polled_roles(router.config.policy)
        if roles:
            interval = router.config.load_poll_interval_secs
            fetch = partial(fetch_load, client, router.config.api_key)
            tasks["load_polling"] = lambda: poll_loads(router.fleet, roles, interval, fetch)
        for name, task in tasks.items():
            nursery.start_soon(supervised, name, task, metrics)
        await wait_for_first_pair(router, health.timeout_secs)
        task_status.started()


async def fetch_load(client: httpx2.AsyncClient, api_key: str | None, worker: Worker) -> int:
    """The engine's own count of requests (`num_reqs` of `GET /get_load`, DP ranks summed):
    the figure `GET /get_loads` reports too. SMG compares `num_tokens`; ours is weighed
    against the router's own count of legs, so it must count requests."""
    headers = worker_authorization(worker.spec.api_key or api_key, None)
    response = await client.get(worker.url + "/get_load", headers=headers)
    response.raise_for_status()
    return parse_load(response.content)["num_reqs"]


def info_due(worker: Worker, interval: float) -> bool:
    return worker.info_at is None or trio.current_time() - worker.info_at >= interval


async def learn_info(
    client: httpx2.AsyncClient, worker: Worker, headers: list[tuple[bytes, bytes]]
) -> bool:
    """What a passing worker says about itself: its DP size (`/get_server_info` `dp_size`) and
    the model it serves (`/v1/models`), refreshed at the health interval. A worker that does not
    answer these keeps what was known (dp_size 1, no model: the zero-configuration case).
    True when the worker's model changed."""
    dp_size = served = None
    try:
        info = (await client.get(worker.url + "/get_server_info", headers=headers)).json()
        value = info.get("dp_size") if isinstance(info, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DP:
            dp_size = value
        models = (await client.get(worker.url + "/v1/models", headers=headers)).json()
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            served = data[0].get("id") if isinstance(data[0].get("id"), str) else None
    except (httpx2.HTTPError, ValueError) as exc:
        log.debug("worker %s: no server info (%r)", worker.id, exc)
    return worker.learn(dp_size, served)


async def supervised(
    name: str,
    task: Callable[..., Awaitable[None]],
    metrics: RouterMetrics,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `task` forever: restart it (with a doubling, capped backoff) whenever it raises or
    returns; a run that lasted a minute resets the backoff. Cancellation ends it.

    Started with `nursery.start`, the first run gets the task status (a `task_status`
    parameter), so a source's first reconcile is done before startup goes on; restarts do not.
    A first run that ends before reporting itself started still releases startup (else one
    crashing source would hold the router's startup forever).
    """
    delay, cap = RESTART_BACKOFF_SECS
    status = _StartOnce(task_status) if task_status is not trio.TASK_STATUS_IGNORED else None
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
        if trio.current_time() - started > 60:
            delay = RESTART_BACKOFF_SECS[0]
        log.error("background task %s %s; restarting it in %.1fs", name, problem, delay)
        metrics.background_restarts.labels(name).inc()
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


async def prune_idle_connections(router: ServiceContext) -> None:
    """Close upstream connections idle past their keep-alive, so none lingers after a burst."""
    while True:
        await trio.sleep(router.pool.keepalive_expiry)
        await router.pool.prune()


async def sync_metrics(metrics: RouterMetrics) -> None:
    """`--workers N`: copy this process's gauges to the shared directory every second."""
    while True:
        metrics.sync_gauges()
        await trio.sleep(METRICS_SYNC_SECS)


async def wait_for_first_pair(router: ServiceContext, limit_secs: float) -> None:
    """Hold startup until the first health round found a prefill and a decode, or `limit_secs`.

    Workers start unhealthy; without this the first requests after a start would get 503 while
    the first probes are still in flight. A fleet that stays down does not block startup.
    """
    fleet = router.fleet
    with trio.move_on_after(limit_secs):
        # Polling, startup only: health flips carry no event to wait on.
        while not (fleet.routable("prefill") and fleet.routable("decode")):  # noqa: ASYNC110
            await trio.sleep(STARTUP_POLL_SECS)
