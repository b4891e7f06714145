"""Engine facts, talking to the real engines directly (no router): one test per fact the
router relies on, each naming the SGLang 0.5.23 source it comes from (package-relative,
`sglang/srt/...`). The scenarios are in `tests.sglang.scenarios`."""

from __future__ import annotations

import pytest
import trio

from tests.sglang import pairs, scenarios
from trio_pd_testing.sglang import SGLangPair
from trio_pd_testing.sglang.launcher import (
    EngineStartError,
    distinct_free_ports,
    engine_command,
    spawn_engine,
    wait_ready,
)


@pytest.fixture
async def client():
    async with scenarios.client() as c:
        yield c


async def test_chat_n2_with_a_rid_list_is_400_rids_length_mismatch(main_target, client):
    """managers/io_struct.py `_normalize_rid`: a rid list must have batch-size entries."""
    got = await scenarios.chat_n2_rid_list(main_target, client)
    assert got["status"] == [400, 400]
    assert got["rids_length_mismatch"] == [True, True]


async def test_pd_n2_with_one_rid_prefill_answers_and_decode_hangs(main_pair, main_target, client):
    """managers/io_struct.py `parallel_sample_num`: n samples, fresh rids, one room; the
    decode waits on the room for ever. An abort by the request's rid does not reach the
    samples (their rids are regenerated); `abort_all` does. The samples can also crash the
    prefill (pairs.py `SHARED_ROOM_CRASH`): the router never sends a shared room."""
    got = await pairs.past_shared_room_crashes(
        main_pair, lambda: scenarios.pd_n2_single_rid(main_target, client)
    )
    assert got["prefill_status"] == 200 and got["prefill_choices"] == 2
    assert got["decode_hung"] and got["decode_busy_while_hung"]
    assert got["abort_by_rid_frees_it"] is False
    assert got["decode_status_after_abort_all"] == 500


async def test_get_load_is_gone(main_target, client):
    """entrypoints/http_server.py has no /get_load any more."""
    assert (await scenarios.get_load_gone(main_target, client))["status"] == [404, 404]


async def test_v1_loads_per_rank_with_a_disaggregation_section(main_target, client):
    """entrypoints/v1_loads.py, managers/load_snapshot.py."""
    got = await scenarios.v1_loads(main_target, client)
    for role in ("prefill", "decode"):
        assert got[role]["num_ranks"] == 1
        assert got[role]["disaggregation_mode"] == role
        assert "disaggregation" in got[role]["include_disagg_keys"]
        assert "disaggregation" not in got[role]["include_core_keys"]
        assert "num_waiting_reqs" in got[role]["include_core_keys"]
    loads = got["decode"]["shape"]["loads"][0]
    assert loads["disaggregation"]["decode_transfer_queue_reqs"] == "int"
    assert loads["num_running_reqs"] == "int" and loads["token_usage"] == "float"


async def test_decode_waiting_for_kv_counts_as_waiting_and_in_transfer_queue(main_target, client):
    """disaggregation/decode.py: a request whose KV has not arrived sits in the transfer
    queue and counts in `num_waiting_reqs` (what a load-aware policy reads)."""
    rid = scenarios.fresh_rid("wait")
    url = main_target.decode_url
    async with trio.open_nursery() as nursery:
        scenarios.waiting_decode(
            main_target, client, nursery, "/generate", {**scenarios.GEN, "rid": rid}
        )
        await scenarios.wait_busy(client, url, 1)
        load = (await scenarios.loads(client, url))["loads"][0]
        assert load["num_waiting_reqs"] == 1
        assert load["disaggregation"]["decode_transfer_queue_reqs"] == 1
        await scenarios.abort(client, url, {"rid": rid})
    await scenarios.wait_idle(client, url)


