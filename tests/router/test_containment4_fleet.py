"""Containment, part 4 (issue 26), the fleet's share: N5 (prefix trees bounded by memory), N9
(load reports that cannot be true), N12 (membership files others can write; aliases shadowing a
served model) and N14's pin tables and file-membership entries, each through a real router on
real sockets with a control measured in the same run."""

from __future__ import annotations

import random
import string
import sys
from collections import Counter
from typing import Any

import orjson
import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import who_started
from tests.router.helpers import generate_body, settle
from trio_pd.config import PolicyConfig
from trio_pd.control.engine_info import LoadReportRejected, parse_v1_loads
from trio_pd.fleet.prefix_tree import NODE_BYTES, PrefixTree

# -- N9: load reports that cannot be true ------------------------------------------------------

LEAST_LOAD_PREFILL = PolicyConfig(policy="round_robin", prefill_policy="least_load")


def rejected(cluster: Cluster, worker_id: str, reason: str) -> float:
    labels = {"worker": worker_id, "role": "prefill", "reason": reason}
    value = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_load_reports_rejected_total", labels
    )
    return value or 0.0


async def prefill_shares(
    nursery: trio.Nursery, lie: dict[str, Any], requests: int = 80
) -> tuple[Counter[int], Cluster]:
    """Prefill 0 reports `lie` in its /v1/loads; which prefill served each of `requests`."""
    cluster = await start_cluster(
        nursery, n_prefill=2, policy=LEAST_LOAD_PREFILL, load_poll_interval_secs=0.2
    )
    cluster.prefills[0].state.load_lie = lie
    workers = {w.url: w for w in cluster.router.fleet.workers("prefill")}
    liar = workers[cluster.prefills[0].url]
    honest = workers[cluster.prefills[1].url]
    if lie:  # the lie was polled and refused before the first request
        await settle(lambda: rejected(cluster, liar.id, "negative") >= 1)
    else:
        await settle(lambda: liar.engine_load is not None and honest.engine_load is not None)
    served: Counter[int] = Counter()
    for i in range(requests):
        rid = f"n9-{i}"
        response = await cluster.client.post(
            "/generate", json=generate_body(max_new_tokens=1), headers={"x-request-id": rid}
        )
        assert response.status_code == 200, response.text
        [index] = who_started(cluster.prefills, rid)
        served[index] += 1
    return served, cluster


async def test_a_negative_load_report_no_longer_attracts_every_request(
    nursery: trio.Nursery,
) -> None:
    """N9: a prefill reporting `num_waiting_uncached_tokens: -10**12` took 80 of 80 requests
    under least_load (it looked infinitely idle). Its report is now refused, counted, and its
    load unknown: it gets about its share, as in the control where both tell the truth."""
    control, control_cluster = await prefill_shares(nursery, {})
    assert rejected(control_cluster, "prefill-1", "negative") == 0
    served, cluster = await prefill_shares(nursery, {"num_waiting_uncached_tokens": -(10**12)})
    liar = next(w for w in cluster.router.fleet.workers("prefill") if w.id == "prefill-1")
    assert liar.url == cluster.prefills[0].url
    assert rejected(cluster, liar.id, "negative") >= 1  # the provoked thing happened
    assert liar.load_fault == "negative" and liar.engine_load is None
    listed = {w["id"]: w for w in (await cluster.client.get("/workers")).json()["workers"]}
    assert listed[liar.id]["load_fault"] == "negative"
    # Control: both honest, an even split (least_load's ties drawn at random). The liar now
    # gets no more than a fair draw would (it took all 80 before).
    assert 20 <= control[0] <= 60, control
    assert 20 <= served[0] <= 60, (served, control)
    for c in (cluster, control_cluster):
        await c.client.aclose()
        await c.admin.aclose()


def loads(**fields: Any) -> bytes:
    rank = {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 2, "token_usage": 0.5}
    return orjson.dumps({"loads": [{**rank, **fields}]})


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"num_waiting_uncached_tokens": -(10**12)}, "negative"),
        ({"num_running_reqs": -1}, "negative"),
        ({"token_usage": -0.1}, "negative"),
        ({"num_waiting_reqs": 10**9}, "absurd"),
        ({"num_used_tokens": 10**15}, "absurd"),
        ({"token_usage": 7.0}, "absurd"),
        ({"gen_throughput": 1e300}, "absurd"),
        (
            {"disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 5}},
            "contradictory",
        ),
    ],
)
def test_impossible_figures_are_refused_with_their_reason(
    fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(LoadReportRejected) as refused:
        parse_v1_loads(loads(**fields))
    assert refused.value.reason == reason
    assert parse_v1_loads(loads()).ranks[0].waiting == 2  # the control is believed


# -- N5: prefix trees bounded by memory --------------------------------------------------------

TREE_BOUND = 50_000  # --max-tree-size: bytes a worker's tree may hold after a trim


def held_bytes(tree: PrefixTree[Any]) -> int:
    """What the tree's objects hold, measured (`sys.getsizeof`), not what the tree charges:
    every node with its children dict, tenant set and text, and the tenants' LRU orders."""
    total = sum(sys.getsizeof(order) for order in tree._lru.values())
    for node in tree._walk():
        total += sys.getsizeof(node) + sys.getsizeof(node.children)
        total += sys.getsizeof(node.tenants) + sys.getsizeof(node.text)
    return total


async def drive_tree(nursery: trio.Nursery, prompts: list[str]) -> tuple[PrefixTree[Any], int]:
    """`prompts` through a router whose policy is cache_aware (the default); the prefill
    role's tree and the most it held after any request (bytes, measured)."""
    policy = PolicyConfig(policy="cache_aware", max_tree_size=TREE_BOUND)
    cluster = await start_cluster(nursery, policy=policy)
    tree = cluster.router.fleet.policies["prefill"].tree
    most = 0
    for i, prompt in enumerate(prompts):
        response = await cluster.client.post(
            "/generate", json=generate_body(text=prompt, max_new_tokens=1)
        )
        assert response.status_code == 200, (i, response.text)
        most = max(most, held_bytes(tree))
    await cluster.client.aclose()
    await cluster.admin.aclose()
    return tree, most


async def test_prefix_trees_are_bounded_by_memory_not_characters(nursery: trio.Nursery) -> None:
    """N5: prompts `"A" * k + "B"` each added two nodes (~1 KB) for one or two counted
    characters, never evicted. Trees are now charged by memory: the attack's tree stays within
    twice `--max-tree-size` (a trim at twice the bound on insert), as the control of distinct
    prompts of the same lengths does."""
    count = 400
    attack = ["A" * k + "B" for k in range(1, count + 1)]
    rng = random.Random(5)
    control = ["".join(rng.choice(string.ascii_letters) for _ in range(len(p))) for p in attack]
    # The provoked thing: unbounded, the attack's nodes would hold several times the bound.
    unbounded: PrefixTree[str] = PrefixTree()
    for prompt in attack:
        unbounded.insert(prompt, "w")
    assert held_bytes(unbounded) > 3 * 2 * TREE_BOUND
    for prompts in (attack, control):
        tree, most = await drive_tree(nursery, prompts)
        [worker] = tree.tenants()
        assert most <= 2 * TREE_BOUND, most  # measured, every request
        assert tree.size(worker) <= 2 * TREE_BOUND
        assert tree.total_nodes() <= 2 * TREE_BOUND // NODE_BYTES + 1
        # The newest prompt is still there: trimming drops the least recently used.
        assert tree.match(prompts[-1], [worker])[0] == len(prompts[-1])
