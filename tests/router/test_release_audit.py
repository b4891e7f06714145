"""The release audit (issue 25): after aborts, the router reads the engine's own loads and says
what it still holds beyond the router's legs (`trio_pd_worker_held_beyond_router`,
`trio_pd_release_audits_total`; `control/release_audit.py`, docs/operations.md)."""

from __future__ import annotations

import trio

from tests.cluster import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import generate_body, settle


def audits(cluster: Cluster, role: str, result: str) -> float:
    return cluster.router.metrics.release_audits.labels(role, result)._value.get()


def held_beyond(cluster: Cluster, role: str) -> int:
    return next(w for w in cluster.router.fleet.workers(role)).held_beyond_router


def scraped(cluster: Cluster) -> str:
    return cluster.router.metrics.render().decode()


async def doomed_decode(cluster: Cluster) -> None:
    """A prefill that fails while its decode waits for KV: the router aborts the decode."""
    response = await cluster.client.post("/generate", json=generate_body(sim_fault="prefill:500"))
    assert response.status_code == 502
    await settle(lambda: cluster.router.metrics.aborts.labels("decode", "sent")._value.get() >= 1)


async def test_an_engine_that_let_go_is_audited_released(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    await doomed_decode(cluster)
    await settle(lambda: audits(cluster, "decode", "released") >= 1, timeout=LOOSE)
    assert audits(cluster, "decode", "held") == 0
    assert held_beyond(cluster, "decode") == 0
    assert 'trio_pd_worker_held_beyond_router{role="decode"' in scraped(cluster)


async def test_what_the_engine_still_holds_is_exported_until_it_lets_go(
    nursery: trio.Nursery,
) -> None:
    """The decode reports two requests the router has no leg for (what a lost abort, or another
    router's traffic, looks like from here): the audit says 2, reads again, and says 0 once the
    engine let go."""
    cluster = await start_cluster(nursery)
    cluster.decode.state.saturate(running=2)
    await doomed_decode(cluster)
    await settle(lambda: held_beyond(cluster, "decode") == 2, timeout=LOOSE)
    assert audits(cluster, "decode", "held") >= 1
    assert "trio_pd_worker_held_beyond_router" in scraped(cluster)
    line = next(
        x
        for x in scraped(cluster).splitlines()
        if x.startswith("trio_pd_worker_held_beyond_router{") and 'role="decode"' in x
    )
    assert line.endswith(" 2.0"), line
    cluster.decode.state.saturate()
    await settle(lambda: held_beyond(cluster, "decode") == 0, timeout=LOOSE)
    assert audits(cluster, "decode", "released") >= 1


async def test_the_router_own_legs_are_not_counted(nursery: trio.Nursery) -> None:
    """A request of this router still running on the decode is its own leg: not held beyond."""
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 50.0})

    async def long_request() -> None:
        body = generate_body(max_new_tokens=60)
        await cluster.client.post("/generate", json=body)

    async with trio.open_nursery() as inner:
        inner.start_soon(long_request)
        await settle(lambda: next(iter(cluster.router.fleet.workers("decode"))).in_flight == 1)
        await doomed_decode(cluster)
        await settle(lambda: audits(cluster, "decode", "released") >= 1, timeout=LOOSE)
        assert audits(cluster, "decode", "held") == 0