async def test_server_info_has_dp_size_and_attn_dp_size(main_target, client):
    """runtime_context.py: DP width = dp_size x attn_dp_size, both in /server_info."""
    got = await scenarios.server_info(main_target, client)
    for role in ("prefill", "decode"):
        assert got[role]["dp_size"] == 1 and got[role]["attn_dp_size"] == 1
        assert got[role]["disaggregation_mode"] == role
        assert got[role]["alias_status"] == 200 and got[role]["alias_same_keys"]
    assert got["prefill"]["bootstrap_port_is_int"]


async def test_get_server_info_logs_a_deprecation_warning(main_pair: SGLangPair, client):
    """entrypoints/http_server.py: the /get_server_info alias warns on every call."""
    before = main_pair.decode.log_text().count("/get_server_info' is deprecated")
    for _ in range(2):
        assert (await client.get(main_pair.decode_url + "/get_server_info")).status_code == 200
    with trio.fail_after(5):
        while main_pair.decode.log_text().count("/get_server_info' is deprecated") < before + 2:
            await trio.sleep(0.05)
    # ... and /server_info does not.
    assert (await client.get(main_pair.decode_url + "/server_info")).status_code == 200
    await trio.sleep(0.3)
    assert main_pair.decode.log_text().count("/get_server_info' is deprecated") == before + 2


def test_dp_attention_on_cpu(log_dir):
    """`--dp-size 2 --enable-dp-attention` on this CPU engine (server_args.py resolves it to
    dp_size=1, attn_dp_size=2). See docs/sglang-tier.md for what happened here."""
    port, bootstrap = distinct_free_ports(2)
    command = engine_command(
        "prefill",
        port,
        bootstrap_port=bootstrap,
        extra_args=["--dp-size", "2", "--enable-dp-attention"],
    )
    engine = spawn_engine("prefill", port, log_dir / "dp-attention.log", command)
    try:
        with pytest.raises(EngineStartError) as failed:
            wait_ready([engine], 240)
        assert DP_ATTENTION_CPU_ERROR in str(failed.value)
    finally:
        engine.kill()


# What the CPU engine says when DP attention is asked for (measured; see the docs).
DP_ATTENTION_CPU_ERROR = "assert cfg.tp_size % cfg.attn_dp_size == 0"


async def test_abort_matches_by_prefix(main_target, client):
    """managers/scheduler.py: `req.rid.startswith(abort.rid)`. Aborting `X` with `X` and
    `X-retry1` live aborts both; aborting `X-retry1` spares `X`; an unrelated rid stays."""
    got = await scenarios.abort_prefix(main_target, client)
    assert got["prefix_aborted"] == [True, True]
    assert got["longer_rid_abort_spares_shorter"] and got["unrelated_alive"]
    assert got["abort_answer"] == [200, "", 200, ""]
    assert got["aborted_status"] == [500, 500] and got["aborted_message_says"] == [True, True]


async def test_abort_request_rejects_a_list_rid(main_target, client):
    """managers/io_struct.py AbortReq: `rid` is a string."""
    got = await scenarios.abort_list_rid(main_target, client)
    assert got["status"] == 400


async def test_abort_of_an_unknown_rid_is_200_empty(main_target, client):
    """entrypoints/http_server.py abort_request: 200 whether or not anything matched."""
    assert await scenarios.abort_unknown_rid(main_target, client) == {"status": 200, "body": ""}


async def test_openai_routes_have_no_meta_info(main_target, client):
    """entrypoints/openai/protocol.py: chat and completion bodies and chunks have no
    top-level `meta_info` (unlike /generate)."""
    assert (await scenarios.chat(main_target, client))["has_meta_info"] is False
    assert (await scenarios.completions(main_target, client))["has_meta_info"] is False
    assert (await scenarios.chat_stream(main_target, client))["any_event_has_meta_info"] is False
    assert "meta_info" in (await scenarios.generate_text(main_target, client))["decode_shape"]


