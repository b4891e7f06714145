"""Containment, part 4 (issue 26), the fleet's share: N5 (prefix trees bounded by memory), N9
(load reports that cannot be true), N12 (membership files others can write; aliases shadowing a
served model) and N14's pin tables and file-membership entries, each through a real router on
real sockets with a control measured in the same run."""

from __future__ import annotations

import json
import logging
import os
import random
import string
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from tests.conftest import Cluster, cluster_of, start_cluster, start_engine
from tests.router.fleet_tools import FAST_HEALTH, LOOSE, who_started
from tests.router.helpers import generate_body, settle
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import PolicyConfig
from trio_pd.control.engine_info import LoadReportRejected, parse_v1_loads
from trio_pd.fleet import manual
from trio_pd.fleet.manual import ManualPolicy
from trio_pd.fleet.prefix_tree import MAX_PATH_NODES, NODE_BYTES, PrefixTree
from trio_pd_testing.engine import EngineHandle

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
    # An operator's GET /get_loads sees the refusal too, and feeds the liar no figure.
    asked = {w["id"]: w for w in (await cluster.client.get("/get_loads")).json()["workers"]}
    assert not asked[liar.id]["ok"] and "refused" in asked[liar.id]["error"]
    assert liar.engine_load is None and asked["prefill-2"]["ok"]
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


# -- N12: membership files another user can write; aliases shadowing a served model ----------

NOBODY = 65534


def membership(path: Path, *workers: tuple[str, EngineHandle, str], mode: int = 0o600) -> None:
    """A membership file listing `workers` (id, engine, role), written as its owner (root
    here) would, then given `mode`."""
    entries = [
        {"id": worker_id, "url": engine.url, "worker_type": role,
         "bootstrap_port": engine.bootstrap_port if role == "prefill" else None}
        for worker_id, engine, role in workers
    ]  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "serial": {}, "workers": entries}))
    tmp.chmod(mode)
    tmp.replace(path)


def membership_errors(cluster: Cluster, kind: str) -> float:
    value = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_membership_errors_total", {"source": "file", "kind": kind}
    )
    return value or 0.0


def live_ids(cluster: Cluster) -> list[str]:
    return sorted(w.id for w in cluster.router.fleet.workers() if not w.removed)


@pytest.mark.parametrize(
    ("what", "make_unsafe"),
    [
        ("a 0666 file", lambda path: path.chmod(0o666)),
        ("a file of another uid", lambda path: os.chown(path, NOBODY, NOBODY)),
        ("a 0777 directory", lambda path: path.parent.chmod(0o777)),
    ],
)
async def test_a_membership_file_others_can_write_is_not_read(
    nursery: trio.Nursery, tmp_path: Path, what: str, make_unsafe: Callable[[Path], None]
) -> None:
    """N12: whoever could rewrite the file named the workers (and got users' prompts and the
    router's --api-key). Refused at start (a usage error naming the path and mode) and on every
    reload (the last good set stays, counted, the source down); the control rewrite, by the
    owner with mode 0600, is taken."""
    os.chmod(tmp_path, 0o700)
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    other = await start_engine(nursery, "decode")
    path = tmp_path / "membership.json"
    membership(path, ("p", prefill, "prefill"), ("d", decode, "decode"))
    cluster = await cluster_of(nursery, [], [], membership_file=str(path), health=FAST_HEALTH)
    assert live_ids(cluster) == ["d", "p"]
    # Control: the owner's own rewrite, private, is followed.
    membership(path, ("p", prefill, "prefill"), ("d", decode, "decode"), ("d2", other, "decode"))
    await settle(lambda: live_ids(cluster) == ["d", "d2", "p"], LOOSE)
    assert membership_errors(cluster, "unsafe") == 0
    # The attack: the file rewritten to send every prompt elsewhere, and left writable.
    membership(path, ("p", prefill, "prefill"), ("evil", other, "decode"))
    make_unsafe(path)
    await settle(lambda: membership_errors(cluster, "unsafe") >= 1, LOOSE)  # it was seen
    await trio.sleep(0.6)  # a few more polls: still not read
    assert live_ids(cluster) == ["d", "d2", "p"]
    ready = (await cluster.client.get("/readiness")).json()
    assert ready["membership"] == {"file": "down"}
    detail = cluster.router.fleet.sources["file"][1]
    assert str(path) in detail and ("mode" in detail or f"uid {NOBODY}" in detail), detail
    # An admin change is refused too: the file is not written through.
    fresh = {"url": prefill.url, "worker_type": "decode"}  # a worker not registered yet
    refused = await cluster.admin.post("/workers", json=fresh)
    assert refused.status_code == 503, refused.text
    # At start: a usage error naming the path (and the mode or the owner).
    args = build_parser().parse_args(["serve", "--membership-file", str(path)])
    with pytest.raises(SystemExit):
        router_config(args)
    await cluster.client.aclose()
    await cluster.admin.aclose()


