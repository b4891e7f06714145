"""A worker that fails its health checks says why (issue 18, finding 11): a WARNING line with the
reason as soon as it fails while it has never passed (not DEBUG, not only after 30 minutes),
the reason in GET /workers, and `trio_pd_health_check_failures_total{worker,role,kind}`.

Two real misconfigurations over real sockets: a worker URL whose port refuses connections, and
an `https://` worker that serves plain HTTP (a TLS misconfiguration)."""

from __future__ import annotations

import logging

import pytest
import trio

from tests.conftest import start_engine
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import settle
from trio_pd.config import RouterConfig
from trio_pd.spec import WorkerSpec
from trio_pd_testing.ports import free_port


async def router_with_bad_decode(nursery: trio.Nursery, decode_url: str):
    from tests.conftest import ROUTER_DEFAULTS, start_router

    prefill = await start_engine(nursery, "prefill")
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(decode_url, "decode"),),
        **{**ROUTER_DEFAULTS, "health": FAST_HEALTH},
    )
    return await start_router(nursery, config)


@pytest.mark.parametrize("case", ["refused", "tls"])
async def test_a_worker_that_never_passes_says_why(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    caplog.set_level(logging.INFO, logger="trio_pd")
    if case == "refused":
        url, kind, words = f"http://127.0.0.1:{free_port()}", "connect", "ConnectError"
    else:  # the engine speaks plain HTTP; the router was told https
        plain = await start_engine(nursery, "decode")
        url, kind, words = plain.url.replace("http://", "https://"), "tls", "TLS"
    router, base = await router_with_bad_decode(nursery, url)
    worker = router.fleet.workers("decode")[0]
    failures = router.metrics.health_check_failures.labels(worker.id, "decode", kind)
    # Provoked: the checker has failed this worker with this kind at least once ...
    await settle(lambda: failures._value.get() >= 1, LOOSE)
    assert not worker.healthy
    # ... and it says so where an operator looks: the log at WARNING, with the reason ...
    lines = [
        r for r in caplog.records
        if r.levelno == logging.WARNING and worker.id in r.getMessage()
        and "has not passed its health check" in r.getMessage()
    ]  # fmt: skip
    assert lines, [r.getMessage() for r in caplog.records]
    assert words in lines[0].getMessage()
    # ... and GET /workers.
    import httpx2

    async with httpx2.AsyncClient(base_url=base) as client:
        listed = (await client.get("/workers")).json()["workers"]
        shown = next(w for w in listed if w["id"] == worker.id)
        assert shown["is_healthy"] is False and shown["status"] == "pending"
        assert shown["health_error"].startswith(f"{kind}: ")
        assert words in shown["health_error"]
        # A client's 503 does not carry internal addresses.
        answer = await client.post("/generate", json={"text": "hi"})
        assert answer.status_code == 503
        assert url not in answer.text


async def test_the_same_reason_is_not_logged_at_every_check(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_pd")
    router, _ = await router_with_bad_decode(nursery, f"http://127.0.0.1:{free_port()}")
    worker = router.fleet.workers("decode")[0]
    failures = router.metrics.health_check_failures.labels(worker.id, "decode", "connect")
    await settle(lambda: failures._value.get() >= 4, LOOSE)  # 4 checks, ~1 s apart
    warned = [
        r for r in caplog.records
        if r.levelno == logging.WARNING and "has not passed its health check" in r.getMessage()
    ]  # fmt: skip
    assert len(warned) == 1  # once per reason per minute, not once per second
