"""A vLLM prefill's `kv_transfer_params` reach a decode only when a decode may act on them
(`pd/vllm_handoff.py`; issue 27 finding 3, issue 26 N10), through a real router over real
sockets against simulator engines in vLLM mode.

A decode engine acts on the handoff: it connects to `remote_host:remote_port` and reads
`remote_block_ids` (vLLM 0.32's decode dies on a handoff without block ids, measured). So a
handoff naming the metadata address, without blocks, or with no port must never reach a decode:
the prefill failed (502, `inband`), the decode's engine saw no request at all.
"""

from __future__ import annotations

import orjson
import pytest
import trio

from tests.router.test_vllm_outcomes import blocks as blocks
from tests.router.test_vllm_outcomes import (
    chat,
    completion,
    start_vllm_cluster,
    starts,
)
from trio_pd.pd.vllm_handoff import shape_problem
from trio_pd_testing.engine.vllm import VllmEngineHandle

# The spoiled handoff's blocks are left to the lease (nobody reads them): a short one.
SHORT_LEASE = {"kv_lease_duration": 1.0}


@pytest.mark.parametrize("how", ["metadata", "no_blocks", "port"])
async def test_a_handoff_no_decode_may_act_on_never_reaches_one(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], how: str
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, prefill=SHORT_LEASE)
    response = await cluster.client.post(
        "/v1/completions", json=completion(sim_fault=f"prefill:bad_handoff:{how}")
    )
    # The provoked thing happened: the prefill answered 200 with the spoiled handoff.
    (answered,) = starts(cluster.prefill)
    assert answered["kv_role"] == "prefill"
    assert cluster.prefill.held_blocks > 0
    # ... and no decode was given it.
    assert response.status_code == 502, response.text
    assert "kv_transfer_params" in response.json()["error"]["message"]
    assert starts(cluster.decode) == []
    if how == "metadata":
        refused = cluster.metric(
            "trio_pd_upstream_connects_refused_total", client="legs", reason="link_local"
        )
        assert refused == 1
    # Nobody read the spoiled handoff: its blocks go with the (short) lease.
    await cluster.prefill.wait_blocks_free(timeout=SHORT_LEASE["kv_lease_duration"] + 10)


async def test_a_good_handoff_still_goes_through(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """The control: the simulator's own handoff (vLLM 0.32's fields) passes."""
    cluster = await start_vllm_cluster(nursery, blocks)
    response = await cluster.client.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    (sent,) = starts(cluster.decode)
    assert sent["body"]["kv_transfer_params"]["remote_host"] == "127.0.0.1"


# What the real vLLM 0.32 prefill answered (tests/vllm, 2026-12-04), and spoiled copies.
REAL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1]],
    "remote_engine_id": "974a4151-8dac-4a19-be25-773fd83b794f",
    "remote_request_id": "cmpl-cmpl-abc123-0-8f6a0cc8",
    "remote_host": "127.0.0.1",
    "remote_port": 39699,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 12,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": []},
        {"remote_block_ids": [[]]},
        {"remote_block_ids": [[-1]]},
        {"remote_block_ids": [["1"]]},
        {"remote_block_ids": [[True]]},
        {"remote_block_ids": None},
        {"do_remote_prefill": False},
        {"remote_engine_id": None},
        {"remote_request_id": 7},
        {"remote_host": ""},
        {"remote_port": 0},
        {"remote_port": 70000},
        {"remote_port": "39699"},
        {"tp_size": 0},
    ],
)
def test_shapes_vllm_would_choke_on(change: dict) -> None:
    assert shape_problem(REAL) is None
    assert shape_problem({**REAL, **change}) is not None


# ---- ids (issue 27 finding 7) ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_answers_id_is_the_routers_request_id_not_double_prefixed(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], path: str, stream: bool
) -> None:
    """vLLM answers `cmpl-<x-request-id>`; the router's ids already start with `cmpl-`
    (`chatcmpl-`), so the client saw `cmpl-cmpl-...` (measured on vLLM 0.32)."""
    cluster = await start_vllm_cluster(nursery, blocks)
    body = completion(stream=stream) if path == "/v1/completions" else chat(stream=stream)
    async with cluster.client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        raw = await response.aread()
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("chatcmpl-" if "chat" in path else "cmpl-")
    if stream:
        ids = {orjson.loads(line[5:])["id"] for line in raw.splitlines()
               if line.startswith(b"data:") and line != b"data: [DONE]"}  # fmt: skip
    else:
        ids = {orjson.loads(raw)["id"]}
    assert ids == {request_id}
    # The engines were given the id without the prefix (what vLLM prefixes again).
    (sent,) = starts(cluster.decode)
    assert request_id.endswith(sent["rid"]) and not sent["rid"].startswith(("cmpl-", "chatcmpl-"))


# ---- cached_tokens (issue 27 finding 6) ------------------------------------------------------


async def test_the_decodes_cached_tokens_are_kept_when_only_it_has_prompt_tokens_details(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """vLLM 0.32's decode reports the prefill's cached tokens (the handoff's
    `remote_prefill_cached_tokens`): with `--enable-prompt-tokens-details` on the decode only,
    the router deleted that correct figure."""
    cluster = await start_vllm_cluster(nursery, blocks, prefill={"prompt_tokens_details": False})
    prompt = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 2 whole blocks of 16
    first = await cluster.client.post("/v1/completions", json=completion(prompt=prompt))
    again = await cluster.client.post("/v1/completions", json=completion(prompt=prompt))
    assert first.status_code == again.status_code == 200
    # The provoked thing: the prefill's second answer hit its cache and said nothing of it.
    (_, handoff) = [s["body"]["kv_transfer_params"] for s in starts(cluster.decode)]
    assert handoff["remote_prefill_cached_tokens"] == 32
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
