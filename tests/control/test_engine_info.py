"""Reading what an engine says about itself (issue 18, findings 2 and 3): SGLang 0.5.23's
`/v1/loads` and `/server_info` in their real shapes (`entrypoints/v1_loads.py`,
`managers/load_snapshot.py`, `runtime_context.num_dp_ranks_of`), and the older engines'
`/get_load` the router falls back to."""

from __future__ import annotations

import orjson
import pytest

from trio_pd.control.engine_info import (
    EngineInfoError,
    LoadReportRejected,
    parse_legacy_load,
    parse_server_info,
    parse_v1_loads,
)


def v1_loads(*ranks: dict) -> bytes:
    return orjson.dumps({
        "timestamp": "2026-12-01T00:00:00+00:00", "version": "0.5.23", "accelerator": None,
        "num_accelerators": 1, "loads": list(ranks),
    })  # fmt: skip


def test_a_pd_decode_tells_kv_waiting_from_queued() -> None:
    load = parse_v1_loads(v1_loads(
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 5, "num_used_tokens": 900,
         "token_usage": 0.4, "max_running_requests": 32,
         "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 2,
                            "decode_transfer_queue_reqs": 2, "decode_retracted_queue_reqs": 0}},
        {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0},
    ))  # fmt: skip
    assert load.endpoint == "/v1/loads"
    assert load.requests == 9 and load.waiting == 5 and load.used_tokens == 900
    first, second = load.ranks
    assert (first.waiting_for_kv, first.queued) == (4, 1)  # 4 wait for KV, 1 for compute
    assert (first.token_usage, first.max_running) == (0.4, 32)
    assert (second.dp_rank, second.requests, second.queued) == (1, 1, 0)
    shown = load.to_json()
    assert shown["num_reqs"] == 9 and len(shown["dp_loads"]) == 2


def test_a_pd_prefill_tells_its_hand_offs_from_queued() -> None:
    """SGLang counts a PD prefill's bootstrap queue (requests waiting for their decode's
    handshake) in `num_waiting_reqs` (`load_inquirer.py`): they are the hand-off, not queued
    for compute; its KV transfers in flight are held beside them."""
    load = parse_v1_loads(v1_loads({
        "dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 5,
        "disaggregation": {"mode": "prefill", "prefill_bootstrap_queue_reqs": 3,
                           "prefill_inflight_queue_reqs": 2},
    }))  # fmt: skip
    (rank,) = load.ranks
    assert (rank.waiting_for_kv, rank.bootstrapping, rank.queued) == (0, 3, 2)
    assert rank.held == 1 + 5 + 2


def test_more_bootstrapping_than_waiting_is_refused() -> None:
    with pytest.raises(LoadReportRejected, match="contradictory"):
        parse_v1_loads(v1_loads({
            "dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 2,
            "disaggregation": {"mode": "prefill", "prefill_bootstrap_queue_reqs": 3},
        }))  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [b"nope", b"{}", b'{"loads": []}', b'{"loads": [1]}',
     b'{"loads": [{"num_running_reqs": "3"}]}', b'{"loads": [{"num_waiting_reqs": true}]}'],
)  # fmt: skip
def test_unreadable_loads_are_refused(body: bytes) -> None:
    with pytest.raises(EngineInfoError):
        parse_v1_loads(body)


def test_the_legacy_get_load_of_older_engines() -> None:
    load = parse_legacy_load(b'[{"num_reqs": 4, "num_waiting_reqs": 1, "dp_rank": 0}]')
    assert load.endpoint == "/get_load" and load.requests == 4 and load.ranks[0].running == 3


def test_dp_width_is_dp_size_times_attn_dp_size() -> None:
    """`--dp-size 4 --enable-dp-attention` resolves to dp_size=1, attn_dp_size=4 in 0.5.23."""
    assert parse_server_info(b'{"dp_size": 1, "attn_dp_size": 4}').dp_width == 4
    assert parse_server_info(b'{"dp_size": 2, "attn_dp_size": 1}').dp_width == 2
    assert parse_server_info(b'{"dp_size": 2}').dp_width == 2  # an older engine
    info = parse_server_info(orjson.dumps({
        "dp_size": 1, "attn_dp_size": 1, "disaggregation_transfer_backend": "mooncake",
        "max_running_requests": 32, "enable_dynamic_batch_tokenizer": True, "version": "0.5.23",
    }))  # fmt: skip
    assert info.transfer_backend == "mooncake" and info.max_running_requests == 32
    assert info.abort_latch_hazard is True and info.version == "0.5.23"
    for bad in (b"[]", b'{"dp_size": 0}', b'{"dp_size": 2048}', b'{"attn_dp_size": "2"}'):
        with pytest.raises(EngineInfoError):
            parse_server_info(bad)


def test_server_info_relayed_to_clients_never_carries_a_workers_secret() -> None:
    """SGLang's /server_info lists its resolved server args, `api_key` and `admin_api_key`
    among them; the router's /get_server_info and /server_info are open without keys."""
    from trio_pd.control.fanout import REDACTED, redacted

    body = orjson.dumps({
        "dp_size": 1, "api_key": "SECRET-1", "admin_api_key": "SECRET-2",
        "hf_token": "SECRET-3", "tokenizer_path": "/models/x",
        "nested": [{"ssl_password": "SECRET-4"}], "api_key_file": None,
    })  # fmt: skip
    shown = orjson.loads(redacted(body))
    assert "SECRET" not in redacted(body).decode()
    assert shown["api_key"] == shown["admin_api_key"] == shown["hf_token"] == REDACTED
    assert shown["nested"][0]["ssl_password"] == REDACTED
    assert shown["tokenizer_path"] == "/models/x" and shown["dp_size"] == 1
    assert shown["api_key_file"] is None
    plain = orjson.dumps({"dp_size": 2})
    assert redacted(plain) is plain  # nothing to hide: the worker's bytes as they came
    assert b"not JSON" in redacted(b"<html>")
