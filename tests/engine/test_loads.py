"""GET /v1/loads in SGLang 0.5.23's shape (entrypoints/v1_loads.py, managers/load_snapshot.py),
with the PD meaning of its figures; GET /get_load is gone unless the legacy option keeps it."""

from __future__ import annotations

import httpx2
import pytest
import trio

from .helpers import Background, eventually, new_room, pd_body, start_engine

CORE_KEYS = {
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
}
DISAGG_KEYS = {
    "mode",
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
    "kv_transfer_speed_gb_s",
    "kv_transfer_latency_ms",
}


async def loads(client: httpx2.AsyncClient, engine, query: str = "") -> dict:
    r = await client.get(engine.url + "/v1/loads" + query)
    assert r.status_code == 200, r.text
    return r.json()


async def test_idle_shape_on_both_roles(pair, client):
    for engine in pair:
        body = await loads(client, engine)
        assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        assert body["version"] == "0.5.23" and body["num_accelerators"] == 1
        assert body["timestamp"].endswith("+00:00")  # ISO 8601, UTC
        (load,) = body["loads"]
        assert set(load) == CORE_KEYS | {"memory", "disaggregation", "queues"}
        assert load["dp_rank"] == 0 and load["max_running_requests"] == 64
        assert load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0
        assert set(load["disaggregation"]) == DISAGG_KEYS
        assert load["disaggregation"]["mode"] == engine.role
        assert set(load["queues"]) == {
            "waiting",
            "grammar",
            "paused",
            "retracted",
            "prealloc_ready",
        }


async def test_decode_counts_requests_waiting_for_kv(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1, inter_token_ms=50.0)
    first, second = new_room(), new_room()
    prompt = "one two three four"
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d1", decode, pd_body(prefill, first, text=prompt), rid="h1")
        await decode.events.wait_for("slot_acquired", room=first)
        bg.post("d2", decode, pd_body(prefill, second, text=prompt), rid="h2")
        await eventually(lambda: decode.queued == 1)
        (load,) = (await loads(client, decode))["loads"]
        # both wait for their KV: one holds a slot (transfer queue), one waits for memory
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 2
        disagg = load["disaggregation"]
        assert disagg["decode_transfer_queue_reqs"] == 1
        assert disagg["decode_prealloc_queue_reqs"] == 1
        assert load["num_used_tokens"] == 4  # the slot holder's prompt
        assert load["num_total_tokens"] == 8 and load["num_active_tokens"] == 0
        body = pd_body(prefill, first, text=prompt, sampling_params={"max_new_tokens": 40})
        bg.post("p1", prefill, body, rid="h1")
        await decode.events.wait_for("first_token", room=first)
        (load,) = (await loads(client, decode))["loads"]
        assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 1
        assert load["disaggregation"]["decode_transfer_queue_reqs"] == 0
        assert load["num_used_tokens"] > 4  # its prompt and the tokens generated so far
        await client.post(decode.url + "/abort_request", json={"abort_all": True})
    await eventually(lambda: decode.running == 0)


async def test_prefill_counts_its_bootstrap_queue(pair, client):
    prefill, _ = pair
    room = new_room()
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("p", prefill, pd_body(prefill, room, text="a b", rid="lonely"), rid="hp")
        await eventually(lambda: room in prefill.rooms)
        (load,) = (await loads(client, prefill))["loads"]
        assert load["num_waiting_reqs"] == 1 and load["num_running_reqs"] == 0
        assert load["disaggregation"]["prefill_bootstrap_queue_reqs"] == 1
        assert load["disaggregation"]["decode_prealloc_queue_reqs"] == 0
        await client.post(prefill.url + "/abort_request", json={"rid": "lonely"})
    (load,) = (await loads(client, prefill))["loads"]
    assert load["num_waiting_reqs"] == 0


async def test_include_dp_rank_and_format(nursery, client):
    decode = await start_engine(nursery, "decode", dp_size=2)
    body = await loads(client, decode)
    assert [x["dp_rank"] for x in body["loads"]] == [0, 1]
    (core,) = (await loads(client, decode, "?include=core&dp_rank=1"))["loads"]
    assert set(core) == CORE_KEYS and core["dp_rank"] == 1
    (some,) = (await loads(client, decode, "?include=core,disagg&dp_rank=0"))["loads"]
    assert set(some) == CORE_KEYS | {"disaggregation"}
    assert (await loads(client, decode, "?dp_rank=7"))["loads"] == []
    # SGLang validates the section inside LoadSnapshot.to_dict, outside its ValueError -> 400
    # handler: an unknown section is a bare 500
    r = await client.get(decode.url + "/v1/loads?include=core,bogus")
    assert r.status_code == 500 and r.text == "Internal Server Error"
    r = await client.get(decode.url + "/v1/loads?dp_rank=x")
    assert r.status_code == 400 and r.json()["object"] == "error"
    r = await client.get(decode.url + "/v1/loads?format=prometheus")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'sglang_num_running_reqs{dp_rank="1"} 0' in r.text
    assert 'sglang_disagg_decode_prealloc_queue_reqs{dp_rank="0"} 0' in r.text


@pytest.mark.parametrize(
    "options", [{"dp_size": 2, "enable_dp_attention": True}, {"attn_dp_size": 2}]
)
async def test_attention_dp_ranks_each_get_a_snapshot(nursery, client, options):
    decode = await start_engine(nursery, "decode", **options)
    body = await loads(client, decode)
    assert [x["dp_rank"] for x in body["loads"]] == [0, 1]
    assert body["num_accelerators"] == 1  # tp 2 over 2 attention-DP groups


async def test_get_load_is_gone_unless_kept_for_old_engines(nursery, client):
    decode = await start_engine(nursery, "decode")
    r = await client.get(decode.url + "/get_load")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert decode.events.find("info_request", path="/get_load", status=404)
    old = await start_engine(nursery, "decode", legacy_load_endpoint=True, dp_size=2)
    r = await client.get(old.url + "/get_load")
    assert r.status_code == 200
    assert r.json() == {
        "num_reqs": 0,
        "num_waiting_reqs": 0,
        "num_tokens": 0,
        "dp_loads": [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
            {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
        ],
    }


async def test_saturate_reports_another_routers_load(nursery, client):
    """The test knob (`EngineState.saturate`, `--extra-queued`): requests queued for compute
    in the waiting queue, running ones and KV held, on every rank, until it is undone."""
    decode = await start_engine(nursery, "decode", extra_queued=3)
    url = f"http://127.0.0.1:{decode.port}/v1/loads?include=core,disagg,queues"
    [load] = (await client.get(url)).json()["loads"]
    assert (load["num_waiting_reqs"], load["queues"]["waiting"]) == (3, 3)
    assert load["disaggregation"]["decode_prealloc_queue_reqs"] == 0  # none waits for KV
    half = decode.config.max_total_tokens // 2
    decode.state.saturate(queued=9, running=2, used_tokens=half)
    [load] = (await client.get(url)).json()["loads"]
    assert (load["num_waiting_reqs"], load["num_running_reqs"]) == (9, 2)
    assert load["token_usage"] == 0.5 and load["num_used_tokens"] == half
    decode.state.saturate()
    [load] = (await client.get(url)).json()["loads"]
    assert (load["num_waiting_reqs"], load["num_running_reqs"], load["token_usage"]) == (0, 0, 0.0)
