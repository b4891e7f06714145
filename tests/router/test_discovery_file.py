"""SMG 1.13's file discovery (`--discovery-provider file --discovery-file F`) behind a real router
(issue 21): SMG's manifest shape (a URL without a scheme, its kv_* fields) is read, a change is
picked up, a manifest SMG would refuse (an unknown field, another version) keeps the last good
set and says so in /readiness, and a manifest created after start-up is read then."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx2
import trio

from tests.cluster import Cluster
from tests.conftest import (
    ENGINE_DEFAULTS,
    ROUTER_DEFAULTS,
    cluster_of,
    start_engine,
    start_router,
)
from tests.ops.serve import free_port
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body
from trio_pd.config import RouterConfig
from trio_pd.edge.router import Router
from trio_pd_testing.engine import EngineConfig, EngineHandle, serve_engine


def record(worker_id: str, engine: EngineHandle, role: str) -> dict[str, Any]:
    """A manifest record as SMG's docs write one: host:port, no scheme; kv_connector."""
    found: dict[str, Any] = {"id": worker_id, "url": engine.url.removeprefix("http://"),
                             "worker_type": role}  # fmt: skip
    if role == "prefill":
        found.update(bootstrap_port=engine.bootstrap_port, kv_connector="MooncakeConnector")
    return found


def write(path: Path, manifest: Any) -> None:
    tmp = path.with_suffix(".tmp")  # as SMG asks writers to: a rename over the manifest
    tmp.write_text(json.dumps(manifest))
    tmp.replace(path)


async def wait_for_ids(cluster: Cluster, ids: list[str]) -> None:
    with trio.fail_after(LOOSE):
        while sorted(w.id for w in cluster.router.fleet.workers() if not w.removed) != ids:
            await trio.sleep(0.05)


async def test_an_smg_manifest_is_read_followed_and_a_bad_one_keeps_the_last_good_set(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    other = await start_engine(nursery, "decode")
    path = tmp_path / "workers.json"
    write(path, {"version": 1, "workers": [record("p", prefill, "prefill"),
                                           record("d", decode, "decode")]})  # fmt: skip
    cluster = await cluster_of(
        nursery, [], [], discovery_provider="file", discovery_file=str(path), health=FAST_HEALTH
    )
    assert sorted(w.id for w in cluster.router.fleet.workers()) == ["d", "p"]
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert prefill.events.find("request_start", rid=rid)
    assert decode.events.find("request_start", rid=rid)

    # A change: the decode moves to another engine.
    write(path, {"version": 1, "workers": [record("p", prefill, "prefill"),
                                           record("d2", other, "decode")]})  # fmt: skip
    await wait_for_ids(cluster, ["d2", "p"])
    with trio.fail_after(LOOSE):
        while (await cluster.client.get("/readiness")).status_code != 200:
            await trio.sleep(0.05)
    response = await cluster.client.post("/generate", json=generate_body())
    assert other.events.find("request_start", rid=response.headers["x-request-id"])

    # SMG refuses a manifest with an unknown field (a misspelling): the last good set stays.
    write(path, {"version": 1, "workers": [{**record("p", prefill, "prefill"), "prot": 1}]})
    with trio.fail_after(LOOSE):
        while (await cluster.client.get("/readiness")).json().get("membership") != {
            "discovery_file": "down"
        }:
            await trio.sleep(0.05)
    assert sorted(w.id for w in cluster.router.fleet.workers() if not w.removed) == ["d2", "p"]
    write(path, {"version": 2, "workers": []})  # another version: refused the same way
    await trio.sleep(0.5)
    assert sorted(w.id for w in cluster.router.fleet.workers() if not w.removed) == ["d2", "p"]
    # An intentionally empty fleet is valid: every worker goes.
    write(path, {"version": 1, "workers": []})
    await wait_for_ids(cluster, [])
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_a_manifest_created_after_start_up_is_read_then(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    path = tmp_path / "later.json"

    async def create_later() -> None:
        await trio.sleep(1.0)
        write(path, {"version": 1, "workers": [record("p", prefill, "prefill"),
                                               record("d", decode, "decode")]})  # fmt: skip

    nursery.start_soon(create_later)
    cluster = await cluster_of(  # ready only once the file exists and its workers are healthy
        nursery, [], [], discovery_provider="file", discovery_file=str(path), health=FAST_HEALTH
    )
    assert path.exists()
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def discovered_late_decode(
    nursery: trio.Nursery, tmp_path: Path, remove: bool | None
) -> tuple[Router, str, int]:
    """A router whose manifest lists a decode whose engine is not up yet (given up after 1 s)."""
    prefill = await start_engine(nursery, "prefill")
    port = free_port()
    path = tmp_path / "workers.json"
    decode_record = {"id": "d", "url": f"127.0.0.1:{port}", "worker_type": "decode"}
    write(path, {"version": 1, "workers": [record("p", prefill, "prefill"), decode_record]})
    health = attrs.evolve(FAST_HEALTH, startup_timeout_secs=1.0, remove_unhealthy_workers=remove)
    config = RouterConfig(
        **{**ROUTER_DEFAULTS, "health": health, "discovery_provider": "file",
           "discovery_file": str(path), "discovery_check_interval_secs": 0.5},
    )  # fmt: skip
    router, url = await start_router(nursery, config)
    return router, url, port


async def decode_on(nursery: trio.Nursery, port: int) -> EngineHandle:
    """A decode engine on the port the manifest named (the cluster's helper takes a free one)."""
    config = EngineConfig(role="decode", host="127.0.0.1", port=port, **ENGINE_DEFAULTS)
    return await nursery.start(serve_engine, config)


def decode_worker(router: Router) -> Any:
    return next((w for w in router.fleet.workers() if w.role == "decode"), None)


async def test_remove_unhealthy_workers_lets_a_discovered_worker_recover(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """SMG 1.13's recovery by removal (the default under discovery): the given-up decode is
    removed, the manifest's next full read adds it again, and once its engine is up it is
    probed afresh and routed to."""
    router, url, port = await discovered_late_decode(nursery, tmp_path, None)
    first = decode_worker(router)
    assert first is not None
    with trio.fail_after(LOOSE):  # given up, removed, then added again by the source: fresh
        while decode_worker(router) in (first, None):
            await trio.sleep(0.05)
    assert first.removed and first.startup_timed_out
    assert not decode_worker(router).startup_timed_out
    decode = await decode_on(nursery, port)
    async with httpx2.AsyncClient(base_url=url) as client:
        with trio.fail_after(LOOSE * 2):
            while (await client.get("/readiness")).status_code != 200:
                await trio.sleep(0.1)
        response = await client.post("/generate", json=generate_body())
        assert response.status_code == 200
        assert decode.events.find("request_start", rid=response.headers["x-request-id"])


async def test_no_remove_unhealthy_workers_keeps_a_given_up_worker_given_up(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    router, _, port = await discovered_late_decode(nursery, tmp_path, False)
    given_up = decode_worker(router)
    with trio.fail_after(LOOSE):
        while not given_up.startup_timed_out:
            await trio.sleep(0.05)
    await decode_on(nursery, port)
    await trio.sleep(2.0)  # four manifest rereads, ten probe intervals: nothing changes
    assert decode_worker(router) is given_up and given_up.startup_timed_out
    assert not given_up.healthy
