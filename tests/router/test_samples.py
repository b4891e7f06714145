"""`n > 1` on PD engines (issue 18, finding 1): each sample is its own PD request, merged.

The real engine refuses a list of n rids (the batch size is 1) and, given one rid and one room,
hangs its decode (docs/protocol.md §2). So every sample goes to the engines as a request of its
own: no `n` in the body, a room and a rid of its own; the client gets one answer with n choices
(or, on `/generate`, the list of n answers), or one stream with every sample's events indexed.
A sample that fails decides the answer and has the others cancelled (their legs closed and
aborted), as a failed prefill cancels its decode."""

from __future__ import annotations

from typing import Any

import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE, build_cluster
from tests.router.helpers import CANCELLED, read_sse

CHAT = {"messages": [{"role": "user", "content": "say three things"}], "max_tokens": 4}


def starts(cluster: Cluster, rid: str, role: str = "decode") -> list[dict[str, Any]]:
    engines = cluster.decodes if role == "decode" else cluster.prefills
    return [e for engine in engines for e in engine.events.find("request_start", rid=rid)]


def assert_one_request_per_sample(cluster: Cluster, rid: str, n: int) -> None:
    for role in ("prefill", "decode"):
        seen = starts(cluster, rid, role)
        assert len(seen) == n, role  # provoked: n requests reached each role
        for start in seen:
            body = start["body"]
            assert "n" not in body and "n" not in body.get("sampling_params", {})
            assert isinstance(body["bootstrap_room"], int)  # a single sequence, not a batch
            assert isinstance(body["rid"], str)
        assert len({s["body"]["bootstrap_room"] for s in seen}) == n
        assert len({s["body"]["rid"] for s in seen}) == n


async def test_chat_n_gets_n_choices(cluster: Cluster) -> None:
    response = await cluster.client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    assert response.status_code == 200, response.text
    rid = response.headers["x-request-id"]
    assert_one_request_per_sample(cluster, rid, 3)
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] for c in answer["choices"])
    usage = answer["usage"]
    one = (await cluster.client.post("/v1/chat/completions", json=CHAT)).json()["usage"]
    assert usage["prompt_tokens"] == one["prompt_tokens"]  # the prompt counted once
    assert usage["completion_tokens"] == 3 * one["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_completions_and_generate_n(cluster: Cluster) -> None:
    response = await cluster.client.post(
        "/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "n": 2}
    )
    assert response.status_code == 200, response.text
    assert_one_request_per_sample(cluster, response.headers["x-request-id"], 2)
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]

    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0}}
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    rid = response.headers["x-request-id"]
    assert_one_request_per_sample(cluster, rid, 2)
    for start in starts(cluster, rid):  # the rest of sampling_params goes through untouched
        assert start["body"]["sampling_params"] == {"max_new_tokens": 3, "temperature": 0}
    answers = response.json()
    assert isinstance(answers, list) and len(answers) == 2  # as SGLang answers n > 1
    assert all(a["text"] for a in answers)


async def test_a_stream_of_n_samples_is_one_stream_indexed_by_sample(cluster: Cluster) -> None:
    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    for index in range(3):
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"][0]["index"] == index
        )
        assert text  # every sample streamed its tokens
    usage = [e for e in events[:-1] if e.get("choices") == [] and e.get("usage")]
    assert len(usage) == 1  # the samples' usage chunks, merged into one at the end
    assert_one_request_per_sample(cluster, response.headers["x-request-id"], 3)

    gen = {"text": "x y", "sampling_params": {"max_new_tokens": 3, "n": 2}, "stream": True}
    async with cluster.client.stream("POST", "/generate", json=gen) as response:
        events = await read_sse(response)
    assert {e["index"] for e in events[:-1]} == {0, 1} and events[-1] == "[DONE]"


async def test_one_failing_sample_decides_and_the_others_are_cancelled(
    nursery: trio.Nursery,
) -> None:
    """Two prefills, one failing every request: the sample that lands on it fails (a 502, as a
    failed prefill), and the sample still running on the healthy pair is cancelled at once, its
    decode slot freed, instead of running on for nothing."""
    cluster = await build_cluster(
        nursery,
        prefills=[{}, {"faults": ("prefill:500@150",)}],
        decodes=[{"inter_token_ms": 100.0}],
        abort_on_cancel=True,
    )
    body = {**CHAT, "max_tokens": 40, "n": 2}
    response = await cluster.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 502, response.text
    assert "prefill" in response.json()["error"]["message"]
    rid = response.headers["x-request-id"]
    failing = cluster.prefills[1].events.find("fault", rid=rid)
    assert failing  # provoked: one sample's prefill failed
    ends = []
    with trio.fail_after(LOOSE):
        while len(ends) < 2:
            ends = cluster.decode.events.find("slot_freed", rid=rid)
            await trio.sleep(0.02)
    assert all(e["reason"] in CANCELLED for e in ends)  # both decodes cut, none finished
    assert not cluster.decode.events.find("request_end", rid=rid, ended=None, status=200)


async def test_n_is_bounded_and_n_with_a_batch_is_refused(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, max_batch_size=4)
    over = await cluster.client.post("/v1/chat/completions", json={**CHAT, "n": 5})
    assert over.status_code == 400 and "--max-batch-size 4" in over.json()["error"]["message"]
    both = await cluster.client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}
    )
    assert both.status_code == 400 and "n > 1" in both.json()["error"]["message"]
    for answer in (over, both):
        assert not starts(cluster, answer.headers["x-request-id"], "prefill")
        assert not starts(cluster, answer.headers["x-request-id"], "decode")
    await cluster.client.aclose()
