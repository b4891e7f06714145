"""Issue 28's vLLM survivors, through a real router against the simulator in vLLM mode: the
prefill's `kv_transfer_params` reach the decode unchanged, the whole handoff (not two of its
fields), and `max_completion_tokens`, which vLLM prefers over `max_tokens`, is 1 on the prefill.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.router import test_vllm_outcomes
from tests.router.test_vllm_outcomes import chat, start_vllm_cluster, starts
from trio_pd_testing.engine.vllm import VllmEngineHandle
from trio_pd_testing.engine.vllm_app import VllmApp

blocks = test_vllm_outcomes.blocks  # the fixture: no engine may hold a block once a test ended

# Fields a newer engine (or another connector) may add, of every JSON kind, and values the
# router has no reason to touch: an opaque handoff goes through as the prefill wrote it.
EXTRA = {
    "remote_blocks_expiry_time": None,  # as vLLM's pull scheduler mints it
    "remote_expiry_hint": 1234.5,
    "connector_extra": {"nested": [1, 2.5, None, True, "ü"], "empty": {}, "list": []},
    "remote_registration_generation": 7,
}


async def test_the_decode_gets_the_prefills_handoff_unchanged(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Break: the decode's `kv_transfer_params` re-shaped on the way (a field dropped, added,
    renamed or re-typed, None values left out...): compared whole, any of them shows."""
    minted: list[dict[str, Any]] = []
    handoff = VllmApp.handoff

    def recorded(self: VllmApp, engine_rid: str, blocks: int) -> dict[str, Any]:
        params = {**handoff(self, engine_rid, blocks), **EXTRA}
        minted.append(params)
        return params

    monkeypatch.setattr(VllmApp, "handoff", recorded)
    cluster = await start_vllm_cluster(nursery, blocks)
    for stream in (False, True):
        body = chat(stream=stream)
        response = await cluster.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    assert len(minted) == 2  # the provoked thing: the prefill minted two handoffs
    sent = [s["body"]["kv_transfer_params"] for s in starts(cluster.decode)]
    assert sent == minted
    assert [r["found"] for r in cluster.prefill.events.find("kv_read")] == [True, True]
    await cluster.client.aclose()


async def test_max_completion_tokens_is_one_on_the_prefill(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """Break: the prefill's `max_completion_tokens` left as the client sent it (only
    `max_tokens` clamped): vLLM reads `max_completion_tokens` first, so the prefill would
    generate the whole answer before handing off. The decode gets the client's value."""
    cluster = await start_vllm_cluster(nursery, blocks)
    body = chat(max_completion_tokens=6, min_completion_tokens=2)
    del body["max_tokens"]
    response = await cluster.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (sent_prefill,) = starts(cluster.prefill)
    (sent_decode,) = starts(cluster.decode)
    p = sent_prefill["body"]
    assert p["max_completion_tokens"] == 1 and p["max_tokens"] == 1
    assert p["min_completion_tokens"] == 1
    d = sent_decode["body"]
    assert d["max_completion_tokens"] == 6 and d["min_completion_tokens"] == 2
    assert response.json()["usage"]["completion_tokens"] == 6
    await cluster.client.aclose()