def test_an_unsafe_file_is_a_usage_error_naming_path_and_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chmod(tmp_path, 0o700)
    path = tmp_path / "manifest.json"
    path.write_text('{"version": 1, "workers": []}')
    path.chmod(0o600)
    argv = ["serve", "--discovery-provider", "file", "--discovery-file", str(path)]
    assert router_config(build_parser().parse_args(argv)).discovery_file == str(path)  # control
    path.chmod(0o666)
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(argv))
    error = capsys.readouterr().err
    assert str(path) in error and "mode 0666" in error and "group and others" in error


async def test_an_alias_never_takes_over_a_served_model(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """N12: `--model-alias alpha=beta` sent every request naming the served model `alpha` to
    beta. A served model's own name now wins over an alias (logged once); the control alias,
    a name no worker serves, still routes to its model. An alias naming a model the command
    line's workers serve is refused at start."""
    caplog.set_level(logging.ERROR, logger="trio_pd.fleet")
    engines = {
        model: (
            await start_engine(nursery, "prefill", model=model),
            await start_engine(nursery, "decode", model=model),
        )
        for model in ("alpha", "beta")
    }
    aliases = (("alpha", "beta"), ("gpt", "beta"))
    cluster = await cluster_of(
        nursery, [e[0] for e in engines.values()], [e[1] for e in engines.values()],
        health=FAST_HEALTH, model_aliases=aliases,
    )  # fmt: skip
    await settle(lambda: cluster.router.fleet.models() == ["alpha", "beta"], LOOSE)
    for name, served_by in (("alpha", "alpha"), ("gpt", "beta"), ("beta", "beta")):
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = await cluster.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        rid = response.headers["x-request-id"]
        assert engines[served_by][0].events.find("request_start", rid=rid), (name, served_by)
    shadowed = [r.getMessage() for r in caplog.records if "--model-alias alpha=beta" in r.message]
    assert len(shadowed) == 1, shadowed
    argv = ["serve", "--prefill", "http://p:1", "8998", "model=evil", "--decode", "http://d:1",
            "model=evil", "--model-alias", "evil=good"]  # fmt: skip
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(argv))
    argv[-1] = "nice=evil"  # control: an alias of the served model is fine
    assert router_config(build_parser().parse_args(argv)).model_aliases == (("nice", "evil"),)
    await cluster.client.aclose()
    await cluster.admin.aclose()


# -- N14: a file entry pointing where no worker may --------------------------------------------


