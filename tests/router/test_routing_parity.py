"""SMG 1.13's routing over the wire (issue 21): which engine got each request, read from the
engines' own logs, through a real router on real sockets.

least_load, consistent_hashing and prefix_hash as policies of both roles; sticky sessions on a
policy that does not read keys (round robin) by header, by `--routing-key-headers` and by the
body's `rid` lineage; and prefill/decode pairs only where the KV transfer backends agree, a
fleet with no such pair answering 503 `no_compatible_pd_pair` and not ready.
"""

from __future__ import annotations

from collections import Counter

import httpx2
import trio

from tests.conftest import ROUTER_DEFAULTS, start_cluster, start_engine, start_router
from tests.router.fleet_tools import build_cluster, who_started
from tests.router.helpers import generate_body, settle
from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.spec import WorkerSpec


async def send(cluster, request_id: str, headers: dict[str, str] | None = None, **body) -> None:
    response = await cluster.client.post(
        "/generate",
        json=generate_body(**body),
        headers={"x-request-id": request_id, **(headers or {})},
    )
    assert response.status_code == 200, response.text


def placement(cluster, rid: str) -> tuple[int, int]:
    """(prefill index, decode index) that served `rid`, each exactly once."""
    [p] = who_started(cluster.prefills, rid)
    [d] = who_started(cluster.decodes, rid)
    return p, d


async def test_least_load_sends_new_work_away_from_a_busy_decode(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_decode=2, policy=PolicyConfig(policy="least_load"),
        decode={"inter_token_ms": 30},
    )  # fmt: skip

    async def long_stream() -> None:
        body = generate_body(stream=True, max_new_tokens=200)
        async with cluster.client.stream(
            "POST", "/generate", json=body, headers={"x-request-id": "long"}
        ) as response:
            async for _ in response.aiter_raw():
                pass

    async with trio.open_nursery() as background:
        background.start_soon(long_stream)
        await settle(lambda: any(e.events.find("first_token", rid="long") for e in cluster.decodes))
        [busy] = who_started(cluster.decodes, "long")
        for i in range(6):
            await send(cluster, f"ll-{i}", max_new_tokens=2)
            assert placement(cluster, f"ll-{i}")[1] == 1 - busy
        background.cancel_scope.cancel()
    await cluster.client.aclose()


async def test_least_load_reads_the_engines_own_queues(nursery: trio.Nursery) -> None:
    """Another client's requests queue on prefill 0 (sent to the engine itself: this router
    holds none of them). least_load learns it from the engine's /v1/loads, polled for its role,
    and sends every new request to prefill 1; round robin (the decode's policy) would not."""
    policy = PolicyConfig(policy="round_robin", prefill_policy="least_load")
    cluster = await start_cluster(nursery, n_prefill=2, policy=policy, load_poll_interval_secs=0.2)
    busy = cluster.prefills[0]
    fleet_prefill = next(w for w in cluster.router.fleet.workers("prefill") if w.url == busy.url)

    async def elsewhere(room: int) -> None:
        body = generate_body(bootstrap_host="127.0.0.1", bootstrap_port=busy.bootstrap_port,
                             bootstrap_room=room)  # fmt: skip
        async with httpx2.AsyncClient(base_url=busy.url, timeout=httpx2.Timeout(60.0)) as direct:
            await direct.post("/generate", json=body)  # waits for a decode that never comes

    async with trio.open_nursery() as others:
        for room in range(12):  # deeper than the credit six requests give prefill 1
            others.start_soon(elsewhere, 1000 + room)
        load = lambda: fleet_prefill.engine_load  # noqa: E731
        await settle(lambda: load() is not None and load().waiting >= 12)
        assert fleet_prefill.in_flight == 0
        for i in range(6):
            await send(cluster, f"eng-{i}", max_new_tokens=2)
            assert placement(cluster, f"eng-{i}")[0] == 1
        others.cancel_scope.cancel()
    await cluster.client.aclose()


async def test_consistent_hashing_keeps_each_key_on_one_pair(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=3, n_decode=3, policy=PolicyConfig(policy="consistent_hashing")
    )
    where: dict[str, set[tuple[int, int]]] = {}
    for round_ in range(3):
        for k in range(10):
            rid = f"ch-{k}-{round_}"
            await send(cluster, rid, {"x-smg-routing-key": f"tenant-{k}"})
            where.setdefault(f"tenant-{k}", set()).add(placement(cluster, rid))
    assert all(len(pairs) == 1 for pairs in where.values()), where
    used = Counter(p for pairs in where.values() for p, _ in pairs)
    assert len(used) >= 2  # ten keys over three prefills: not all on one
    await cluster.client.aclose()


async def test_consistent_hashing_keys_clients_by_forwarded_for(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=3, n_decode=3, policy=PolicyConfig(policy="consistent_hashing")
    )
    where: dict[str, set[tuple[int, int]]] = {}
    for round_ in range(3):
        for k in range(8):
            rid = f"xff-{k}-{round_}"
            await send(cluster, rid, {"x-forwarded-for": f"203.0.113.{k}"})
            where.setdefault(f"client-{k}", set()).add(placement(cluster, rid))
    assert all(len(pairs) == 1 for pairs in where.values()), where
    assert len({p for pairs in where.values() for p, _ in pairs}) >= 2
    await cluster.client.aclose()


