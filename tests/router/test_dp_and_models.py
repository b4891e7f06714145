"""Data-parallel engines and several models behind one router (issue 12, parts 2 and 3), over
real sockets against simulator engines with DP ranks and model names."""

from __future__ import annotations

import orjson
import pytest
import trio

from tests.conftest import cluster_of, start_cluster, start_engine
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body, settle
from trio_pd.cli.main import build_parser, router_config
from trio_pd.pd.injection import MAX_ROOM, rooms_for


def chat(model: str | None = None, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return body


# -- data parallel --------------------------------------------------------------------------


def test_rooms_agree_with_the_chosen_rank() -> None:
    import random

    rng = random.Random(7)
    for dp, rank in [(2, 1), (4, 3), (8, 0)]:
        rooms = [rooms_for(None, rng, dp, rank) for _ in range(200)]
        assert all(r % dp == rank and 0 <= r <= MAX_ROOM for r in rooms)
        assert len(set(rooms)) == 200  # random in their other bits
    batch = rooms_for(16, rng, 4, 2)
    assert len(set(batch)) == 16 and all(r % 4 == 2 for r in batch)


async def test_dp_aware_pins_ranks_the_engines_then_use(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        prefill={"dp_size": 2},
        decode={"dp_size": 2, "inter_token_ms": 100.0},
        dp_aware=True,
        health=FAST_HEALTH,
    )
    prefill, decode = cluster.router.fleet.workers()
    await settle(lambda: prefill.dp_size == 2 and decode.dp_size == 2, LOOSE)  # learned
    rids = [f"dp-{i}" for i in range(8)]

    async def one(rid: str) -> None:
        response = await cluster.client.post(
            "/generate", json=generate_body(max_new_tokens=3), headers={"x-request-id": rid}
        )
        assert response.status_code == 200

    async with trio.open_nursery() as burst:  # concurrent: ranks balance by in-flight legs
        for rid in rids:
            burst.start_soon(one, rid)
    prefill_ranks, decode_ranks = [], []
    for rid in rids:
        p_body = orjson.loads(cluster.prefill.events.find("request_start", rid=rid)[0]["raw"])
        d_body = orjson.loads(cluster.decode.events.find("request_start", rid=rid)[0]["raw"])
        p_rank, d_rank = p_body["routed_dp_rank"], d_body["routed_dp_rank"]
        assert d_body["disagg_prefill_dp_rank"] == p_rank
        assert p_body["bootstrap_room"] == d_body["bootstrap_room"]
        assert p_body["bootstrap_room"] % 2 == p_rank  # rooms agree with the pinned rank
        # The rank the router chose is the rank that did the work, on both legs.
        assert cluster.prefill.events.find("kv_sent", rid=rid)[0]["dp_rank"] == p_rank
        registered = cluster.decode.events.find("room_registered", rid=rid)[0]
        assert registered["dp_rank"] == d_rank and registered["prefill_dp_rank"] == p_rank
        assert cluster.decode.events.find("slot_freed", rid=rid)[0]["reason"] == "finished"
        prefill_ranks.append(p_rank)
        decode_ranks.append(d_rank)
    assert sorted(set(prefill_ranks)) == [0, 1] and sorted(set(decode_ranks)) == [0, 1], (
        prefill_ranks,
        decode_ranks,
    )
    assert abs(decode_ranks.count(0) - decode_ranks.count(1)) <= 2, decode_ranks  # balanced
    assert not cluster.prefill.events.find("rank_mismatch")
    await cluster.client.aclose()


async def test_without_dp_aware_the_body_is_as_before(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, prefill={"dp_size": 2}, decode={"dp_size": 2}, health=FAST_HEALTH
    )
    await settle(lambda: all(w.dp_size == 2 for w in cluster.router.fleet.workers()), LOOSE)
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"x-request-id": "plain"}
    )
    assert response.status_code == 200
    body = orjson.loads(cluster.prefill.events.find("request_start", rid="plain")[0]["raw"])
    assert not {"routed_dp_rank", "disagg_prefill_dp_rank"} & set(body)  # nothing pinned
    room = body["bootstrap_room"]
    # Unpinned, the prefill derives its rank from the room (`follow_bootstrap_room`, SGLang's
    # PD prefill default); the decode balances its own ranks (round robin) and reads the
    # prefill's rank off the room as well.
    assert cluster.prefill.events.find("kv_sent", rid="plain")[0]["dp_rank"] == room % 2
    assert cluster.decode.events.find("room_registered", rid="plain")
    await cluster.client.aclose()


# -- several models -------------------------------------------------------------------------


