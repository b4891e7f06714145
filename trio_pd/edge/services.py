"""The long-lived services of a router process, run in the app-lifespan nursery.

Health checks of every worker (learning, as a check passes, what the engine says about itself:
its DP width, KV transfer backend and model), load polling, the abort sender, the membership
sources, cache-tree eviction, idle-connection pruning, vLLM prefills' lease counters and, with
`--workers N`, the metrics sync.
Each runs under the process's `ServiceGuard` (`supervision.py`): restarted when it crashes, and
fatal to the process when it cannot be kept alive.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import httpx2
import trio

from trio_pd.config import RouterConfig
from trio_pd.control.engine_info import (
    EngineInfoError,
    LoadReportRejected,
    fetch_load,
    fetch_served_model,
    fetch_server_info,
)
from trio_pd.control.release_audit import ReleaseAudit
from trio_pd.control.vllm_leases import MAX_PAGE, LeaseWatch
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.fleet.health import ProbeFailed, run_health_checks
from trio_pd.fleet.loads import poll_loads, polled_roles
from trio_pd.fleet.policies import run_eviction
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad
from trio_pd.fleet.worker import Worker
from trio_pd.membership.source import MembershipSource
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.upstream.headers import generation_key, worker_authorization
from trio_pd.upstream.pool import UpstreamPool

log = logging.getLogger(__name__)
STARTUP_POLL_SECS = 0.01
METRICS_SYNC_SECS = 1.0


@attrs.frozen
class ServiceContext:
    """What the long-lived services read: one per router process, built by its lifespan."""

    config: RouterConfig
    fleet: Fleet
    metrics: RouterMetrics
    pool: UpstreamPool
    client: httpx2.AsyncClient  # the control plane's: probes, load polls
    aborts: AbortService | None
    sources: tuple[MembershipSource, ...]
    guard: ServiceGuard


def removes_unhealthy(config: RouterConfig) -> bool:
    """`--remove-unhealthy-workers`, or by default whether a discovery source can add a removed
    worker back (SMG 1.13's conditional default)."""
    chosen = config.health.remove_unhealthy_workers
    if chosen is not None:
        return chosen
    return config.kubernetes is not None or config.discovery_provider == "file"


async def run_background(ctx: ServiceContext, *, task_status: trio.TaskStatus[None]) -> None:
    """Start every service (membership first: its first reconcile is done before startup goes
    on), then hold startup until the first health round found a pair (or its timeout)."""
    health = ctx.config.health
    supervised = ctx.guard.supervised
    async with trio.open_nursery() as nursery:
        if ctx.aborts is not None:
            await nursery.start(supervised, "aborts", partial(ctx.aborts.run, ctx.pool))
            audit = ReleaseAudit(ctx.fleet, ctx.metrics, partial(worker_load, ctx))
            ctx.aborts.on_sent = audit.aborted
            await nursery.start(supervised, "release_audit", audit.run)
        for source in ctx.sources:
            await nursery.start(
                supervised, f"membership_{source.name}", partial(source.run, ctx.fleet)
            )
        tasks: dict[str, Callable[..., Awaitable[None]]] = {
            "health_checks": partial(
                run_health_checks,
                ctx.fleet,
                health,
                partial(probe, ctx),
                partial(count_failure, ctx.metrics),
                remove_given_up=removes_unhealthy(ctx.config),
            ),
            "tree_eviction": partial(
                run_eviction, ctx.fleet, ctx.config.policy.eviction_interval_secs
            ),
            "pool_pruning": partial(prune_idle_connections, ctx.pool),
            "vllm_leases": LeaseWatch(
                ctx.fleet, partial(engine_metrics, ctx), health.interval_secs
            ).run,
        }
        kv = ctx.fleet.kv_policy()
        if kv is not None:  # the prefill engines' KV events (`fleet/kv_feeds.py`)
            tasks["kv_events"] = partial(kv.run, ctx.fleet)
        if ctx.metrics.multiprocess_dir:
            tasks["metrics_sync"] = partial(sync_metrics, ctx.metrics)
        roles = polled_roles(ctx.config.policy, ctx.config.overload)
        if roles:
            interval = ctx.config.load_poll_interval_secs
            fetch = partial(worker_load, ctx)
            tasks["load_polling"] = partial(poll_loads, ctx.fleet, roles, interval, fetch)
        for name, task in tasks.items():
            nursery.start_soon(supervised, name, task)
        await wait_for_first_pair(ctx.fleet, health.timeout_secs)
        task_status.started()


def worker_headers(ctx: ServiceContext, worker: Worker) -> list[tuple[bytes, bytes]]:
    return worker_authorization(generation_key(worker.spec, ctx.config.api_key), None)


async def probe(ctx: ServiceContext, worker: Worker) -> bool:
    """One health check: `GET <endpoint>` answers 2xx. A passing worker due for it is asked
    what it is (its server info and model, at the health interval)."""
    headers = worker_headers(ctx, worker)
    endpoint = ctx.config.health.endpoint
    try:
        response = await ctx.client.get(worker.url + endpoint, headers=headers)
    except httpx2.HTTPError as exc:
        raise ProbeFailed(*transport_reason(exc)) from None
    if not 200 <= response.status_code < 300:
        raise ProbeFailed("status", f"GET {endpoint} answered {response.status_code}")
    if info_due(worker, ctx.config.health.interval_secs) and await learn_info(ctx, worker):
        ctx.fleet.models_changed()
    return True


def transport_reason(exc: httpx2.HTTPError) -> tuple[str, str]:
    """(kind, reason) of a probe that never got an answer: a TLS failure says so."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return "tls", f"TLS: {cause}"
        cause = cause.__cause__ or cause.__context__
    kind = "connect" if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout) else "error"
    text = str(exc) or type(exc).__name__
    return kind, f"{type(exc).__name__}: {text}"


def count_failure(metrics: RouterMetrics, worker: Worker, kind: str, reason: str) -> None:
    metrics.health_check_failures.labels(worker.id, worker.role, kind).inc()


def info_due(worker: Worker, interval: float) -> bool:
    return worker.info_at is None or trio.current_time() - worker.info_at >= interval


async def learn_info(ctx: ServiceContext, worker: Worker) -> bool:
    """What a passing worker says about itself: its server info (`/server_info`: DP width,
    transfer backend, running window) and the model it serves (`/v1/models`). A worker that
    does not answer these keeps what was known (one rank, no model: the zero-configuration
    case). True when the worker's model changed."""
    headers = worker_headers(ctx, worker)
    info = served = None
    try:
        info = await fetch_server_info(ctx.client, worker.url, headers)
    except (httpx2.HTTPError, EngineInfoError) as exc:
        log.debug("worker %s: no server info (%r)", worker.id, exc)
    try:
        served = await fetch_served_model(ctx.client, worker.url, headers)
    except (httpx2.HTTPError, EngineInfoError) as exc:
        log.debug("worker %s: no model list (%r)", worker.id, exc)
    return worker.learn(info, served)


async def worker_load(ctx: ServiceContext, worker: Worker) -> EngineLoad | None:
    """One worker's load (`/v1/loads`, `/get_load` on older engines: a worker found to be one
    is asked the old endpoint from then on, `Worker.legacy_load`); None for a report that
    cannot be true, after the fleet marked the worker's load unknown."""
    headers = worker_headers(ctx, worker)
    try:
        return await fetch_load(ctx.client, worker.url, headers, worker.legacy_load)
    except LoadReportRejected as exc:
        ctx.fleet.reject_load(worker, exc.reason, str(exc))
        return None


async def engine_metrics(ctx: ServiceContext, worker: Worker) -> str:
    """A worker's Prometheus page (`GET /metrics`), refused when larger than `MAX_PAGE`."""
    response = await ctx.client.get(worker.url + "/metrics", headers=worker_headers(ctx, worker))
    response.raise_for_status()
    if len(response.content) > MAX_PAGE:
        raise ValueError(f"a metrics page of {len(response.content)} bytes")
    return response.text


async def prune_idle_connections(pool: UpstreamPool) -> None:
    """Close upstream connections idle past their keep-alive, so none lingers after a burst."""
    while True:
        await trio.sleep(pool.prune_interval)
        await pool.prune()


async def sync_metrics(metrics: RouterMetrics) -> None:
    """`--workers N`: copy this process's gauges to the shared directory every second."""
    while True:
        metrics.sync_gauges()
        await trio.sleep(METRICS_SYNC_SECS)


async def wait_for_first_pair(fleet: Fleet, limit_secs: float) -> None:
    """Hold startup until the first health round found a prefill and a decode, or `limit_secs`.

    Workers start unhealthy; without this the first requests after a start would get 503 while
    the first probes are still in flight. A fleet that stays down does not block startup.
    """
    with trio.move_on_after(limit_secs):
        # Polling, startup only: health flips carry no event to wait on.
        while not (fleet.routable("prefill") and fleet.routable("decode")):  # noqa: ASYNC110
            await trio.sleep(STARTUP_POLL_SECS)
