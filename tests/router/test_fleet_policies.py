"""Each selection policy's choices over the wire, read from which engine saw each request."""

from __future__ import annotations

from functools import partial

import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import LOOSE, who_started
from tests.router.helpers import generate_body, settle
from trio_pd.config import PolicyConfig


async def send(cluster, rid: str, **body) -> None:
    response = await cluster.client.post(
        "/generate", json=generate_body(**body), headers={"x-request-id": rid}
    )
    assert response.status_code == 200, response.text


def placement(cluster, rid: str) -> tuple[int, int]:
    """(prefill index, decode index) that served `rid`, each exactly once."""
    [p] = who_started(cluster.prefills, rid)
    [d] = who_started(cluster.decodes, rid)
    return p, d


async def test_round_robin_alternates(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=3, n_decode=2, policy=PolicyConfig(policy="round_robin")
    )
    seen = []
    for i in range(6):
        await send(cluster, f"rr-{i}")
        seen.append(placement(cluster, f"rr-{i}"))
    assert [p for p, _ in seen] == [0, 1, 2, 0, 1, 2]
    assert [d for _, d in seen] == [0, 1, 0, 1, 0, 1]
    await cluster.client.aclose()


async def test_random_and_power_of_two_use_every_worker(nursery: trio.Nursery) -> None:
    for name in ("random", "power_of_two"):
        async with trio.open_nursery() as scope:
            cluster = await start_cluster(
                scope, n_prefill=3, n_decode=3, policy=PolicyConfig(policy=name)
            )
            placements = []
            for i in range(30):
                await send(cluster, f"{name}-{i}")
                placements.append(placement(cluster, f"{name}-{i}"))
            # Missing one of three workers in 30 fair draws: p < 1e-4 per role.
            assert {p for p, _ in placements} == {0, 1, 2}, name
            assert {d for _, d in placements} == {0, 1, 2}, name
            await cluster.client.aclose()
            scope.cancel_scope.cancel()


async def test_power_of_two_avoids_the_loaded_worker(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        n_decode=2,
        policy=PolicyConfig(policy="power_of_two"),
        decode={"inter_token_ms": 30},
    )

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
            await send(cluster, f"p2c-{i}", max_new_tokens=2)
            assert placement(cluster, f"p2c-{i}")[1] == 1 - busy
        background.cancel_scope.cancel()
    await cluster.client.aclose()


TEXTS = [
    "You are a helpful assistant. Summarize the following article about volcanoes in Iceland.",
    "Translate this German paragraph about railway timetables into plain English, please now.",
    "Write a Python function that parses ISO 8601 durations and returns total seconds as float.",
]


async def test_cache_aware_keeps_prefixes_together_and_spreads_new_ones(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, n_prefill=3, policy=PolicyConfig(policy="cache_aware"))
    first = {}
    for k, text in enumerate(TEXTS):
        await send(cluster, f"new-{k}", text=text)
        first[k] = placement(cluster, f"new-{k}")[0]
    assert sorted(first.values()) == [0, 1, 2]  # distinct prefixes spread over all three
    for round_ in range(2):
        for k, text in enumerate(TEXTS):
            rid = f"again-{round_}-{k}"
            await send(cluster, rid, text=text + f" (variant {round_})")
            assert placement(cluster, rid)[0] == first[k], (rid, text)
    await cluster.client.aclose()


async def test_cache_aware_sheds_load_when_imbalanced(nursery: trio.Nursery) -> None:
    policy = PolicyConfig(policy="cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5)
    cluster = await start_cluster(nursery, n_prefill=2, policy=policy)
    text = TEXTS[0]
    workers = cluster.router.fleet.workers("prefill")
    async with trio.open_nursery() as held:
        # Three slow requests with one prefix: affinity keeps them on one prefill while the
        # imbalance (2 - 0) is within the absolute threshold, and the third makes it 3 - 0.
        for i in range(3):
            request = partial(send, cluster, f"held-{i}", text=text, sim_fault="prefill:slow:2000")
            held.start_soon(request)
            await settle(lambda n=i + 1: workers[0].in_flight + workers[1].in_flight == n, LOOSE)
        await settle(lambda: all(who_started(cluster.prefills, f"held-{i}") for i in range(3)))
        [target] = {placement_prefill(cluster, f"held-{i}") for i in range(3)}
        assert workers[target].in_flight == 3
        await send(cluster, "shed", text=text)
        assert placement(cluster, "shed")[0] == 1 - target
        held.cancel_scope.cancel()
    await cluster.client.aclose()


def placement_prefill(cluster, rid: str) -> int:
    [p] = who_started(cluster.prefills, rid)
    return p
