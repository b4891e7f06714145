"""An in-process PD cluster on 127.0.0.1 ephemeral ports: simulator engines and a real router.

`start_cluster(nursery)` starts a prefill and a decode simulator (`trio_pd_testing.engine`) and a
router served by `serve()` on real sockets, ready (one health pass done); `Cluster` holds them and
two clients: the data plane's and the admin listener's (keyless changes are served only there).
The defaults suit tests: engines notice disconnects every half second (SGLang: 4 s) so slot
frees are quick to observe, with a long KV waiting timeout so a decode nobody cancels visibly
hangs; the router runs with aborts on (the production setting), retries and migration off (every
outcome seen as it is) and round robin. trio_pd's own suite is built on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import attrs
import httpx2
import trio

from trio_pd.config import RetryConfig, RouterConfig
from trio_pd.edge.router import Router
from trio_pd.serve.process import Serving, serve
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine import EngineConfig, EngineHandle, serve_engine

ENGINE_DEFAULTS: dict[str, Any] = {"disconnect_poll_secs": 0.5, "waiting_timeout": 60.0}
CLIENT_SECS = 120.0  # a cluster's clients' timeout
ROUTER_DEFAULTS: dict[str, Any] = {
    # The production setting: a leg the router gives up on is aborted in its engine. A test of
    # teardown by the connection alone (the engine's disconnect poll) turns it off itself.
    "abort_on_cancel": True,
    "host": "127.0.0.1",
    "port": 0,
    # The control plane's own door, on a free loopback port: without keys, changes go there.
    "admin_port": 0,
    "request_timeout_secs": 30.0,
    "retry": RetryConfig(enabled=False),
    # Nor are broken streams resumed (`--migration-limit 0`): a test of migration turns it on.
    "migration_limit": 0,
    "policy": attrs.evolve(RouterConfig().policy, policy="round_robin"),
}


@attrs.define
class Cluster:
    prefills: list[EngineHandle]
    decodes: list[EngineHandle]
    router: Router
    url: str
    client: httpx2.AsyncClient
    admin: httpx2.AsyncClient  # the admin listener: keyless changes are served only there

    @property
    def prefill(self) -> EngineHandle:
        return self.prefills[0]

    @property
    def decode(self) -> EngineHandle:
        return self.decodes[0]

    def upstream_connections(self, engine: EngineHandle) -> list[str]:
        """States of the router's pooled connections to one engine."""
        return [state for o, state in self.router.pool.connections() if o == engine.url]


async def start_engine(
    nursery: trio.Nursery, role: Literal["prefill", "decode"], **overrides: Any
) -> EngineHandle:
    options = {**ENGINE_DEFAULTS, **overrides}
    if role == "prefill":
        options.setdefault("bootstrap_port", 0)
    config = EngineConfig(role=role, host="127.0.0.1", port=0, **options)
    return await nursery.start(serve_engine, config)


async def start_router(nursery: trio.Nursery, config: RouterConfig) -> tuple[Router, str]:
    serving: Serving = await nursery.start(partial(serve, config))
    return serving.router, serving.urls[0]


async def start_cluster(
    nursery: trio.Nursery,
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    n_prefill: int = 1,
    n_decode: int = 1,
    **router_options: Any,
) -> Cluster:
    prefills = [await start_engine(nursery, "prefill", **(prefill or {})) for _ in range(n_prefill)]
    decodes = [await start_engine(nursery, "decode", **(decode or {})) for _ in range(n_decode)]
    return await cluster_of(nursery, prefills, decodes, **router_options)


async def cluster_of(
    nursery: trio.Nursery,
    prefills: Sequence[EngineHandle],
    decodes: Sequence[EngineHandle],
    **router_options: Any,
) -> Cluster:
    """A router (ready: one health pass done) in front of engines already running."""
    config = RouterConfig(
        prefill=tuple(WorkerSpec(e.url, "prefill", e.bootstrap_port) for e in prefills),
        decode=tuple(WorkerSpec(e.url, "decode") for e in decodes),
        **{**ROUTER_DEFAULTS, **router_options},
    )
    router, url = await start_router(nursery, config)
    # A hang guard, not a speed bound: two requests of the suite's (a prefill 429 after 300 ms,
    # a burst of 30) once took over 20 s on a 2-core machine at a load average of 18; a hang
    # still fails its test, at this or at the test's own deadline (tests/deadline.py, 240 s).
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(CLIENT_SECS))
    admin_url = router.access.admin_url or "http://127.0.0.1:9"  # none: refused, never used
    admin = httpx2.AsyncClient(base_url=admin_url, timeout=httpx2.Timeout(CLIENT_SECS))
    await wait_until_ready(client)
    return Cluster(list(prefills), list(decodes), router, url, client, admin)


async def wait_until_ready(client: httpx2.AsyncClient) -> None:
    with trio.fail_after(10):
        # Polling, start-up only: readiness is a route, not an event to wait on.
        while (await client.get("/readiness")).status_code != 200:
            await trio.sleep(0.02)
