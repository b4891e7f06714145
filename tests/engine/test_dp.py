"""Data-parallel ranks: room % dp_size, pinned ranks, per-rank slots, rank mismatches."""

from __future__ import annotations

from typing import Any

import httpx2
import trio

from trio_pd_testing.engine import EngineHandle

from .helpers import eventually, new_room, pd_body, pd_post, start_engine


def room_on(rank: int, dp_size: int = 2) -> int:
    """A fresh room whose default rank is `rank`."""
    while (room := new_room()) % dp_size != rank:
        pass
    return room


async def post(client: httpx2.AsyncClient, engine: EngineHandle, body: dict[str, Any]):
    return await client.post(engine.url + "/generate", json=body)


async def dp_pair(nursery: trio.Nursery, **decode: Any) -> tuple[EngineHandle, EngineHandle]:
    prefill = await start_engine(nursery, "prefill", dp_size=2, bootstrap_timeout=1.0)
    decode.setdefault("waiting_timeout", 5.0)
    return prefill, await start_engine(nursery, "decode", dp_size=2, **decode)


async def test_unpinned_requests_land_on_room_mod_dp_size(nursery, client):
    """A decode balancing by follow_bootstrap_room (the PD prefill's default) too."""
    prefill, decode = await dp_pair(nursery, load_balance_method="follow_bootstrap_room")
    for engine in (prefill, decode):
        assert (await client.get(engine.url + "/server_info")).json()["dp_size"] == 2
    for rank in (0, 1, 0, 1):
        room = room_on(rank)
        p, d = await pd_post(client, prefill, decode, "/generate", pd_body(prefill, room, text="a"))
        assert p.status_code == d.status_code == 200
        await decode.events.wait_for("request_end", room=room)
        await prefill.events.wait_for("request_end", room=room)
        for engine in (prefill, decode):
            records = engine.events.find(room=room)
            assert records and all(r["dp_rank"] == rank for r in records)  # every event
        registered = decode.events.find("room_registered", room=room)[0]
        assert registered["prefill_dp_rank"] == rank
    # a batch spreads its items over the ranks of their rooms
    rooms = [room_on(0), room_on(1)]
    body = pd_body(prefill, rooms, text=["a", "b"])
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == d.status_code == 200
    for engine in (prefill, decode):
        assert engine.events.find("request_start", rooms=rooms)[0]["dp_ranks"] == [0, 1]
    assert [decode.events.find("slot_acquired", room=r)[0]["dp_rank"] for r in rooms] == [0, 1]


async def test_pinned_ranks_land_where_pinned(nursery, client):
    prefill, decode = await dp_pair(nursery)
    room = room_on(0)
    # what a DP-aware router sends: the prefill rank to both, the decode rank to decode (the
    # prefill needs disagg_prefill_dp_rank too, else its follow_bootstrap_room refuses the pin)
    p_body = pd_body(prefill, room, text="a", routed_dp_rank=1, disagg_prefill_dp_rank=1)
    d_body = pd_body(prefill, room, text="a", routed_dp_rank=1, disagg_prefill_dp_rank=1)
    d_body["routed_dp_rank"] = 0
    async with trio.open_nursery() as inner:
        results = {}

        async def leg(name, engine, body):
            results[name] = await post(client, engine, body)

        inner.start_soon(leg, "p", prefill, p_body)
        inner.start_soon(leg, "d", decode, d_body)
    assert results["p"].status_code == results["d"].status_code == 200
    assert prefill.events.find("kv_sent", room=room)[0]["dp_rank"] == 1
    assert decode.events.find("slot_acquired", room=room)[0]["dp_rank"] == 0
    assert decode.events.find("room_registered", room=room)[0]["prefill_dp_rank"] == 1
    assert not prefill.events.find("rank_mismatch")
    assert not prefill.events.find("rank_conflict")
    # the deprecated alias pins too
    room = room_on(0)
    body = pd_body(prefill, room, text="a", data_parallel_rank=1, disagg_prefill_dp_rank=1)
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == d.status_code == 200
    assert decode.events.find("slot_acquired", room=room)[0]["dp_rank"] == 1


