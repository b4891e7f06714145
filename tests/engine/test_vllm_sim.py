"""The simulator's vLLM mode on its own (no router): what docs/vllm.md §2-§3 says vLLM does.

The KV pool is watched through `GET /sim/kv_blocks`, as a test of a router would see a leak."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
import trio

from tests.router.helpers import leave_when, settle
from trio_pd_testing.engine.vllm import VllmEngineConfig, VllmEngineHandle, serve_vllm_engine

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
PROMPT = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 3 blocks of 16


@pytest.fixture
async def client() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=10, trust_env=False) as c:
        yield c


STARTED: list[VllmEngineHandle] = []


@pytest.fixture(autouse=True)
async def no_block_left(nursery: trio.Nursery) -> AsyncIterator[None]:
    """Every engine a test started holds no KV block once it ends (leases included)."""
    STARTED.clear()
    yield
    for started in STARTED:
        await started.wait_blocks_free(timeout=started.config.kv_lease_duration + 5)


async def engine(nursery: trio.Nursery, **options: Any) -> VllmEngineHandle:
    handle = await nursery.start(serve_vllm_engine, VllmEngineConfig(**options))
    STARTED.append(handle)
    return handle


async def prefill(client: httpx2.AsyncClient, p: VllmEngineHandle, **extra: Any) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS, **extra}
    response = await client.post(p.url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def blocks(client: httpx2.AsyncClient, p: VllmEngineHandle) -> dict:
    return (await client.get(p.url + "/sim/kv_blocks")).json()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
         "stream_options"),
        ({"prompt": "x", "max_tokens": 1, "min_tokens": 2}, None),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)  # fmt: skip
async def test_vllms_400s(
    nursery: trio.Nursery, client: httpx2.AsyncClient, body: dict, param: str | None
) -> None:
    p = await engine(nursery)
    response = await client.post(p.url + "/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)


async def test_a_handoff_is_held_until_read_then_freed(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    p, d = await engine(nursery), await engine(nursery)
    answer = await prefill(client, p)
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.state.engine_id
    assert (await blocks(client, p))["held_blocks"] == 3
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    decoded = (await client.post(d.url + "/v1/completions", json=body)).json()
    # vLLM 0.32: the prefill's cached tokens, which the handoff names (checked on the real
    # engine: a 12-token prompt read over NIXL answered cached_tokens 0); before the handoff
    # named them, the decode counted the transfer (40).
    assert params["remote_prefill_cached_tokens"] == 0
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert decoded["kv_transfer_params"] is None
    state = await blocks(client, p)
    assert state["held_blocks"] == 0 and state["freed"]["read"] == 1
    # The same handoff a second time: already freed, the read fails (policy fail: 500).
    again = await client.post(d.url + "/v1/completions", json=body)
    assert again.status_code == 500 and again.json()["error"]["type"] == "InternalServerError"


async def test_an_unread_handoff_expires_with_its_lease(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    p = await engine(nursery, kv_lease_duration=0.5)
    await prefill(client, p)
    assert p.held_blocks == 3
    await p.wait_blocks_free(timeout=3)
    assert p.pool.freed["expired"] == 1


async def test_a_closed_connection_before_the_answer_frees_the_blocks_at_once(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    p = await engine(nursery, prefill_ms_per_token=50)  # 2 s for the prompt
    await leave_when(  # gone once the blocks were allocated, long before the answer
        lambda: prefill(client, p), lambda: p.events.wait_for("blocks_allocated", timeout=30)
    )
    await p.events.wait_for("blocks_freed", reason="aborted", timeout=30)
    assert p.pool.in_use == 0 and p.pool.leases == {}


async def test_a_decode_refusing_or_leaving_notifies_the_prefill(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    p, d = await engine(nursery), await engine(nursery, heartbeat_interval=0.1)
    params = (await prefill(client, p))["kv_transfer_params"]
    body = {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5, "kv_transfer_params": params}
    refused = await client.post(d.url + "/v1/completions", json=body)
    assert refused.status_code == 400
    assert p.pool.freed["notified"] == 1 and p.held_blocks == 0
    params = (await prefill(client, p))["kv_transfer_params"]
    body = {"prompt": PROMPT, "kv_transfer_params": params, "sim_fault": "decode:hang"}
    await leave_when(  # the decode leaves once it has the request (it hangs)
        lambda: client.post(d.url + "/v1/completions", json=body),
        lambda: settle(lambda: len(d.events.find("request_start", kv_role="decode")) == 2, 30),
    )
    await p.events.wait_for("kv_notified", rid=params["remote_request_id"], timeout=30)
    assert p.pool.freed["notified"] == 2 and p.held_blocks == 0
    assert p.events.find("heartbeat_received")  # it heartbeat while it held the handoff


@pytest.mark.parametrize("fixed", [False, True])
async def test_heartbeats_extend_only_the_new_lease(
    nursery: trio.Nursery, client: httpx2.AsyncClient, fixed: bool
) -> None:
    # A lease 20 heartbeats long, held through 30 heartbeats (counted, not timed): a busy
    # machine once stretched one gap past the 6-heartbeat lease this test had.
    p = await engine(nursery, kv_lease_duration=2.0, fixed_lease=fixed)
    d = await engine(nursery, heartbeat_interval=0.1)
    params = (await prefill(client, p))["kv_transfer_params"]
    body = {"prompt": PROMPT, "kv_transfer_params": params, "sim_fault": "decode:hang"}
    await leave_when(  # the decode hangs, heartbeating, past the lease
        lambda: client.post(d.url + "/v1/completions", json=body),
        lambda: settle(lambda: len(p.events.find("heartbeat_received")) >= 30, 60),
    )
    assert p.pool.freed["expired"] == (1 if fixed else 0)
    await p.wait_blocks_free(timeout=3)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_failed_kv_read_follows_the_policy(
    nursery: trio.Nursery, client: httpx2.AsyncClient, policy: str
) -> None:
    p = await engine(nursery, kv_lease_duration=0.5)
    d = await engine(nursery, kv_load_failure_policy=policy)
    params = (await prefill(client, p))["kv_transfer_params"]
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": stream,
                "kv_transfer_params": params, "sim_fault": "decode:kv_fail"}  # fmt: skip
        response = await client.post(d.url + "/v1/completions", json=body)
        if policy == "recompute":
            assert response.status_code == 200 and "error" not in response.text
        elif stream:  # a 200 stream with an error chunk (GenerationError)
            assert response.status_code == 200
            assert '"type":"InternalServerError"' in response.text and "[DONE]" in response.text
        else:
            assert response.status_code == 500
    assert len(d.events.find("recomputed", why="kv_read_failed")) == (
        2 if policy == "recompute" else 0
    )
    await p.wait_blocks_free(timeout=3)  # the unread handoff goes with its lease


async def test_prompt_logprobs_make_the_decode_skip_the_remote_kv(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    p, d = await engine(nursery), await engine(nursery)
    params = (await prefill(client, p, prompt_logprobs=1))["kv_transfer_params"]
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, "kv_transfer_params": params}
    answer = (await client.post(d.url + "/v1/completions", json=body)).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    assert d.events.find("recomputed", why="prompt_logprobs")
    assert p.pool.freed["notified"] == 1 and p.held_blocks == 0  # the empty read