async def two_models(nursery: trio.Nursery, **options):
    engines = {
        model: (
            await start_engine(nursery, "prefill", model=model),
            await start_engine(nursery, "decode", model=model),
        )
        for model in ("alpha", "beta")
    }
    prefills = [engines[m][0] for m in engines]
    decodes = [engines[m][1] for m in engines]
    cluster = await cluster_of(nursery, prefills, decodes, health=FAST_HEALTH, **options)
    await settle(lambda: cluster.router.fleet.models() == ["alpha", "beta"], LOOSE)
    await settle(lambda: all(w.healthy for w in cluster.router.fleet.workers()), LOOSE)
    return cluster, engines


async def test_openai_requests_route_by_model(nursery: trio.Nursery) -> None:
    cluster, engines = await two_models(nursery)
    for model in ("alpha", "beta", "alpha", "beta", "beta"):
        response = await cluster.client.post("/v1/chat/completions", json=chat(model))
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        rid = response.headers["x-request-id"]
        prefill, decode = engines[model]
        assert prefill.events.find("request_start", rid=rid)
        assert decode.events.find("request_start", rid=rid)
    for model, (prefill, _) in engines.items():
        expected = 2 if model == "alpha" else 3
        assert len(prefill.events.find("request_start")) == expected

    unknown = await cluster.client.post("/v1/chat/completions", json=chat("gamma"))
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and "alpha, beta" in error["message"]
    nameless = await cluster.client.post("/generate", json=generate_body())
    assert nameless.status_code == 400
    assert "--default-model" in nameless.json()["error"]["message"]
    assert not any(
        e.events.find("request_start", rid=r.headers["x-request-id"])
        for e in (*cluster.prefills, *cluster.decodes)
        for r in (unknown, nameless)
    )
    listed = (await cluster.client.get("/v1/models")).json()
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    metrics = (await cluster.client.get("/metrics")).text
    assert 'trio_pd_model_requests_total{model="beta",status="200"} 3.0' in metrics
    await cluster.client.aclose()


async def test_a_default_model_takes_requests_naming_none(nursery: trio.Nursery) -> None:
    cluster, engines = await two_models(nursery, default_model="beta")
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert engines["beta"][0].events.find("request_start", rid=rid)
    await cluster.client.aclose()


async def test_one_model_is_the_zero_configuration_case(cluster) -> None:
    """Whatever `model` a client names, one model routes as before (SGLang ignores it too)."""
    for body in (chat("anything"), chat(), chat("sim-model")):
        assert (await cluster.client.post("/v1/chat/completions", json=body)).status_code == 200
    proxied = (await cluster.client.get("/v1/models")).json()
    assert [m["id"] for m in proxied["data"]] == ["sim-model"]  # the engine's own answer


async def test_model_ids_from_flags_and_the_admin_api(nursery: trio.Nursery) -> None:
    args = build_parser().parse_args(
        ["serve", "--prefill", "http://p:1", "8998", "model=alpha", "--decode", "http://d:1",
         "model=alpha", "--prefill", "http://q:1", "--default-model", "alpha", "--dp-aware"]
    )  # fmt: skip
    config = router_config(args)
    assert [(w.url, w.bootstrap_port, w.model_id) for w in config.prefill] == [
        ("http://p:1", 8998, "alpha"),
        ("http://q:1", None, None),
    ]
    assert config.decode[0].model_id == "alpha"
    assert config.default_model == "alpha" and config.dp_aware
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode", "http://d:1", "8998"])

    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    other = await start_engine(nursery, "decode", model="named-by-engine")
    added = await cluster.admin.post(
        "/workers", json={"url": other.url, "worker_type": "decode", "model_id": "zeta"}
    )
    assert added.status_code == 202 and added.json()["model_id"] == "zeta"  # configured wins
    await settle(lambda: cluster.router.fleet.get(added.json()["id"]).info_at is not None, LOOSE)
    assert cluster.router.fleet.get(added.json()["id"]).model == "zeta"
    await cluster.client.aclose()


async def test_a_model_alias_routes_as_its_model(nursery: trio.Nursery) -> None:
    """`--model-alias` (SMG 1.13): a request naming the alias goes to the model's engines, and
    only there; the alias is no model of its own (an alias of nothing served is still a 404)."""
    aliases = (("gpt-4o", "beta"), ("old", "gone"))
    cluster, engines = await two_models(nursery, model_aliases=aliases)
    for _ in range(3):
        response = await cluster.client.post("/v1/chat/completions", json=chat("gpt-4o"))
        assert response.status_code == 200, response.text
        rid = response.headers["x-request-id"]
        assert engines["beta"][0].events.find("request_start", rid=rid)
        assert engines["beta"][1].events.find("request_start", rid=rid)
    assert not engines["alpha"][1].events.find("request_start")
    assert (
        await cluster.client.post("/v1/chat/completions", json=chat("Gpt-4o"))
    ).status_code == 404
    gone = await cluster.client.post("/v1/chat/completions", json=chat("old"))
    assert gone.status_code == 404 and "'gone'" in gone.json()["error"]["message"]