async def test_slots_are_per_rank(nursery, client):
    prefill, decode = await dp_pair(nursery, max_running=1)
    a, b, c = room_on(0), room_on(0), room_on(1)
    bodies = {room: pd_body(prefill, room, text="a", routed_dp_rank=0) for room in (a, b)}
    bodies[c] = pd_body(prefill, c, text="a", routed_dp_rank=1)
    results = {}

    async def leg(name, engine, body):
        results[name] = await post(client, engine, body)

    async with trio.open_nursery() as inner:
        inner.start_soon(leg, "da", decode, bodies[a])
        await decode.events.wait_for("slot_acquired", room=a)
        inner.start_soon(leg, "db", decode, bodies[b])
        await decode.events.wait_for("room_registered", room=b)
        inner.start_soon(leg, "dc", decode, bodies[c])
        await decode.events.wait_for("slot_acquired", room=c)  # rank 1 is free: no wait
        await eventually(lambda: decode.queued == 1)
        assert decode.running == 2 and not decode.events.find("slot_acquired", room=b)
        loads = (await client.get(decode.url + "/v1/loads")).json()["loads"]
        # every one waits for its KV: per rank, the slot holders in the transfer queue and the
        # one without a slot in the prealloc queue
        assert [
            (
                x["dp_rank"],
                x["num_running_reqs"],
                x["num_waiting_reqs"],
                x["disaggregation"]["decode_transfer_queue_reqs"],
                x["disaggregation"]["decode_prealloc_queue_reqs"],
            )
            for x in loads
        ] == [(0, 0, 2, 1, 1), (1, 0, 1, 1, 0)]
        for room in (a, b, c):
            inner.start_soon(leg, f"p{room}", prefill, bodies[room])
    assert all(r.status_code == 200 for r in results.values())
    assert (
        decode.events.find("slot_acquired", room=b)[0]["t"]
        >= (decode.events.find("slot_freed", room=a)[0]["t"])
    )
    assert decode.running == decode.queued == 0


async def test_decode_round_robins_by_default(nursery, client):
    prefill, decode = await dp_pair(nursery)
    ranks = []
    for _ in range(4):
        room = room_on(0)  # every room on prefill rank 0
        p, d = await pd_post(client, prefill, decode, "/generate", pd_body(prefill, room, text="a"))
        assert p.status_code == d.status_code == 200
        ranks.append(decode.events.find("slot_acquired", room=room)[0]["dp_rank"])
        assert decode.events.find("room_registered", room=room)[0]["prefill_dp_rank"] == 0
    assert ranks == [0, 1, 0, 1]


async def test_pin_off_the_room_fails_the_prefill_at_once(nursery, client):
    """follow_bootstrap_room conflict (disaggregation/common/conn.py): a prefill pinned to
    another rank than room % N, not told disagg_prefill_dp_rank, fails the room at once; its
    decode registered room % N and waits for a KV nobody sends."""
    prefill, decode = await dp_pair(nursery, waiting_timeout=0.5)
    room = room_on(0)
    body = pd_body(prefill, room, text="a", routed_dp_rank=1)
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 500 and "follow_bootstrap_room conflict" in p.json()["message"]
    conflict = prefill.events.find("rank_conflict", room=room)[0]
    assert conflict["dp_rank"] == 1 and conflict["implied"] == 0
    # At once: the conflict ended the room, not the prefill's bootstrap timeout (1 s).
    assert not prefill.events.find("bootstrap_timeout", room=room)
    assert not prefill.events.find("room_registered", room=room)
    assert d.status_code == 500 and "timed out" in d.json()["message"]
    assert decode.events.find("kv_wait_timeout", room=room)


