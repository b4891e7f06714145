"""`--worker-startup-timeout-secs` and `--disable-health-check` on real `trio-pd serve` processes,
with SMG 0.3.2's meaning: the router serves at once and is unready until a prefill and a decode
answer; a worker that does not answer within the timeout is given up (never probed again, never
routed to; removing and adding it retries) while the router keeps running; with health checks
disabled a worker is checked until its first pass and then trusted. What the engines saw comes
from their event logs (`info_request` is every probe or poll they answered)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import PROCESSES_SECS, ServeProcess, free_port, start_serve
from tests.router.fleet_tools import start_stoppable
from tests.router.helpers import eventually, generate_body
from trio_pd.cli.main import build_parser, router_config
from trio_pd_testing.engine import EngineHandle

LOOSE = 10.0


def health_probes(engine: EngineHandle) -> int:
    return len(engine.events.find("info_request", path="/health"))


async def wait_alive(router: ServeProcess, client: httpx2.AsyncClient) -> None:
    with trio.fail_after(PROCESSES_SECS):
        while True:
            assert router.process.returncode is None, router.log()
            try:
                if (await client.get("/liveness")).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            await trio.sleep(0.1)


async def decode_worker(client: httpx2.AsyncClient) -> dict:
    (worker,) = [
        w for w in (await client.get("/workers")).json()["workers"] if w["id"] == "decode-1"
    ]
    return worker


def test_flags_and_smgs_defaults() -> None:
    defaults = router_config(build_parser().parse_args(["serve"]))
    assert defaults.health.startup_timeout_secs == 1800
    assert defaults.load_poll_interval_secs == 30
    assert defaults.health.periodic is True
    args = ["serve", "--worker-startup-timeout-secs", "5", "--worker-startup-check-interval", "2"]
    config = router_config(build_parser().parse_args([*args, "--disable-health-check"]))
    assert config.health.startup_timeout_secs == 5 and config.load_poll_interval_secs == 2
    assert config.health.periodic is False
    for flag in ("--worker-startup-timeout-secs", "--worker-startup-check-interval"):
        with pytest.raises(SystemExit):  # SMG refuses 0 (config/validation.rs)
            router_config(build_parser().parse_args(["serve", flag, "0"]))


async def test_the_router_serves_unready_and_a_late_engine_joins(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode_port = free_port()  # the decode engine is still "loading": nothing listens yet
    router = await start_serve(
        [prefill], [], str(tmp_path / "router.log"),
        "--decode", f"http://127.0.0.1:{decode_port}", "--worker-startup-timeout-secs", "60",
    )  # fmt: skip
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as client:
            await wait_alive(router, client)
            ready = await client.get("/readiness")
            assert ready.status_code == 503
            assert "no available decode worker" in ready.json()["error"]["message"]
            refused = await client.post("/generate", json=generate_body())
            assert refused.status_code == 503
            worker = await decode_worker(client)
            assert worker["is_healthy"] is False and "startup_timed_out" not in worker

            decode = await start_stoppable(nursery, "decode", port=decode_port)
            await eventually(
                lambda: ready_now(client), LOOSE, "the late decode joins (probed every second)"
            )
            response = await client.post("/generate", json=generate_body())
            assert response.status_code == 200
            assert decode.handle.events.find("request_start", rid=response.headers["x-request-id"])
    finally:
        await router.stop()


async def ready_now(client: httpx2.AsyncClient) -> bool:
    return (await client.get("/readiness")).status_code == 200


async def test_a_worker_not_up_within_the_timeout_is_given_up(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode_port = free_port()
    decode_url = f"http://127.0.0.1:{decode_port}"
    router = await start_serve(
        [prefill], [], str(tmp_path / "router.log"),
        "--decode", decode_url, "--worker-startup-timeout-secs", "2",
    )  # fmt: skip
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as client:
            await wait_alive(router, client)

            async def given_up() -> bool:
                return bool((await decode_worker(client)).get("startup_timed_out"))

            await eventually(given_up, LOOSE, "the decode is given up")
            assert "did not pass a health check within 2s" in router.log()
            # SMG's behaviour: the router keeps running, unready, without that worker.
            assert router.process.returncode is None
            assert (await client.get("/liveness")).status_code == 200
            assert (await client.get("/readiness")).status_code == 503
            refused = await client.post("/generate", json=generate_body())
            assert refused.status_code == 503
            assert "never came up" in refused.json()["error"]["message"]

            # The engine comes up after all: nobody asks it anything, no traffic goes to it.
            decode = await start_stoppable(nursery, "decode", port=decode_port)
            await trio.sleep(2.5)  # probed every second were it still waited for
            assert not decode.handle.events.find("info_request")
            assert (await client.get("/readiness")).status_code == 503

            # Removing and adding it again retries, as re-registering does in SMG.
            async with httpx2.AsyncClient(base_url=router.admin_url) as admin:
                assert (await admin.delete("/workers/decode-1")).status_code == 202
                body = {"url": decode_url, "worker_type": "decode"}
                assert (await admin.post("/workers", json=body)).status_code == 202
            await eventually(lambda: ready_now(client), LOOSE, "the re-added decode joins")
            assert decode.handle.events.find("info_request", path="/health")
            assert (await client.post("/generate", json=generate_body())).status_code == 200
    finally:
        await router.stop()


@pytest.mark.parametrize("disabled", [True, False])
async def test_disable_health_check_trusts_a_worker_after_its_first_pass(
    nursery: trio.Nursery, tmp_path: Path, disabled: bool
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    flags = ["--health-check-interval-secs", "0.5", "--health-failure-threshold", "2"]
    if disabled:
        flags.append("--disable-health-check")
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), *flags)
    try:
        await router.wait_ready()
        assert health_probes(decode) >= 1  # SMG's registration checks it too
        # The engine's /health fails from now on (generation still works).
        decode.state.health_status = 503
        seen = health_probes(decode)
        await trio.sleep(2.5)  # five intervals
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as client:
            response = await client.post("/generate", json=generate_body())
            rid = response.headers["x-request-id"]
        if disabled:
            assert health_probes(decode) == seen  # not checked any more
            assert response.status_code == 200  # and still gets traffic
            assert decode.events.find("request_start", rid=rid)
        else:
            assert health_probes(decode) > seen  # checked, found failing...
            assert response.status_code == 503  # ...and taken out of rotation
            assert not decode.events.find("request_start", rid=rid)
    finally:
        await router.stop()