async def test_aborted_running_request_finish_reason_abort(main_target, client):
    """managers/scheduler.py + entrypoints/openai/serving_chat.py: a running request aborted
    ends 200 with `finish_reason == "abort"` per choice on OpenAI routes and
    `meta_info.finish_reason.type == "abort"` on /generate."""
    got = await scenarios.running_abort_openai(main_target, client)
    chat = got["/v1/chat/completions"]
    assert chat["status"] == 200 and chat["finish_reasons"] == ["abort"]
    assert chat["has_meta_info"] is False
    generate = got["/generate"]
    assert (generate["prefill_status"], generate["status"]) == (200, 200)
    # The whole object (issue 28: what in-band detection reads), not only its type.
    assert generate["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }


async def test_aborted_waiting_openai_request_is_an_http_500(main_target, client):
    """disaggregation/decode.py: aborted while waiting for KV, the request fails with
    KVTransferError -> HTTP 500 with an OpenAI error object."""
    got = await scenarios.waiting_abort_openai(main_target, client)
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert got[route] == {"status": 500, "envelope": "openai-error"}


async def test_disconnect_stream_at_once_non_stream_at_the_4s_poll(main_target, client):
    """managers/tokenizer_manager.py: a stream's closed connection aborts at once; a
    non-stream one at the next `is_disconnected()` poll (SGLANG_REQUEST_STATE_WAIT_TIMEOUT=4)."""
    got = await scenarios.disconnect_timing(main_target, client)
    assert got["stream_class"] == "at_once", got
    assert got["non_stream_class"] == "poll", got


async def test_room_zero_leaves_the_decode_waiting(main_target, client):
    """disaggregation/utils.py: room 0 is the decode's "metadata not yet written" value; a
    PD request with room 0 is answered by the prefill and never by the decode."""
    got = await scenarios.room_zero(main_target, client)
    assert got["prefill_status"] == 200
    assert got["decode_done"] is False


async def test_health_generates_ready_is_cheap(main_target, client):
    """entrypoints/http_server.py: /health runs a 1-token generation, waking in 1 s steps;
    /ready only reads the tokenizer manager's state."""
    got = await scenarios.health_vs_ready(main_target, client)
    assert got["/health"]["status"] == 200 and got["/health"]["at_least_1s"]
    assert got["/ready"]["status"] == 200 and max(got["/ready"]["ms"]) < 500


async def test_duplicate_rid_refused(main_target, client):
    """managers/tokenizer_manager.py: a live rid cannot be reused: 400 with a JSON error on
    /generate; on a stream, 200 then an SSE error event and [DONE]."""
    got = await scenarios.duplicate_rid(main_target, client)
    assert got["non_stream"] == {"status": 400, "envelope": "error-object", "says_duplicate": True}
    assert got["stream"]["status"] == 200 and got["stream"]["says_duplicate"]
    assert got["stream"]["events"][-1] == "str"  # [DONE]
    assert "error" in got["stream"]["events"][0]
    assert got["first_still_waiting"]


async def test_prefill_context_400_then_abort_frees_the_decode(main_target, client):
    """A prompt over the prefill's --context-length: prefill 400 at once
    (managers/tokenizer_manager.py `_validate_one_request`), the decode waits for KV until
    aborted; the abort answers it 500 "Aborted by AbortReq" and /v1/loads is idle in ms."""
    got = await scenarios.prefill_context_400(main_target, client)
    assert got["prefill_status"] == 400 and got["prefill_says_context"]
    assert got["decode_waiting_after_prefill_400"]
    assert got["decode_status"] == 500 and got["decode_says_aborted"]
    assert got["slot_freed_ms"] < 2000, got


async def test_generate_text_input_ids_and_stream(main_target, client):
    """The PD basics: both legs 200; prefill generates 1 token, decode the rest."""
    text = await scenarios.generate_text(main_target, client)
    assert text["status"] == [200, 200] and text["decode_completion_tokens"] == 4
    assert text["prefill_completion_tokens"] == 1
    ids = await scenarios.generate_input_ids(main_target, client)
    assert ids["status"] == [200, 200] and ids["prompt_tokens"] == 4
    stream = await scenarios.generate_stream(main_target, client)
    assert stream["status"] == [200, 200] and stream["ends_with_done"]
    assert stream["decode_content_type"] == "text/event-stream"