HEADS = [
    "You are a careful assistant for volcano research. Answer with citations only. ",
    "Translate the following railway timetable notes from German into plain English. ",
    "Write Python code that parses ISO 8601 durations and returns the seconds as float. ",
    "Summarize each customer complaint in one sentence and rate its urgency from 1-5. ",
    "List the chemical elements mentioned below with their atomic numbers in a table. ",
]


async def test_prefix_hash_sends_a_shared_head_to_one_worker(nursery: trio.Nursery) -> None:
    policy = PolicyConfig(policy="prefix_hash", prefix_token_count=16)  # the first 64 chars
    cluster = await start_cluster(nursery, n_prefill=3, n_decode=3, policy=policy)
    where: dict[int, set[tuple[int, int]]] = {}
    for k, head in enumerate(HEADS):
        for tail in ("first question", "a second, longer question about it", "third"):
            rid = f"ph-{k}-{len(tail)}"
            await send(cluster, rid, text=head + tail)
            where.setdefault(k, set()).add(placement(cluster, rid))
    assert all(len(pairs) == 1 for pairs in where.values()), where
    assert len({p for pairs in where.values() for p, _ in pairs}) >= 2
    await cluster.client.aclose()


async def test_sticky_sessions_pin_a_key_on_round_robin(nursery: trio.Nursery) -> None:
    policy = PolicyConfig(policy="round_robin", routing_key_override=True)
    cluster = await start_cluster(nursery, n_prefill=3, n_decode=3, policy=policy)
    for i in range(6):
        await send(cluster, f"conv-a-{i}", {"x-smg-routing-key": "conv-a"})
    pinned = {placement(cluster, f"conv-a-{i}") for i in range(6)}
    assert len(pinned) == 1, pinned
    # Round robin still decides for requests without a key: they go round.
    for i in range(3):
        await send(cluster, f"free-{i}")
    assert {placement(cluster, f"free-{i}")[0] for i in range(3)} == {0, 1, 2}
    # No header: the body's rid lineage keys the conversation (turn and retry suffixes off).
    for i, rid in enumerate(("chat42_t1", "chat42_t2", "chat42_t3_r1", "chat42_t4")):
        await send(cluster, f"turn-{i}", rid=rid)
    turns = {placement(cluster, f"turn-{i}") for i in range(4)}
    assert len(turns) == 1, turns
    await cluster.client.aclose()


async def test_routing_key_headers_are_tried_in_order(nursery: trio.Nursery) -> None:
    policy = PolicyConfig(
        policy="round_robin", routing_key_override=True,
        routing_key_headers=("x-session-id", "x-smg-routing-key"),
    )  # fmt: skip
    cluster = await start_cluster(nursery, n_prefill=3, n_decode=3, policy=policy)
    for i in range(6):
        # The session header wins over a routing key that changes every request.
        headers = {"x-session-id": "s-1", "x-smg-routing-key": f"noise-{i}"}
        await send(cluster, f"hdr-{i}", headers)
    assert len({placement(cluster, f"hdr-{i}") for i in range(6)}) == 1
    await cluster.client.aclose()


async def test_pairs_only_share_a_transfer_backend(nursery: trio.Nursery) -> None:
    # Round robin over two prefills, one speaking mooncake (the simulator's default), one nixl;
    # the only decode speaks nixl.
    cluster = await build_cluster(
        nursery, prefills=({}, {"transfer_backend": "nixl"}),
        decodes=({"transfer_backend": "nixl"},),
    )  # fmt: skip
    for i in range(8):
        await send(cluster, f"pair-{i}")
    used = Counter(placement(cluster, f"pair-{i}")[0] for i in range(8))
    assert used == {1: 8}, used  # only the nixl prefill pairs with the nixl decode
    await cluster.client.aclose()


async def test_no_compatible_pair_is_503_and_not_ready(nursery: trio.Nursery) -> None:
    prefill = await start_engine(nursery, "prefill", transfer_backend="mooncake")
    decode = await start_engine(nursery, "decode", transfer_backend="nixl")
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(decode.url, "decode"),),
        **ROUTER_DEFAULTS,
    )
    router, url = await start_router(nursery, config)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0)) as client:
        fleet = router.fleet
        await settle(lambda: all(w.healthy for w in fleet.workers()))
        ready = await client.get("/readiness")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "no_compatible_pd_pair"
        response = await client.post(
            "/generate", json=generate_body(), headers={"x-request-id": "nopair"}
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_compatible_pd_pair"
        assert not who_started([prefill, decode], "nopair")  # it never reached a worker


async def test_per_role_policies_take_the_new_names(nursery: trio.Nursery) -> None:
    """--prefill-policy consistent_hashing --decode-policy round_robin: a key keeps its
    prefill while its decodes go round."""
    policy = PolicyConfig(
        policy="random", prefill_policy="consistent_hashing", decode_policy="round_robin"
    )
    cluster = await start_cluster(nursery, n_prefill=3, n_decode=3, policy=policy)
    for i in range(6):
        await send(cluster, f"role-{i}", {"x-smg-routing-key": "one-tenant"})
    placements = [placement(cluster, f"role-{i}") for i in range(6)]
    assert len({p for p, _ in placements}) == 1
    assert [d for _, d in placements] == [0, 1, 2, 0, 1, 2]
    await cluster.client.aclose()
