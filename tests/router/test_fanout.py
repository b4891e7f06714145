"""Fan-out endpoints over the wire: proxied info, /health_generate, /flush_cache, /get_loads.

`seen` wraps EngineApp.info to log an `info_arrived` event the moment a request reaches an
engine (the engine's own `info_request` comes with its answer, which a test may hold back) and,
per engine and path, to delay or hang the answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body, settle
from trio_pd.control.engine_info import EngineInfoError, parse_legacy_load
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine.app import EngineApp
from trio_pd_testing.ports import free_port


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[Any, str], float]]:
    """Log every info request as it arrives; delays[(handle.state, path)] holds the answer
    (seconds; `inf` hangs until the router gives up)."""
    delays: dict[tuple[Any, str], float] = {}
    original = EngineApp.info

    async def info(self: EngineApp, path: str, method: str, send: Any, *rest: Any) -> None:
        self.engine.events.emit("info_arrived", path=path, method=method)
        delay = delays.get((self.engine, path), 0.0)
        if delay:
            await trio.sleep(delay)
        self.engine.events.emit("info_answering", path=path, method=method)
        await original(self, path, method, send, *rest)

    monkeypatch.setattr(EngineApp, "info", info)
    yield delays


async def info_learned(cluster: Any) -> None:
    """Health checks also ask workers for their info once they pass (their model, DP size)."""
    await settle(lambda: all(w.info_at is not None for w in cluster.router.fleet.workers()))


def asked(engine: Any, path: str, method: str = "GET") -> int:
    return len(engine.events.find("info_arrived", path=path, method=method))


@pytest.mark.parametrize("path", ["/v1/models", "/get_model_info", "/get_server_info"])
async def test_info_is_proxied_from_one_prefill(
    nursery: trio.Nursery, seen: Any, path: str
) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=2, prefill={"model": "prefill-model"}, decode={"model": "decode-model"}
    )
    await info_learned(cluster)
    before = asked(cluster.prefills[0], path) + asked(cluster.prefills[1], path)
    decode_before = asked(cluster.decode, path)
    for _ in range(4):
        response = await cluster.client.get(path, headers={"x-request-id": "info-1"})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "info-1"
        assert "prefill-model" in response.text
    assert asked(cluster.prefills[0], path) + asked(cluster.prefills[1], path) - before == 4
    assert asked(cluster.decode, path) == decode_before
    if path == "/get_server_info":
        assert response.json()["disaggregation_mode"] == "prefill"
    if path == "/v1/models":
        assert response.json()["data"][0]["id"] == "prefill-model"
    await cluster.client.aclose()


async def test_info_skips_an_unreachable_prefill_and_is_503_without_one(
    nursery: trio.Nursery, seen: Any
) -> None:
    cluster = await start_cluster(nursery)
    await info_learned(cluster)
    before = asked(cluster.prefill, "/v1/models")
    dead = cluster.router.fleet.add(WorkerSpec(f"http://127.0.0.1:{free_port()}", "prefill"))
    dead.healthy = True  # as if it died since its last health pass
    for _ in range(4):
        response = await cluster.client.get("/v1/models")
        assert response.status_code == 200
    assert asked(cluster.prefill, "/v1/models") - before == 4

    cluster.router.fleet.remove("prefill-1")
    response = await cluster.client.get("/v1/models")
    assert response.status_code == 502
    assert "prefill-2" in response.json()["error"]["message"]
    cluster.router.fleet.remove(dead.id)
    response = await cluster.client.get("/get_model_info")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    assert asked(cluster.prefill, "/get_model_info") == 0
    await cluster.client.aclose()


async def test_health_generate_asks_one_pair(nursery: trio.Nursery, seen: Any) -> None:
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, health=FAST_HEALTH)
    response = await cluster.client.get("/health_generate")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["prefill"]["ok"] and body["decode"]["ok"]
    path = "/health_generate"
    assert sum(asked(e, path) for e in cluster.prefills) == 1
    assert sum(asked(e, path) for e in cluster.decodes) == 1
    asked_prefill = next(e for e in cluster.prefills if asked(e, path))
    assert body["prefill"]["url"] == asked_prefill.url
    # No generation ran: no room spent, no breaker touched.
    for engine in (*cluster.prefills, *cluster.decodes):
        assert not engine.events.find("request_start")
    for worker in cluster.router.fleet.workers():
        assert worker.breaker.total_successes == worker.breaker.total_failures == 0

    # A decode that cannot be reached makes it 503 and says which one.
    for worker in cluster.router.fleet.workers("decode"):
        worker.spec = WorkerSpec(f"http://127.0.0.1:{free_port()}", "decode")
    response = await cluster.client.get("/health_generate")
    assert response.status_code == 503
    body = response.json()
    assert body["prefill"]["ok"] and not body["decode"]["ok"]
    assert "decode" in body["error"]["message"]
    assert sum(asked(e, path) for e in cluster.prefills) == 2
    await cluster.client.aclose()


async def test_health_generate_503_without_a_decode(nursery: trio.Nursery, seen: Any) -> None:
    cluster = await start_cluster(nursery)
    cluster.router.fleet.remove("decode-1")
    response = await cluster.client.get("/health_generate")
    assert response.status_code == 503
    assert "decode" in response.json()["error"]["message"]
    assert asked(cluster.prefill, "/health_generate") == 0
    await cluster.client.aclose()


async def test_flush_cache_reaches_every_worker_concurrently(
    nursery: trio.Nursery, seen: dict[tuple[Any, str], float]
) -> None:
    health = attrs.evolve(FAST_HEALTH, timeout_secs=1.5)
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, health=health)
    engines = [*cluster.prefills, *cluster.decodes]
    for engine in engines[:3]:
        seen[(engine.state, "/flush_cache")] = 0.5
    seen[(engines[3].state, "/flush_cache")] = float("inf")  # hangs: the router's timeout ends it
    dead = cluster.router.fleet.add(WorkerSpec(f"http://127.0.0.1:{free_port()}", "decode"))

    response = await cluster.admin.post("/flush_cache")
    assert response.status_code == 200
    body = response.json()
    # Together, not one after the other: every engine had the request before any answered
    # (an order of events, which a slow machine cannot reverse; one after the other, each
    # arrival would follow the previous answer).
    arrived = [e["t"] for x in engines for e in x.events.find("info_arrived", path="/flush_cache")]
    answering = [
        e["t"] for x in engines for e in x.events.find("info_answering", path="/flush_cache")
    ]
    assert len(arrived) == 4 and len(answering) == 3  # the fourth hangs
    assert max(arrived) < min(answering)
    assert (body["ok"], body["failed"]) == (3, 2)
    by_id = {item["id"]: item for item in body["workers"]}
    assert list(by_id) == ["prefill-1", "prefill-2", "decode-1", "decode-2", dead.id]
    for engine, worker in zip(engines, cluster.router.fleet.workers(), strict=False):
        assert asked(engine, "/flush_cache", "POST") == 1
        assert by_id[worker.id]["url"] == engine.url
    assert all(by_id[w]["ok"] and by_id[w]["status"] == 200 for w in list(by_id)[:3])
    assert by_id["decode-2"]["error"].startswith("timed out")
    assert by_id["decode-2"]["status"] is None
    assert "Connect" in by_id[dead.id]["error"]
    assert by_id[dead.id]["worker_type"] == "decode"
    await cluster.client.aclose()


async def test_get_loads_reports_engine_load_and_feeds_the_fleet(
    nursery: trio.Nursery, seen: Any
) -> None:
    cluster = await start_cluster(
        nursery, n_decode=2, health=FAST_HEALTH, decode={"inter_token_ms": 50.0}
    )
    busy = cluster.decodes[0]
    rid = "long-stream"

    async def long_stream() -> None:
        body = generate_body(stream=True, max_new_tokens=60)
        async with cluster.client.stream(
            "POST", "/generate", json=body, headers={"x-request-id": rid}
        ) as response:
            async for _ in response.aiter_raw():
                pass

    dead = cluster.router.fleet.add(WorkerSpec(f"http://127.0.0.1:{free_port()}", "decode"))
    async with trio.open_nursery() as streams:
        streams.start_soon(long_stream)
        await busy.events.wait_for("first_token", timeout=LOOSE, rid=rid)
        response = await cluster.client.get("/get_loads")
        streams.cancel_scope.cancel()
    assert response.status_code == 200
    body = response.json()
    assert (body["ok"], body["failed"]) == (3, 1)
    by_id = {item["id"]: item for item in body["workers"]}
    assert by_id["decode-1"]["num_reqs"] == by_id["decode-1"]["load"] == 1
    assert by_id["decode-1"]["num_tokens"] > 0
    assert by_id["decode-2"]["load"] == 0
    assert by_id["prefill-1"]["load"] == 0
    assert by_id[dead.id]["load"] is None and by_id[dead.id]["error"]
    for engine in (cluster.prefill, *cluster.decodes):  # SGLang 0.5.23's endpoint, once
        assert asked(engine, "/v1/loads") == 1 and asked(engine, "/get_load") == 0
    assert by_id["decode-1"]["load_endpoint"] == "/v1/loads"
    assert [r["dp_rank"] for r in by_id["decode-1"]["dp_loads"]] == [0]
    fleet = cluster.router.fleet
    assert fleet.get("decode-1").reported_load == 1
    assert fleet.get("decode-2").reported_load == 0
    assert dead.reported_load is None
    await settle(lambda: busy.running == 0)
    await cluster.client.aclose()


async def test_get_loads_falls_back_to_get_load_on_older_engines(
    nursery: trio.Nursery, seen: Any
) -> None:
    """An engine before SGLang 0.5.23 answers /v1/loads 404 and serves /get_load: asked that
    from then on (one 404, not one per call)."""
    cluster = await start_cluster(
        nursery, health=FAST_HEALTH, decode={"legacy_load_endpoint": True}
    )
    for _ in range(3):
        body = (await cluster.client.get("/get_loads")).json()
        assert body["failed"] == 0
    decode = next(i for i in body["workers"] if i["worker_type"] == "decode")
    assert decode["ok"] and decode["load_endpoint"] == "/get_load"
    assert asked(cluster.decode, "/v1/loads") == 1  # its 404, once
    assert asked(cluster.decode, "/get_load") == 3
    assert asked(cluster.prefill, "/v1/loads") == 3 and asked(cluster.prefill, "/get_load") == 0
    await cluster.client.aclose()


def test_parse_legacy_load_sums_data_parallel_ranks_and_rejects_garbage() -> None:
    one = parse_legacy_load(b'{"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 70}')
    assert (one.requests, one.waiting, one.used_tokens) == (3, 1, 70)
    ranks = parse_legacy_load(
        b'[{"num_reqs": 2, "num_tokens": 5, "dp_rank": 0}, {"num_reqs": 4, "dp_rank": 1}]'
    )
    assert (ranks.requests, ranks.waiting, ranks.used_tokens) == (6, 0, 5)
    assert [r.dp_rank for r in ranks.ranks] == [0, 1]
    for bad in (b"nope", b"[]", b"[1]", b"{}", b'{"num_reqs": "3"}', b'{"num_reqs": true}'):
        with pytest.raises(EngineInfoError):
            parse_legacy_load(bad)