async def test_rank_mismatch_makes_the_decode_wait(nursery, client):
    prefill, decode = await dp_pair(nursery, waiting_timeout=0.5)
    for prefill_first in (True, False):
        room = room_on(0)
        # pinned to rank 1 and told so (no conflict) ...
        p_body = pd_body(prefill, room, text="a", routed_dp_rank=1, disagg_prefill_dp_rank=1)
        d_body = pd_body(prefill, room, text="a")  # ... but decode registers rank 0
        results: dict[str, httpx2.Response] = {}

        async def leg(name, engine, body, results=results):
            results[name] = await post(client, engine, body)

        async with trio.open_nursery() as inner:
            first, second = (prefill, decode) if prefill_first else (decode, prefill)
            inner.start_soon(leg, first.role, first, p_body if prefill_first else d_body)
            await first.events.wait_for("request_start", room=room)
            await eventually(lambda room=room: room in prefill.rooms)
            inner.start_soon(leg, second.role, second, d_body if prefill_first else p_body)
        assert results["decode"].status_code == 500  # the KV never came
        assert "timed out" in results["decode"].json()["message"]
        freed = await decode.events.wait_for("slot_freed", room=room)
        assert freed["reason"] == "kv_wait_timeout"
        assert results["prefill"].status_code == 500  # nobody registered its rank either
        assert "KVPoll.Bootstrapping" in results["prefill"].json()["message"]
        assert prefill.events.find("bootstrap_timeout", room=room)
        mismatch = prefill.events.find("rank_mismatch", room=room)[0]
        assert (mismatch["dp_rank"], mismatch["registered_rank"]) == (1, 0)
        assert not prefill.events.find("kv_sent", room=room)


async def test_out_of_range_ranks(nursery, client):
    prefill, decode = await dp_pair(nursery)
    for engine in (prefill, decode):
        r = await post(client, engine, pd_body(prefill, new_room(), text="a", routed_dp_rank=2))
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "routed_dp_rank=2 out of range [0, 2)"}}
        r = await post(client, engine, pd_body(prefill, new_room(), text="a", routed_dp_rank=-1))
        assert r.status_code == 400
    room = new_room()
    d = await post(client, decode, pd_body(prefill, room, text="a", disagg_prefill_dp_rank=5))
    assert d.status_code == 500 and "out of range" in d.json()["message"]
    assert decode.events.find("bootstrap_failed", room=room)
    assert decode.running == 0


async def test_one_rank_without_dp(pair, client):
    for engine in pair:
        assert len((await client.get(engine.url + "/v1/loads")).json()["loads"]) == 1
        info = (await client.get(engine.url + "/server_info")).json()
        assert info["dp_size"] == info["attn_dp_size"] == 1


async def test_the_openai_header_pins_the_rank(nursery, client):
    """serving_base.extract_routed_dp_rank_from_header: X-Data-Parallel-Rank wins over the
    body's routed_dp_rank on the OpenAI routes."""
    prefill, decode = await dp_pair(nursery)
    room = room_on(0)
    body = pd_body(prefill, room, prompt="a", max_tokens=1, routed_dp_rank=0)
    headers = {"x-data-parallel-rank": "1"}
    async with trio.open_nursery() as inner:
        results = {}

        async def leg(name, engine, extra):
            results[name] = await client.post(
                engine.url + "/v1/completions", json=body, headers=extra
            )

        inner.start_soon(leg, "d", decode, headers)
        inner.start_soon(leg, "p", prefill, {})
    assert results["d"].status_code == results["p"].status_code == 200
    assert decode.events.find("slot_acquired", room=room)[0]["dp_rank"] == 1
    r = await client.post(
        decode.url + "/v1/completions", json=body, headers={"x-data-parallel-rank": "x"}
    )
    assert r.status_code == 400 and "X-Data-Parallel-Rank" in r.json()["message"]
