"""Helpers for fleet tests over real sockets: hand-built clusters, stoppable engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from tests.conftest import ENGINE_DEFAULTS, Cluster, cluster_of
from trio_pd.config import HealthConfig
from trio_pd_testing.engine import EngineConfig, EngineHandle, serve_engine

# Health checks fast enough for tests over real sockets; bounds on them stay loose (seconds).
FAST_HEALTH = HealthConfig(
    interval_secs=0.2, timeout_secs=1.0, failure_threshold=2, success_threshold=1
)
LOOSE = 5.0


@attrs.define
class Engine:
    """An engine in its own cancel scope, so a test can stop it (and start it again)."""

    handle: EngineHandle
    scope: trio.CancelScope

    def stop(self) -> None:
        self.scope.cancel()


def engine_config(role: str, **overrides: Any) -> EngineConfig:
    options = {**ENGINE_DEFAULTS, **overrides}
    if role == "prefill":
        options.setdefault("bootstrap_port", 0)
    options.setdefault("port", 0)
    return EngineConfig(role=role, host="127.0.0.1", **options)


async def start_stoppable(nursery: trio.Nursery, role: str, **overrides: Any) -> Engine:
    scope = trio.CancelScope()
    config = engine_config(role, **overrides)

    async def run(*, task_status: trio.TaskStatus[EngineHandle]) -> None:
        with scope:
            await serve_engine(config, task_status=task_status)

    handle = await nursery.start(run)
    return Engine(handle, scope)


async def build_cluster(
    nursery: trio.Nursery,
    prefills: Sequence[dict[str, Any]] = ({},),
    decodes: Sequence[dict[str, Any]] = ({},),
    **router_options: Any,
) -> Cluster:
    """Like conftest.start_cluster, but each engine gets its own overrides."""
    p = [(await start_stoppable(nursery, "prefill", **o)).handle for o in prefills]
    d = [(await start_stoppable(nursery, "decode", **o)).handle for o in decodes]
    return await cluster_of(nursery, p, d, **router_options)


def who_started(engines: Sequence[EngineHandle], rid: str) -> list[int]:
    """Indexes of the engines that logged a request_start for `rid` (once per attempt)."""
    return [i for i, e in enumerate(engines) for _ in e.events.find("request_start", rid=rid)]


def rooms_seen(engine: EngineHandle, rid: str) -> list[int]:
    """The first bootstrap room of every attempt `engine` saw for `rid`, in arrival order."""
    return [r["rooms"][0] for r in engine.events.find("request_start", rid=rid)]
