"""Shared fixtures: a real PD cluster (simulator engines + router) on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import httpx2
import pytest
import trio

from trio_pd.config import RetryConfig, RouterConfig
from trio_pd.edge.router import Router
from trio_pd.serve.process import serve
from trio_pd.spec import WorkerSpec
from trio_pd.testing.engine import EngineConfig, EngineHandle, serve_engine

# The real-engine tier (tests/sglang, docs/sglang-tier.md) needs .venv-sglang and real SGLang
# engines; only `make test-sglang` (which sets TRIO_PD_SGLANG_TIER) collects it.
collect_ignore = [] if os.environ.get("TRIO_PD_SGLANG_TIER") else ["sglang"]

# Engines poll for disconnects every half second here (SGLang: 4 s) so slot frees are quick to
# observe; their KV waiting timeout stays long, so a decode nobody cancels would visibly hang.
ENGINE_DEFAULTS: dict[str, Any] = {"disconnect_poll_secs": 0.5, "waiting_timeout": 60.0}
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


async def start_engine(nursery: trio.Nursery, role: str, **overrides: Any) -> EngineHandle:
    options = {**ENGINE_DEFAULTS, **overrides}
    if role == "prefill":
        options.setdefault("bootstrap_port", 0)
    config = EngineConfig(role=role, host="127.0.0.1", port=0, **options)
    return await nursery.start(serve_engine, config)


async def start_router(nursery: trio.Nursery, config: RouterConfig) -> tuple[Router, str]:
    router = Router(config)
    urls = await nursery.start(
        lambda task_status: serve(config, router=router, task_status=task_status)
    )
    return router, urls[0]


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
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0))
    admin_url = router.access.admin_url or "http://127.0.0.1:9"  # none: refused, never used
    admin = httpx2.AsyncClient(base_url=admin_url, timeout=httpx2.Timeout(20.0))
    await wait_until_ready(client)
    return Cluster(list(prefills), list(decodes), router, url, client, admin)


async def wait_until_ready(client: httpx2.AsyncClient) -> None:
    with trio.fail_after(10):
        while (await client.get("/readiness")).status_code != 200:
            await trio.sleep(0.02)


@pytest.fixture
async def cluster(nursery: trio.Nursery) -> AsyncIterator[Cluster]:
    """One prefill, one decode, one router; retries off so every outcome is seen as it is."""
    c = await start_cluster(nursery)
    yield c
    await c.client.aclose()
    await c.admin.aclose()
