"""Issue 18's findings through today's router against the real pair: these FAIL on today's
main (the lead's fixes make them pass; merged only then). Flags that do not exist yet are
written with the names the fix is expected to use (`--worker-admin-api-key`)."""

from __future__ import annotations

import httpx2
import pytest
import trio

from tests.sglang import scenarios
from tests.sglang.conftest import ROUTER_FLAGS


@pytest.fixture
async def engines():
    async with scenarios.client() as c:
        yield c


async def test_abort_of_one_request_spares_a_live_rid_it_prefixes(main_pair, start_router, engines):
    """Finding 4: the scheduler aborts by prefix. A client that leaves request `R` must not
    abort the live request `R-retry1` (the rid trio_pd itself gives R's retry) on the same
    decode. Today the router sends `R` as the engine rid and the abort takes both."""
    router = start_router(main_pair, *ROUTER_FLAGS)
    base = scenarios.fresh_rid("R")
    long = {"text": "go", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    async with httpx2.AsyncClient(base_url=router.url, timeout=60) as client:  # noqa: SIM117
        async with trio.open_nursery() as nursery:
            kept = scenarios.start(
                nursery,
                scenarios.post(client, router.url + "/generate", {**long, "rid": base + "-retry1"}),
            )
            await scenarios.wait_busy(engines, main_pair.decode_url, 1)
            async with httpx2.AsyncClient(base_url=router.url, timeout=60) as leaving:
                with trio.move_on_after(0.5):
                    await leaving.post("/generate", json={**long, "rid": base})
            await kept.done.wait()
    assert kept.answer is not None and kept.answer.status == 200
    assert kept.answer.body["meta_info"]["finish_reason"]["type"] == "length", kept.answer.text


async def test_chat_n2_through_the_router(main_pair, start_router, engines):
    """Finding 1: chat `n=2` is a 400 "rids length mismatch" from the engine today. Fixed: two
    choices (split into single-sample attempts) or the router's own clear 400; either way no
    engine error and no hung decode."""
    router = start_router(main_pair, *ROUTER_FLAGS)
    async with httpx2.AsyncClient(base_url=router.url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", json={**scenarios.CHAT, "n": 2})
    assert "rids length mismatch" not in r.text, r.text
    if r.status_code == 200:
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    else:
        assert r.status_code == 400 and "n" in r.json()["error"]["message"]
    await scenarios.wait_idle(engines, main_pair.decode_url, timeout=10)


async def test_get_loads_reads_v1_loads(main_pair, start_router, engines):
    """Finding 2: `/get_load` is gone (404); the router's `GET /get_loads` must read
    `/v1/loads` and report each worker's load. Today every worker is reported failed."""
    router = start_router(main_pair, *ROUTER_FLAGS)
    async with httpx2.AsyncClient(base_url=router.url, timeout=30) as client:  # noqa: SIM117
        async with trio.open_nursery() as nursery:
            rid = scenarios.fresh_rid("load")
            scenarios.waiting_decode(
                scenarios.Target(
                    main_pair.prefill_url, main_pair.decode_url, main_pair.bootstrap_port
                ),
                engines,
                nursery,
                "/generate",
                {**scenarios.GEN, "rid": rid},
            )
            await scenarios.wait_busy(engines, main_pair.decode_url, 1)
            r = await client.get("/get_loads")
            await scenarios.abort(engines, main_pair.decode_url, {"rid": rid})
    assert r.status_code == 200, r.text
    items = r.json()["workers"] if "workers" in r.json() else r.json()
    text = r.text
    assert "/get_load" not in text or '"ok":false' not in text.replace(" ", ""), text
    decode = [i for i in items if isinstance(i, dict) and i.get("url") == main_pair.decode_url]
    assert decode and decode[0].get("ok") is True and decode[0].get("load") == 1, text


async def test_power_of_two_sees_engine_loads(main_pair, start_router, engines):
    """Finding 2: with power_of_two the router polls loads; against 0.5.23 it must poll
    `/v1/loads` (the decode's log shows it) and never the missing `/get_load`."""
    before = main_pair.decode.log_text()  # the engine-fact tests ask /get_load themselves
    old_polls, old_misses = before.count("GET /v1/loads"), before.count("GET /get_load ")
    router = start_router(main_pair, "--policy", "power_of_two", "--disable-retries")
    del router
    with trio.fail_after(30):
        while main_pair.decode.log_text().count("GET /v1/loads") <= old_polls:
            await trio.sleep(0.2)
    assert main_pair.decode.log_text().count("GET /get_load ") == old_misses


async def test_dp_aware_reads_server_info_not_the_deprecated_alias(main_pair, start_router):
    """Finding 3: the DP width comes from `/server_info` (`dp_size x attn_dp_size`); the
    deprecated `/get_server_info` logs a warning on every probe."""
    before = main_pair.prefill.log_text().count("GET /get_server_info")
    start_router(main_pair, "--dp-aware", *ROUTER_FLAGS)
    await trio.sleep(2.0)
    log = main_pair.prefill.log_text()
    assert log.count("GET /get_server_info") == before
    assert "GET /server_info" in log
