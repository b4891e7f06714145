"""Logprob merge (docs/protocol.md §6): prefill's input logprobs go in front of decode's."""

from __future__ import annotations

from tests.conftest import Cluster
from tests.router.helpers import generate_body, read_sse

PROMPT_WORDS = 9  # generate_body's text has nine words: the simulator counts one token each


async def test_non_stream_merge_keeps_json_content_type(cluster: Cluster) -> None:
    body = generate_body(max_new_tokens=3, return_logprob=True, top_logprobs_num=2)
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    meta = response.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == PROMPT_WORDS
    assert len(meta["input_top_logprobs"]) == PROMPT_WORDS
    assert len(meta["output_token_logprobs"]) == 3


async def test_stream_merge_into_first_event_when_prefill_answers_sse(cluster: Cluster) -> None:
    body = generate_body(stream=True, max_new_tokens=3, return_logprob=True)
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(response)
        rid = response.headers["x-request-id"]
    assert cluster.prefill.events.find("request_start", rid=rid)[0]["stream"] is True
    first = events[0]
    assert len(first["meta_info"]["input_token_logprobs"]) == PROMPT_WORDS
    assert events[-1] == "[DONE]"


async def test_batch_merge_item_by_item(cluster: Cluster) -> None:
    body = {
        "text": ["one two three", "four five"],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
    }
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 200
    answers = response.json()
    assert [len(a["meta_info"]["input_token_logprobs"]) for a in answers] == [3, 2]


async def test_no_merge_without_logprobs(cluster: Cluster) -> None:
    response = await cluster.client.post("/generate", json=generate_body(max_new_tokens=2))
    assert "input_token_logprobs" not in response.json()["meta_info"]
