"""Router behaviour that depends on engine details the simulator now models as SGLang 0.5.23
does (issue 18, findings 6, 8 and 9).

- OpenAI routes have no top-level `meta_info`: a graceful abort of the prefill shows only as
  `choices[*].finish_reason == "abort"`, which must fail the prefill (502, decode cancelled).
- The latch hazard: an abort landing while the engine tokenizes asynchronously (registered,
  not yet scheduled) is lost and suppresses every later abort of the rid; the router holds
  the first abort of such a leg back, so a non-stream decode waiting for a refused prefill's
  KV cache is freed in about a second, not at the 60 s waiting timeout.
- The worker API answers in SMG 1.13's shape.
"""

from __future__ import annotations

import pytest
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import CANCELLED, generate_body, read_sse

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_openai_finish_reason_abort_of_the_prefill_fails_it(
    nursery: trio.Nursery, stream: bool
) -> None:
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 50.0})
    body = {**CHAT, "max_tokens": 40, "stream": stream, "sim_fault": "prefill:abort@100"}
    async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as response:
        if stream and response.status_code == 200:
            await read_sse(response)
        else:
            await response.aread()
    rid = response.headers["x-request-id"]
    fault = await cluster.prefill.events.wait_for("fault", timeout=LOOSE, rid=rid)
    assert fault["kind"] == "abort"  # provoked: the prefill aborted in-band
    prefill_answer = cluster.prefill.events.find("response_start", rid=rid)[0]
    assert prefill_answer["status"] == 200  # a 200 body: only its choice says "abort"
    assert response.status_code == 502, response.text
    assert "finish_reason abort" in response.json()["error"]["message"]
    ended = await cluster.decode.events.wait_for("request_end", timeout=LOOSE, rid=rid)
    assert ended["ended"] in CANCELLED  # decode cancelled at once, not left to run 2 s
    await cluster.client.aclose()


async def test_the_first_abort_waits_out_the_engines_tokenize_window(
    nursery: trio.Nursery,
) -> None:
    """A decode with the async batch tokenizer (a 300 ms window between registering a rid and
    scheduling it) and a prefill that refuses at once: the decode leg is cancelled while the
    decode still tokenizes. An abort sent then is lost and latches; the router's, held back
    1 s, finds the request scheduled and frees it."""
    cluster = await start_cluster(
        nursery,
        decode={
            "enable_dynamic_batch_tokenizer": True,
            "tokenize_delay_ms": 300.0,
            "disconnect_poll_secs": 4.0,  # SGLang's; a latched abort silences this one too
        },
    )
    worker = cluster.router.fleet.workers("decode")[0]
    assert worker.abort_latch_hazard  # learned from the decode's /server_info
    started = trio.current_time()
    response = await cluster.client.post("/generate", json=generate_body(sim_fault="prefill:400"))
    assert response.status_code == 400
    rid = response.headers["x-request-id"]
    ended = await cluster.decode.events.wait_for("request_end", timeout=LOOSE, rid=rid)
    assert ended["ended"] == "aborted_request"  # freed by the router's abort ...
    assert trio.current_time() - started < 30.0  # ... in about a second, not at 60 s
    latched = cluster.decode.events.find("abort_request", dropped="latched")
    assert not latched


async def test_the_worker_api_in_smgs_shape(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    listed = (await cluster.admin.get("/workers")).json()
    assert listed["total"] == 2
    assert listed["stats"] == {"prefill_count": 1, "decode_count": 1, "regular_count": 0}
    for worker in listed["workers"]:
        assert worker["is_healthy"] is True and worker["status"] == "ready"
    added = await cluster.admin.post(
        "/workers", json={"url": "http://127.0.0.1:9", "worker_type": "decode"}
    )
    assert added.status_code == 202
    body = added.json()
    assert body["status"] == "accepted" and body["worker_id"] == body["id"]
    assert added.headers["location"] == body["location"] == f"/workers/{body['worker_id']}"
    shown = (await cluster.admin.get(body["location"])).json()
    assert shown["is_healthy"] is False and shown["status"] == "pending"
    removed = await cluster.admin.delete(body["location"])
    assert removed.status_code == 202
    assert removed.json()["status"] == "accepted" and removed.json()["worker_id"] == body["id"]
    await cluster.client.aclose()
