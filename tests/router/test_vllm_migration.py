"""Migration on vLLM pairs (issue 29): a completions stream outlives its decode.

Simulator engines in vLLM mode behind the real router on real sockets. The decode serving the
stream dies (the whole engine, as a SIGKILLed vLLM server: `die@Ntok`, fired by its N-th
streamed token) after the client got N tokens; the router resumes the request on a fresh pair
(prefill, then the other decode with that prefill's handoff) with a token-id prompt: the
prompt's ids (the first chunk's `prompt_token_ids`) plus the N ids already sent (each chunk's
`token_ids`, asked by the router with `return_token_ids`). The simulator continues such a prompt
with the uninterrupted run's tokens (`vllm_request.continued`), so the client's answer is
compared with an uninterrupted run of the same request. Chat streams are refused (docs/vllm.md
§10 says why) and counted.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from tests.router.helpers import read_sse, settle
from tests.router.test_vllm_outcomes import blocks as blocks
from tests.router.test_vllm_outcomes import start_vllm_cluster
from trio_pd.config import TimeoutConfig
from trio_pd_testing.engine.vllm import VllmEngineHandle
from trio_pd_testing.engine.vllm_request import output_token_id

MAX = 8
PROMPT = "the quick brown fox jumps over the lazy dog"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def body(path: str, fault: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "sim-model", "max_tokens": MAX, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if path == CHAT:
        out["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        out["prompt"] = PROMPT
    if fault is not None:
        out["sim_fault"] = fault
    return {**out, **extra}


async def stream(cluster, path: str, payload: dict[str, Any], rid: str) -> list[Any]:
    async with cluster.client.stream(
        "POST", path, json=payload, headers={"x-request-id": rid}
    ) as response:
        assert response.status_code == 200
        return await read_sse(response)


def answer(events: list[Any]) -> dict[str, Any]:
    """What a client reads of a stream: text, finish, usage, ids, keys, [DONE]s, errors."""
    data = [e for e in events if e != "[DONE]"]
    choices = [c for e in data for c in e.get("choices") or []]
    return {
        "done": events.count("[DONE]"),
        "errors": [e for e in data if "error" in e],
        "text": "".join(
            c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices
        ),
        "ids": [i for c in choices for i in c.get("token_ids") or []],
        "prompt_ids": [c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids")],
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
        "usage": [e["usage"] for e in data if e.get("usage")],
        "keys": {k for c in choices for k in c},
        "rid": {e["id"] for e in data if "error" not in e},
        "created": {e["created"] for e in data if "error" not in e},
    }


async def migrations(cluster) -> dict[tuple[str, str], float]:
    """The migration counts once the router counted the request (after the client's [DONE])."""
    await settle(lambda: bool(counted(cluster)))
    return counted(cluster)


def counted(cluster) -> dict[tuple[str, str], float]:
    found = {}
    for metric in cluster.router.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "trio_pd_migrations_total":
                found[(sample.labels["reason"], sample.labels["outcome"])] = sample.value
    return found


def dead(cluster) -> list[VllmEngineHandle]:
    return [d for d in cluster.decodes if d.events.find("engine_died")]


def starts(engine: VllmEngineHandle, rid: str) -> list[dict[str, Any]]:
    return [e for e in engine.events.find("request_start") if e["headers"].get("x-request-id")
            and e["headers"]["x-request-id"].endswith(rid)]  # fmt: skip


@pytest.mark.parametrize("asked_ids", [False, True])
@pytest.mark.parametrize("after", [1, 3, MAX - 1])
async def test_a_completions_stream_outlives_its_vllm_decode(
    nursery: trio.Nursery,
    blocks: list[VllmEngineHandle],
    after: int,
    asked_ids: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, n_decode=2, migration_limit=2)
    extra = {"return_token_ids": True} if asked_ids else {}
    want = answer(await stream(cluster, COMPLETIONS, body(COMPLETIONS, **extra), "ref"))
    assert want["done"] == 1 and not want["errors"] and want["finish"] == ["length"]
    events = await stream(
        cluster, COMPLETIONS, body(COMPLETIONS, fault=f"decode:die@{after}tok", **extra), "m"
    )
    [gone] = dead(cluster)  # the provoked thing happened: the decode serving it died
    [alive] = [d for d in cluster.decodes if d is not gone]
    got = answer(events)
    assert got["done"] == 1 and not got["errors"], events
    assert got["text"] == want["text"] and got["finish"] == want["finish"] == ["length"]
    assert got["usage"] == want["usage"]  # one answer: the original prompt, all its tokens
    assert len(got["rid"]) == 1 and len(got["created"]) == 1
    if asked_ids:  # the client's own ask: every id once, the original prompt's ids
        assert got["ids"] == want["ids"] == [output_token_id(i) for i in range(MAX)]
        assert got["prompt_ids"] == want["prompt_ids"] and len(got["prompt_ids"]) == 1
    else:
        assert "token_ids" not in got["keys"] and "prompt_token_ids" not in got["keys"]
    # The resumed attempt ran the whole schedule on a fresh pair: a prefill with the token-id
    # prompt (the prompt's ids plus the `after` ids sent), then the live decode with its handoff.
    [first_prefill, resumed_prefill] = [s for p in cluster.prefills for s in starts(p, "m")]
    prompt_ids = first_prefill["body"]["prompt"]
    assert isinstance(prompt_ids, str)
    sent = [output_token_id(i) for i in range(after)]
    assert resumed_prefill["kv_role"] == "prefill"
    assert resumed_prefill["body"]["prompt"][-after:] == sent
    [resumed] = starts(alive, "m")
    assert resumed["kv_role"] == "decode" and resumed["body"]["max_tokens"] == MAX - after
    assert resumed["body"]["prompt"] == resumed_prefill["body"]["prompt"]
    assert resumed["body"]["return_token_ids"] is True
    assert (await migrations(cluster)) == {("transport", "resumed"): 1.0}
    # vLLM's /detokenize takes no batch: the greedy resume asked none for a seam (SGLang's)
    assert not [r for r in caplog.records if "seam" in r.getMessage()], caplog.text
    # nothing is held: no request runs on any engine, and (the `blocks` fixture) no prefill
    # holds a block for a decode
    for engine in [*cluster.prefills, *cluster.decodes]:
        await settle(lambda e=engine: e.state.running.value == e.config.max_num_seqs)


async def test_a_vllm_chat_stream_is_refused_and_counted(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, n_decode=2, migration_limit=2)
    events = await stream(cluster, CHAT, body(CHAT, fault="decode:die@3tok"), "c")
    assert dead(cluster)
    assert events[-1] == "[DONE]" and "error" in events[-2]  # the clean error event
    assert answer(events[:-2])["text"] == "tok0 tok1 tok2"
    assert (await migrations(cluster)) == {("transport", "refused_chat_stream"): 1.0}


async def test_a_silent_vllm_decode_is_resumed(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """A decode that goes silent mid-stream (`hold@2tok`: it stops after its 2nd token until
    released) is failed by the stream's idle timeout and resumed on the other decode."""
    timeouts = attrs.evolve(TimeoutConfig(), stream_idle_secs=0.5)
    cluster = await start_vllm_cluster(
        nursery, blocks, n_decode=2, migration_limit=2, timeouts=timeouts
    )
    want = answer(await stream(cluster, COMPLETIONS, body(COMPLETIONS), "ref"))
    events = await stream(cluster, COMPLETIONS, body(COMPLETIONS, fault="decode:hold@2tok"), "h")
    [held] = [d for d in cluster.decodes if d.events.find("fault", kind="hold")]
    got = answer(events)
    assert got["done"] == 1 and not got["errors"], events
    assert got["text"] == want["text"] and got["usage"] == want["usage"]
    assert (await migrations(cluster)) == {("timeout", "resumed"): 1.0}
    held.state.release_held()
    for engine in [*cluster.prefills, *cluster.decodes]:
        await settle(lambda e=engine: e.state.running.value == e.config.max_num_seqs)
