"""The manual and bucket policies over real sockets, read from which engine saw each request."""

from __future__ import annotations

import trio

from tests.conftest import Cluster, cluster_of, start_cluster
from tests.router.fleet_tools import FAST_HEALTH, LOOSE, start_stoppable, who_started
from tests.router.helpers import generate_body, settle
from trio_pd.config import PolicyConfig


async def send(cluster: Cluster, rid: str, key: str | None = None, **body) -> None:
    headers = {"x-request-id": rid}
    if key is not None:
        headers["x-smg-routing-key"] = key
    response = await cluster.client.post("/generate", json=generate_body(**body), headers=headers)
    assert response.status_code == 200, response.text


def placement(cluster: Cluster, rid: str) -> tuple[int, int]:
    """(prefill index, decode index) that served `rid`, each exactly once."""
    [p] = who_started(cluster.prefills, rid)
    [d] = who_started(cluster.decodes, rid)
    return p, d


async def test_manual_keeps_each_key_on_one_pair_and_spreads_keys(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=3, n_decode=3, policy=PolicyConfig(policy="manual")
    )
    pairs: dict[str, set[tuple[int, int]]] = {}
    for round_ in range(3):
        for k in range(12):
            rid = f"key{k}-{round_}"
            await send(cluster, rid, key=f"session-{k}")
            pairs.setdefault(f"session-{k}", set()).add(placement(cluster, rid))
    assert all(len(seen) == 1 for seen in pairs.values()), pairs
    # Twelve keys on one worker of three would be p < 1e-5 per role.
    assert len({p for [(p, _)] in pairs.values()}) >= 2
    assert len({d for [(_, d)] in pairs.values()}) >= 2
    # Both legs carry the key, as SMG forwards it.
    [start] = cluster.decodes[next(iter(pairs["session-0"]))[1]].events.find(
        "request_start", rid="key0-0"
    )
    assert start["headers"]["x-smg-routing-key"] == "session-0"
    # Without a key a request is placed at random each time.
    for i in range(24):
        await send(cluster, f"nokey-{i}")
    assert len({placement(cluster, f"nokey-{i}")[1] for i in range(24)}) >= 2
    await cluster.client.aclose()


async def test_other_policies_do_not_route_by_the_key(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, n_decode=2)  # round robin
    for i in range(4):
        await send(cluster, f"rr-{i}", key="same")
    assert [placement(cluster, f"rr-{i}")[1] for i in range(4)] == [0, 1, 0, 1]
    await cluster.client.aclose()


async def test_new_keys_go_where_load_or_keys_are_fewest(nursery: trio.Nursery) -> None:
    for mode in ("min_load", "min_group"):
        async with trio.open_nursery() as scope:
            cluster = await start_cluster(
                scope,
                n_decode=2,
                policy=PolicyConfig(policy="manual", assignment_mode=mode),
                decode={"inter_token_ms": 30},
            )

            async def long_stream(cluster: Cluster = cluster) -> None:
                body = generate_body(stream=True, max_new_tokens=200)
                headers = {"x-request-id": "long", "x-smg-routing-key": "busy"}
                async with cluster.client.stream(
                    "POST", "/generate", json=body, headers=headers
                ) as response:
                    async for _ in response.aiter_raw():
                        pass

            async with trio.open_nursery() as background:
                background.start_soon(long_stream)
                await settle(
                    lambda c=cluster: any(
                        e.events.find("first_token", rid="long") for e in c.decodes
                    )
                )
                [busy] = who_started(cluster.decodes, "long")
                for i in range(6):
                    await send(cluster, f"{mode}-{i}", key=f"new-{i}", max_new_tokens=2)
                    assert placement(cluster, f"{mode}-{i}")[1] == 1 - busy, mode
                # The busy key stays where it is: assignment is for new keys only.
                await send(cluster, f"{mode}-again", key="busy", max_new_tokens=2)
                assert placement(cluster, f"{mode}-again")[1] == busy
                background.cancel_scope.cancel()
            await cluster.client.aclose()
            scope.cancel_scope.cancel()


async def test_a_key_moves_off_a_decode_that_stops_and_stays_moved(nursery: trio.Nursery) -> None:
    prefill = await start_stoppable(nursery, "prefill")
    decodes = [await start_stoppable(nursery, "decode") for _ in range(2)]
    cluster = await cluster_of(
        nursery, [prefill.handle], [d.handle for d in decodes],
        policy=PolicyConfig(policy="manual"), health=FAST_HEALTH,
    )  # fmt: skip
    await settle(lambda: all(w.healthy for w in cluster.router.fleet.workers()), LOOSE)
    await send(cluster, "first", key="k")
    home = placement(cluster, "first")[1]
    decodes[home].stop()
    await settle(lambda: not cluster.router.fleet.workers("decode")[home].healthy, LOOSE)
    for i in range(3):
        await send(cluster, f"moved-{i}", key="k")
        assert placement(cluster, f"moved-{i}")[1] == 1 - home
    await cluster.client.aclose()


async def test_bucket_sends_prompts_by_length_and_moves_the_ranges(nursery: trio.Nursery) -> None:
    interval = 2
    policy = PolicyConfig(
        policy="round_robin",
        prefill_policy="bucket",
        bucket_adjust_interval_secs=interval,
        balance_abs_threshold=10**9,  # the ranges alone decide
    )
    cluster = await start_cluster(nursery, n_prefill=3, policy=policy)

    def prompt(length: int) -> str:
        return ("ab " * length)[:length]

    # Initial ranges: [0, 1364] [1365, 2729] [2730, ...] characters.
    for rid, length in (("short", 100), ("middle", 2000), ("long", 3000)):
        await send(cluster, rid, text=prompt(length))
    assert [placement(cluster, r)[0] for r in ("short", "middle", "long")] == [0, 1, 2]
    await trio.sleep(interval + 0.2)
    # The first request past the interval adjusts from the lengths seen (a third of 5100 each):
    # [0, 2000] [2001, 3000] [3001, ...].
    for rid, length in (("1500", 1500), ("2900", 2900), ("3100", 3100)):
        await send(cluster, rid, text=prompt(length))
    assert [placement(cluster, r)[0] for r in ("1500", "2900", "3100")] == [0, 1, 2]
    await cluster.client.aclose()
