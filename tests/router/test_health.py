"""Active health checks over real sockets: an engine that stops answering flips unhealthy after
the thresholds, /readiness says why, traffic avoids it, and it comes back when it answers
again; /health stays SMG's liveness throughout; a worker failing its checks says why (log,
metric, GET /workers).

Real time: interval 0.2 s, loose upper bounds (seconds). The checker's exact timing is tested
under MockClock in tests/fleet.
"""

from __future__ import annotations

import attrs
import trio

from tests.conftest import Cluster
from tests.router import fleet_tools
from tests.router.fleet_tools import FAST_HEALTH, LOOSE, Engine, start_stoppable, who_started
from tests.router.helpers import generate_body, settle

HEALTH = attrs.evolve(FAST_HEALTH, failure_threshold=3, success_threshold=2)


async def cluster_of(
    nursery: trio.Nursery, prefills: list[Engine], decodes: list[Engine]
) -> Cluster:
    handles = [e.handle for e in prefills], [e.handle for e in decodes]
    return await fleet_tools.cluster_of(nursery, *handles, health=HEALTH)


async def test_dead_prefill_flips_health_and_recovers(nursery: trio.Nursery) -> None:
    prefill = await start_stoppable(nursery, "prefill")
    decode = await start_stoppable(nursery, "decode")
    cluster = await cluster_of(nursery, [prefill], [decode])
    worker = cluster.router.fleet.workers("prefill")[0]
    assert (await cluster.client.get("/readiness")).status_code == 200

    stopped_at = trio.current_time()
    prefill.stop()
    await settle(lambda: not worker.healthy, LOOSE)
    # Three consecutive failures 0.2 s apart: never before two intervals have passed.
    assert trio.current_time() - stopped_at >= 2 * HEALTH.interval_secs
    response = await cluster.client.get("/readiness")
    assert response.status_code == 503
    assert response.json()["status"] == "not ready"
    assert "no available prefill worker" in response.json()["error"]["message"]
    # SMG's /health is liveness (its Helm chart's liveness probe): the process is fine.
    for path in ("/health", "/liveness"):
        assert (await cluster.client.get(path)).status_code == 200
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 503
    assert "unhealthy" in response.json()["error"]["message"]
    rid = response.headers["x-request-id"]
    assert not decode.handle.events.find("request_start", rid=rid)  # nobody was asked

    # The same engine comes back on the same ports.
    revived = await start_stoppable(
        nursery, "prefill", port=prefill.handle.port, bootstrap_port=prefill.handle.bootstrap_port
    )
    back_at = trio.current_time()
    await settle(lambda: worker.healthy, LOOSE)
    # Once it had passed before, two consecutive passes are needed to come back.
    assert trio.current_time() - back_at >= HEALTH.interval_secs * 0.5
    assert (await cluster.client.get("/readiness")).status_code == 200
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200
    assert revived.handle.events.find("kv_sent", rid=response.headers["x-request-id"])
    await cluster.client.aclose()


async def test_traffic_avoids_an_unhealthy_prefill(nursery: trio.Nursery) -> None:
    prefills = [await start_stoppable(nursery, "prefill") for _ in range(2)]
    decode = await start_stoppable(nursery, "decode")
    cluster = await cluster_of(nursery, prefills, [decode])
    dying = cluster.router.fleet.workers("prefill")[0]
    prefills[0].stop()
    await settle(lambda: not dying.healthy, LOOSE)
    assert (await cluster.client.get("/readiness")).status_code == 200  # one prefill is enough
    for i in range(4):
        rid = f"survivor-{i}"
        response = await cluster.client.post(
            "/generate", json=generate_body(), headers={"x-request-id": rid}
        )
        assert response.status_code == 200
        assert who_started(cluster.prefills, rid) == [1]
    listed = (await cluster.client.get("/workers")).json()["workers"]
    assert [w["is_healthy"] for w in listed] == [False, True, True]
    # The breaker is not the health checker's business: nothing was recorded against it.
    assert dying.breaker.total_failures == 0
    await cluster.client.aclose()


async def test_dead_decode_makes_health_503(nursery: trio.Nursery) -> None:
    prefill = await start_stoppable(nursery, "prefill")
    decode = await start_stoppable(nursery, "decode")
    cluster = await cluster_of(nursery, [prefill], [decode])
    decode.stop()
    await settle(lambda: not cluster.router.fleet.workers("decode")[0].healthy, LOOSE)
    response = await cluster.client.get("/readiness")
    assert response.status_code == 503
    assert "no available decode worker" in response.json()["error"]["message"]
    assert (await cluster.client.get("/health")).status_code == 200
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 503
    assert not prefill.handle.events.find("request_start", rid=response.headers["x-request-id"])
    await cluster.client.aclose()