async def test_a_file_entry_for_a_metadata_address_is_never_listed(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """N14: a membership-file entry for 169.254.169.254 was listed (a worker in /workers, probed
    and refused only at connect). It is skipped as the file is read, as the admin API refuses
    it; the control entry beside it is listed."""
    caplog.set_level(logging.WARNING, logger="trio_pd.membership.file")
    os.chmod(tmp_path, 0o700)
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    path = tmp_path / "membership.json"
    membership(path, ("p", prefill, "prefill"), ("d", decode, "decode"))
    data = json.loads(path.read_text())
    data["workers"].append(
        {"id": "imds", "url": "http://169.254.169.254:80", "worker_type": "decode"}
    )
    data["workers"].append(
        {"id": "gcp", "url": "http://metadata.google.internal", "worker_type": "decode"}
    )
    path.write_text(json.dumps(data))
    cluster = await cluster_of(nursery, [], [], membership_file=str(path), health=FAST_HEALTH)
    assert live_ids(cluster) == ["d", "p"]
    listed = [w["id"] for w in (await cluster.client.get("/workers")).json()["workers"]]
    assert sorted(listed) == ["d", "p"]
    warnings = [r.getMessage() for r in caplog.records]
    assert any("(id 'imds') skipped" in w and "link-local" in w for w in warnings), warnings
    assert any("(id 'gcp') skipped" in w and "metadata" in w for w in warnings), warnings
    assert membership_errors(cluster, "bad_entry") == 2
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    await cluster.client.aclose()
    await cluster.admin.aclose()


# -- N14: sticky pin tables ----------------------------------------------------------------------

STICKY = PolicyConfig(policy="round_robin", routing_key_override=True)


def table_bytes(table: ManualPolicy) -> int:
    """What a pin table's objects hold, measured (`sys.getsizeof`; the worker URLs are the
    workers' own strings): the table, and each key with its route and the route's list."""
    total = sys.getsizeof(table.routes)
    for key, route in table.routes.items():
        total += sys.getsizeof(key) + sys.getsizeof(route) + sys.getsizeof(route.urls)
    return total


async def send_keyed(
    cluster: Cluster, request_id: str, headers: dict[str, str], **body: Any
) -> None:
    response = await cluster.client.post(
        "/generate",
        json=generate_body(max_new_tokens=1, **body),
        headers={"x-request-id": request_id, **headers},
    )
    assert response.status_code == 200, response.text


async def test_sticky_pin_tables_are_bounded_in_bytes(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N14: a pin table held up to 262144 keys (~98 MiB per role per process, outside the
    memory budget). It is now bounded in bytes too (`MAX_ROUTING_KEY_BYTES`, 16 MiB; 64 KiB
    here): 400 sessions with 128-byte keys stay within it, measured, the newest kept."""
    bound = 64 << 10
    monkeypatch.setattr(manual, "MAX_ROUTING_KEY_BYTES", bound)
    cluster = await start_cluster(nursery, n_decode=2, policy=STICKY)
    pins = cluster.router.fleet.policies["decode"].pins
    count = 400
    for i in range(count):
        key = f"session-{i:04d}-" + "k" * 115  # 128 bytes: kept whole, not digested
        await send_keyed(cluster, f"pin-{i}", {"x-smg-routing-key": key})
        assert table_bytes(pins) <= bound, i  # measured, after every request
    # The provoked thing: the sessions need several times the bound.
    assert count * manual.key_cost("3:m:" + "k" * 128) > 2 * bound
    assert pins.bytes <= bound and 0 < len(pins.routes) < count
    assert next(reversed(pins.routes)).endswith("session-0399-" + "k" * 115)  # the newest
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_one_shot_rids_are_not_pinned_but_a_conversation_is(nursery: trio.Nursery) -> None:
    """N14: with `--routing-key-override`, every request's own `rid` became a pin for
    `--max-idle-secs` (4 hours). A rid key is now pinned only when seen again: 200 one-shot
    rids pin nothing, while the control, a conversation's turns (`conv_t1`, `conv_t2`, ...),
    is pinned at its second turn and every turn meets one pair."""
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, policy=STICKY)
    policies = cluster.router.fleet.policies
    for i in range(200):
        await send_keyed(cluster, f"once-{i}", {}, rid=f"one-shot-{i}")
    assert all(len(policies[role].pins.routes) == 0 for role in ("prefill", "decode"))
    assert policies["decode"].branches["first_sight"] == 200  # each was a key, seen once
    for turn in range(1, 5):
        await send_keyed(cluster, f"conv-{turn}", {}, rid=f"conv_t{turn}")
    placed = {
        (
            tuple(who_started(cluster.prefills, f"conv-{t}")),
            tuple(who_started(cluster.decodes, f"conv-{t}")),
        )
        for t in range(1, 5)
    }
    assert len(placed) == 1, placed
    assert all(len(policies[role].pins.routes) == 1 for role in ("prefill", "decode"))
    # A header key is the client's explicit session: pinned at once, as before.
    await send_keyed(cluster, "hdr", {"x-smg-routing-key": "explicit"})
    assert all(len(policies[role].pins.routes) == 2 for role in ("prefill", "decode"))
    await cluster.client.aclose()
    await cluster.admin.aclose()


def depth(node: Any) -> int:
    levels = 0
    while node.parent is not None:
        levels, node = levels + 1, node.parent
    return levels


def test_a_walk_stops_at_max_path_nodes() -> None:
    """N5's CPU: the attack made a chain one node a character, walked by every request. A walk
    now stops at MAX_PATH_NODES (a prompt's tail past it is not recorded or matched): 1,500
    attack prompts leave no chain deeper, and a prompt that branches less matches whole."""
    tree: PrefixTree[str] = PrefixTree()
    for k in range(1, 1501):
        tree.insert("A" * k + "B", "w")
    # The chain stops at the bound (a split there pushes its child one deeper).
    assert max(depth(node) for node in tree._walk()) <= MAX_PATH_NODES + 1
    assert tree.total_nodes() <= 2 * MAX_PATH_NODES + 1
    deep = "A" * 1400 + "B"
    assert tree.match(deep, ["w"])[0] < len(deep)  # its tail lies past the bound
    tree.insert("x" * 30_000, "w")  # control: one long text is one node, matched whole
    assert tree.match("x" * 30_000, ["w"])[0] == 30_000
