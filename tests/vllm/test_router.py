"""trio_pd (`trio-pd serve --vllm-pd-disaggregation`) in front of a real vLLM 0.32 pair.

Each test asserts what the engines saw, from their own `/metrics`: the decode's NIXL reads
(`vllm:nixl_xfer_time_seconds_count`), the requests each engine finished
(`vllm:request_success_total` by `finished_reason`), the KV each holds
(`vllm:kv_cache_usage_perc`), and whether a prefill's blocks were freed by the decode's read or
left to the lease (`vllm:nixl_num_kv_expired_reqs_total`).
"""

from __future__ import annotations

import httpx2
import orjson
import pytest
import trio

from tests.vllm import engines as E
from tests.vllm.conftest import ROUTER_FLAGS

XFERS = "vllm:nixl_xfer_time_seconds_count"
FINISHED = "vllm:request_success_total"


@pytest.fixture
def router(pair, start_router):
    return start_router(pair, *ROUTER_FLAGS)


@pytest.fixture
async def client(router):
    async with httpx2.AsyncClient(base_url=router.url, timeout=httpx2.Timeout(120.0)) as c:
        yield c


async def snapshot(engines, pair):
    return await E.metrics(engines, pair.prefill_url), await E.metrics(engines, pair.decode_url)


async def freed_by_reads(engines, pair, mark: int, reads: int) -> None:
    """The decode read `reads` handoffs and both engines hold no KV, the prefill's blocks freed
    by those reads: none left to the lease since `mark` (a lease that expired was read, late:
    `E.expired_leases_were_read`)."""
    await E.wait_kv_free(engines, pair.prefill_url)
    await E.wait_kv_free(engines, pair.decode_url)
    await E.expired_leases_were_read(engines, pair, mark)


async def stream_events(client, path, body):
    events = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_non_stream_prefill_then_decode_reads_the_kv(client, engines, pair, path):
    p0, d0 = await snapshot(engines, pair)
    mark = E.lease_mark(pair)
    body = E.completion() if path == "/v1/completions" else E.chat()
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "kv_transfer_params" not in answer
    assert answer["usage"]["completion_tokens"] == 4
    p1, d1 = await snapshot(engines, pair)
    # What the engines saw: one 1-token prefill, one decode that read its blocks over NIXL.
    assert E.delta(p1, p0, FINISHED) == 1 and E.delta(d1, d0, FINISHED) == 1
    assert E.delta(p1, p0, "vllm:generation_tokens_total") == 1
    assert E.delta(d1, d0, XFERS) >= 1
    await freed_by_reads(engines, pair, mark, 1)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_is_the_decodes_without_kv_params(client, engines, pair, path):
    p0, d0 = await snapshot(engines, pair)
    mark = E.lease_mark(pair)
    body = E.completion(stream=True) if path == "/v1/completions" else E.chat(stream=True)
    events = await stream_events(client, path, body)
    # At least one data event: a busy machine's API server can send a short answer as one
    # chunk (seen on the recording test, 2026-12-05), so no more is asked.
    assert events[-1] == "[DONE]" and len(events) >= 2
    assert all("kv_transfer_params" not in e for e in events[:-1])
    p1, d1 = await snapshot(engines, pair)
    assert E.delta(p1, p0, FINISHED) == 1 and E.delta(d1, d0, XFERS) >= 1
    await freed_by_reads(engines, pair, mark, 1)


async def test_real_prefill_400_is_relayed_and_the_decode_never_called(client, engines, pair):
    p0, d0 = await snapshot(engines, pair)
    r = await client.post("/v1/completions", json=E.completion(E.LONG_PROMPT))
    assert r.status_code == 400, r.text
    assert "max_model_len" in r.text or "maximum context length" in r.text, r.text
    p1, d1 = await snapshot(engines, pair)
    assert E.delta(p1, p0, FINISHED) == 0
    assert E.delta(d1, d0, FINISHED) == 0 and E.delta(d1, d0, "vllm:prompt_tokens_total") == 0


async def test_client_leaving_mid_stream_frees_the_decode(client, engines, pair):
    _, d0 = await snapshot(engines, pair)
    mark = E.lease_mark(pair)
    body = E.completion(max_tokens=1500, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                break  # the first token is out: leave
    # The decode saw the close: the request ends aborted, long before its 1500 tokens.
    d1, _ = await E.wait_for(
        engines,
        pair.decode_url,
        lambda m: m.get("vllm:num_requests_running", 1) == 0,
        60.0,
        "the decode's request ended",
    )
    # It generated, and ended without finishing: vLLM 0.32 counts a request its API server
    # aborted on a disconnect in no `request_success_total` reason (checked: `abort` stayed 0).
    generated = E.delta(d1, d0, "vllm:generation_tokens_total")
    assert 1 <= generated < 1500, generated
    assert E.delta(d1, d0, FINISHED) == 0
    await freed_by_reads(engines, pair, mark, 1)


async def test_n2_is_two_pd_requests(client, engines, pair):
    p0, d0 = await snapshot(engines, pair)
    mark = E.lease_mark(pair)
    r = await client.post("/v1/completions", json=E.completion(n=2))
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    p1, d1 = await snapshot(engines, pair)
    # Two one-sample prefills (never n=2 to the prefill) and two decodes that read them.
    assert E.delta(p1, p0, FINISHED) == 2 and E.delta(d1, d0, FINISHED) == 2
    assert E.delta(d1, d0, XFERS) >= 2
    await freed_by_reads(engines, pair, mark, 2)


async def test_logprobs_and_echo(client, engines, pair):
    mark = E.lease_mark(pair)
    prompt = "the tiny model says"
    r = await client.post("/v1/completions", json=E.completion(prompt, logprobs=2, echo=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(prompt)
    tokens = r.json()["usage"]["prompt_tokens"] + 4
    assert len(choice["logprobs"]["tokens"]) == tokens
    r = await client.post("/v1/chat/completions", json=E.chat(logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"]) == 4
    await freed_by_reads(engines, pair, mark, 2)


async def test_model_list_is_the_prefills_with_its_max_model_len(client, pair):
    """Finding 9: the prefill (512) and decode (2048) disagree on `max_model_len`. With one
    model the router relays the prefill's list (control/fanout.py): 512, the prompt bound a
    client meets first (a longer prompt is the prefill's 400)."""
    r = await client.get("/v1/models")
    assert r.status_code == 200, r.text
    (card,) = [m for m in r.json()["data"] if m["id"] == E.MODEL]
    assert card["max_model_len"] == 512


async def test_engines_hold_nothing_after_a_burst(client, engines, pair):
    """Eight concurrent PD requests: every handoff read, nothing left to the lease."""
    mark = E.lease_mark(pair)

    async def one(i: int) -> None:
        r = await client.post("/v1/completions", json=E.completion(f"burst {i} says"))
        assert r.status_code == 200, r.text

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    await freed_by_reads(engines, pair, mark, 8)
