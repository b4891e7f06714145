"""Crash-only, never half-alive (issue 19, finding 1): every long-lived service of the lifespan
runs supervised. Killed once, each is restarted and the router goes on (its health checks still
notice a dead engine); one that cannot be kept alive makes readiness and liveness 503 and ends
the process with a non-zero status, instead of leaving `/health` 200 over dead services while
generation keeps answering.

Each service is killed by patching the function the lifespan runs it with (the same names
`edge/services.py` calls), on a real router over real sockets."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
import trio

from tests.conftest import ROUTER_DEFAULTS, start_engine, wait_until_ready
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body, settle
from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.edge import services
from trio_pd.edge.router import Router
from trio_pd.pd.aborts import AbortService
from trio_pd.serve.process import Serving, serve
from trio_pd.spec import WorkerSpec

# The services and the name under which each is patched (module attribute or method).
SERVICES = {
    "health_checks": (services, "run_health_checks"),
    "tree_eviction": (services, "run_eviction"),
    "pool_pruning": (services, "prune_idle_connections"),
    "load_polling": (services, "poll_loads"),
    "aborts": (AbortService, "run"),
}


def crashing(original: Any, crashes: int | None) -> Any:
    """`original`, raising its first `crashes` runs (None: every run)."""
    runs = {"n": 0}

    async def run(*args: Any, **kwargs: Any) -> None:
        runs["n"] += 1
        if crashes is None or runs["n"] <= crashes:
            raise RuntimeError(f"injected crash {runs['n']}")
        await original(*args, **kwargs)

    run.runs = runs  # type: ignore[attr-defined]
    return run


async def start(nursery: trio.Nursery) -> tuple[Router, str, trio.CancelScope, dict[str, Any]]:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(decode.url, "decode"),),
        **{
            **ROUTER_DEFAULTS,
            "health": FAST_HEALTH,
            "abort_on_cancel": True,
            # power_of_two: so the load polling service runs too.
            "policy": PolicyConfig(policy="power_of_two"),
            "load_poll_interval_secs": 0.2,
        },
    )
    scope = trio.CancelScope()
    done: dict[str, Any] = {}

    async def run(*, task_status: trio.TaskStatus[Serving]) -> None:
        with scope:
            await serve(config, task_status=task_status)
            done["exited"] = True

    serving: Serving = await nursery.start(run)
    return serving.router, serving.urls[0], scope, done


@pytest.mark.parametrize("name", sorted(SERVICES))
async def test_a_service_killed_once_is_restarted_and_the_router_goes_on(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    owner, attribute = SERVICES[name]
    patched = crashing(getattr(owner, attribute), crashes=1)
    monkeypatch.setattr(owner, attribute, patched)
    router, url, scope, _ = await start(nursery)
    restarts = router.metrics.background_restarts.labels(name)
    await settle(lambda: patched.runs["n"] >= 2, LOOSE)  # provoked: it crashed, then ran again
    assert restarts._value.get() == 1
    async with httpx2.AsyncClient(base_url=url, timeout=10) as client:
        await wait_until_ready(client)
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/generate", json=generate_body())).status_code == 200
    assert router.guard.failed is None
    scope.cancel()


async def test_a_service_that_cannot_be_kept_alive_ends_the_process(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched = crashing(services.run_health_checks, crashes=None)
    monkeypatch.setattr(services, "run_health_checks", patched)
    router, url, _, done = await start(nursery)
    async with httpx2.AsyncClient(base_url=url, timeout=10) as client:
        # Provoked: it crashed more often than the guard tolerates ...
        await settle(lambda: router.guard.failed is not None, LOOSE)
        assert patched.runs["n"] > 5
        assert "health_checks" in router.guard.failed
        # ... so the process stops saying it is fine, and ends (the drain), non-zero.
        with trio.move_on_after(LOOSE):
            while "exited" not in done:
                for path in ("/readiness", "/health"):
                    try:
                        response = await client.get(path)
                    except httpx2.TransportError:
                        break  # the listener is already closed: the drain is on
                    assert response.status_code == 503, (path, response.text)
                await trio.sleep(0.05)
    assert done.get("exited")
    assert router.drain.exit_status == 1
