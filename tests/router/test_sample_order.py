"""`n > 1`: sample i's answer is the client's choice (or list entry, or stream index) i (issue
28's survivor: with the simulator's samples all alike, a merge in any order passed).

The samples are made to differ: the request's `"sim_tag": true` has the simulator start each
generated text with the engine rid it was sent (docs/engine-simulator.md). Which rid is sample
i's is read off the router itself: the test wraps the sample dispatch to note each sample's
index in its task's context, and the rid maker to record the rid made there. The client's
answer must then put sample i's text, and only its, at i."""

from __future__ import annotations

import contextvars
from typing import Any

import orjson
import pytest

from tests.conftest import Cluster
from tests.router.helpers import read_sse
from trio_pd.pd import dispatch as dispatch_module
from trio_pd.pd.engines import sglang as sglang_engine

SAMPLE: contextvars.ContextVar[int | None] = contextvars.ContextVar("sample", default=None)
N = 3


@pytest.fixture
def sample_of(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """engine rid -> the index of the sample whose attempt it is."""
    rids: dict[str, int] = {}
    dispatch_samples, attempt_rids = dispatch_module.dispatch_samples, sglang_engine.attempt_rids

    async def noted_samples(*args: Any) -> None:
        path, count, stream, responder, cancel, dispatch_one, *rest = args

        async def one(index: int, sub: Any, sub_cancel: Any) -> None:
            SAMPLE.set(index)  # this sample's task (and its attempts) only
            await dispatch_one(index, sub, sub_cancel)

        await dispatch_samples(path, count, stream, responder, cancel, one, *rest)

    def noted_rids(batch: int | None) -> str | list[str]:
        rid = attempt_rids(batch)
        index = SAMPLE.get()
        if index is not None and isinstance(rid, str):
            rids[rid] = index
        return rid

    monkeypatch.setattr(dispatch_module, "dispatch_samples", noted_samples)
    monkeypatch.setattr(sglang_engine, "attempt_rids", noted_rids)
    return rids


def writer(text: str, sample_of: dict[str, int]) -> int:
    """The sample whose engine request wrote `text` (its tag: the rid first)."""
    return sample_of[text.split(" ", 1)[0]]


CHAT = {"messages": [{"role": "user", "content": "three"}], "max_tokens": 3, "sim_tag": True}
COMPLETION = {"prompt": "a b c", "max_tokens": 3, "sim_tag": True}
GENERATE = {"text": "a b c", "sampling_params": {"max_new_tokens": 3, "n": N}, "sim_tag": True}


async def test_each_choice_is_its_samples_answer(cluster: Cluster, sample_of: dict[str, int]):
    """Break: the answers merged in another order (reversed, or as they ended)."""
    response = await cluster.client.post("/v1/chat/completions", json={**CHAT, "n": N})
    assert response.status_code == 200, response.text
    assert sorted(sample_of.values()) == list(range(N))  # provoked: N tagged samples ran
    answer = response.json()
    contents = [c["message"]["content"] for c in answer["choices"]]
    assert [writer(text, sample_of) for text in contents] == list(range(N)), contents
    assert [c["index"] for c in answer["choices"]] == list(range(N))
    assert sample_of[answer["id"]] == 0  # the envelope is sample 0's too

    sample_of.clear()
    response = await cluster.client.post("/v1/completions", json={**COMPLETION, "n": N})
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in response.json()["choices"]]
    assert [writer(text, sample_of) for text in texts] == list(range(N)), texts

    sample_of.clear()
    response = await cluster.client.post("/generate", json=GENERATE)
    assert response.status_code == 200, response.text
    answers = response.json()
    assert [sample_of[a["meta_info"]["id"]] for a in answers] == list(range(N))
    assert [writer(a["text"], sample_of) for a in answers] == list(range(N))


async def test_each_stream_index_carries_its_samples_events(
    cluster: Cluster, sample_of: dict[str, int]
) -> None:
    """Break: a sample's events relayed under another index."""
    body = {**CHAT, "n": N, "stream": True}
    async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
    assert sorted(sample_of.values()) == list(range(N))
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert chunks and all(sample_of[c["id"]] == c["choices"][0]["index"] for c in chunks)
    for index in range(N):
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"][0]["index"] == index
        )
        assert writer(text, sample_of) == index, text

    sample_of.clear()
    async with cluster.client.stream("POST", "/generate", json={**GENERATE, "stream": True}) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert sample_of[event["meta_info"]["id"]] == event["index"], orjson.dumps(event)
        assert writer(event["text"], sample_of) == event["index"]
