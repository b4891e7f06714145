"""GET /server_info (resolved server args, SGLang 0.5.23), its deprecated alias, /model_info."""

from __future__ import annotations

from .helpers import start_engine


async def test_server_info_reports_the_resolved_args(pair, client):
    prefill, decode = pair
    p = (await client.get(prefill.url + "/server_info")).json()
    d = (await client.get(decode.url + "/server_info")).json()
    assert p["disaggregation_mode"] == "prefill" and d["disaggregation_mode"] == "decode"
    assert p["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    assert d["disaggregation_bootstrap_port"] == 8998  # the argument's default on a decode
    for info in (p, d):
        assert info["dp_size"] == info["attn_dp_size"] == 1
        assert info["enable_dp_attention"] is False
        assert info["max_running_requests"] == 64
        assert info["disaggregation_transfer_backend"] == "mooncake"
        assert info["enable_dynamic_batch_tokenizer"] is False
        assert info["tokenizer_worker_num"] == 1
        assert info["version"] == "0.5.23" and info["frontend"] == "python"
        assert len(info["internal_states"]) == 1
        assert info["simulator"]["name"] == "trio_pd_testing.engine"  # ours, not SGLang's
        assert "waiting_timeout" in info["simulator"] and "faults" in info["simulator"]
    # `auto` resolves per role: the PD prefill follows the bootstrap room, decode round-robins
    assert p["load_balance_method"] == "follow_bootstrap_room"
    assert d["load_balance_method"] == "round_robin"
    assert p["port"] == prefill.port


async def test_dp_attention_resolves_to_attn_dp_size(nursery, client):
    decode = await start_engine(nursery, "decode", dp_size=4, enable_dp_attention=True)
    info = (await client.get(decode.url + "/server_info")).json()
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 4, True)
    assert info["tp_size"] == 4 and len(info["internal_states"]) == 4
    loads = (await client.get(decode.url + "/v1/loads")).json()
    assert len(loads["loads"]) == 4  # the DP width is dp_size x attn_dp_size
    plain = await start_engine(nursery, "decode", dp_size=2)
    info = (await client.get(plain.url + "/server_info")).json()
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (2, 1, False)


async def test_deprecated_aliases_answer_the_same_and_are_logged_per_call(pair, client):
    prefill, _ = pair
    server = (await client.get(prefill.url + "/server_info")).json()
    assert not prefill.events.find("deprecated_endpoint")
    for _ in range(2):
        alias = (await client.get(prefill.url + "/get_server_info")).json()
        assert alias == server
    assert len(prefill.events.find("deprecated_endpoint", path="/get_server_info")) == 2
    model = (await client.get(prefill.url + "/model_info")).json()
    assert (await client.get(prefill.url + "/get_model_info")).json() == model
    assert prefill.events.find("deprecated_endpoint", path="/get_model_info", use="/model_info")
    assert model["served_model_name"] == "sim-model"
    assert model["weight_version"] == "default"
