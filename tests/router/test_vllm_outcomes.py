"""vLLM pairs through a real router: the outcome table of docs/vllm.md §4, row by row.

Each test runs simulator engines in vLLM mode (`testing/trio_pd_testing/engine/vllm.py`) behind an
in-process router, and checks what the engines saw (the prefill's and decode's bodies, the
handoff read or freed, connections closed) besides what the client got. The `blocks` fixture
holds every test to the containment guarantee: once the test is over, no prefill holds a KV
block for a decode (read, refused, freed by the closed connection, or expired under a short
lease: nothing leaks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx2
import orjson
import pytest
import trio

from tests.conftest import ROUTER_DEFAULTS, start_router, wait_until_ready
from tests.router.helpers import read_sse, settle
from trio_pd.config import RetryConfig, RouterConfig
from trio_pd.edge.router import Router
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine.vllm import VllmEngineConfig, VllmEngineHandle, serve_vllm_engine

PROMPT = "the quick brown fox jumps over the lazy dog"
FAST_RETRIES = RetryConfig(max_retries=3, initial_backoff_ms=1, max_backoff_ms=5)


@attrs.define
class VllmCluster:
    prefills: list[VllmEngineHandle]
    decodes: list[VllmEngineHandle]
    router: Router
    client: httpx2.AsyncClient

    @property
    def prefill(self) -> VllmEngineHandle:
        return self.prefills[0]

    @property
    def decode(self) -> VllmEngineHandle:
        return self.decodes[0]

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@pytest.fixture
async def blocks(nursery: trio.Nursery) -> AsyncIterator[list[VllmEngineHandle]]:
    """Engines registered here must hold no KV block once the test ends (leases included)."""
    engines: list[VllmEngineHandle] = []
    yield engines
    for engine in engines:
        lease = engine.config.kv_lease_duration
        await engine.wait_blocks_free(timeout=lease + 5)
        assert engine.held_blocks == 0 and engine.pool.in_use == 0


async def start_vllm_cluster(
    nursery: trio.Nursery,
    blocks: list[VllmEngineHandle],
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    n_prefill: int = 1,
    n_decode: int = 1,
    **router_options: Any,
) -> VllmCluster:
    prefills = [
        await nursery.start(serve_vllm_engine, VllmEngineConfig(**(prefill or {})), "prefill")
        for _ in range(n_prefill)
    ]
    decodes = [
        await nursery.start(serve_vllm_engine, VllmEngineConfig(**(decode or {})), "decode")
        for _ in range(n_decode)
    ]
    blocks.extend(prefills + decodes)
    config = RouterConfig(
        prefill=tuple(WorkerSpec(e.url, "prefill", engine="vllm") for e in prefills),
        decode=tuple(WorkerSpec(e.url, "decode", engine="vllm") for e in decodes),
        vllm_pd_disaggregation=True,
        **{**ROUTER_DEFAULTS, **router_options},
    )
    router, url = await start_router(nursery, config)
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0))
    await wait_until_ready(client)
    return VllmCluster(prefills, decodes, router, client)


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPT}]
    return {"model": "sim-model", "messages": messages, "max_tokens": 4, **extra}


def starts(engine: VllmEngineHandle) -> list[dict[str, Any]]:
    return engine.events.find("request_start")


# ---- both succeed ----------------------------------------------------------------------------


async def test_prefill_first_then_decode_with_its_params_verbatim(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    body = completion(stream_options={"include_usage": True}, min_tokens=3)
    body["stream"] = True
    async with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
    (sent_prefill,) = starts(cluster.prefill)
    (sent_decode,) = starts(cluster.decode)
    assert sent_prefill["kv_role"] == "prefill" and sent_decode["kv_role"] == "decode"
    p = sent_prefill["body"]
    assert p["stream"] is False and "stream_options" not in p  # vLLM's 400 otherwise
    assert p["max_tokens"] == 1 and p["min_tokens"] == 1  # min <= max, no EOS first token
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    # The decode got the client's own body and the handoff the prefill minted, unchanged.
    d = sent_decode["body"]
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == body
    handoff = d["kv_transfer_params"]
    assert handoff["remote_engine_id"] == cluster.prefill.state.engine_id
    read = cluster.prefill.events.find("kv_read", rid=handoff["remote_request_id"])
    assert [r["found"] for r in read] == [True]
    assert cluster.prefill.held_blocks == 0
    assert events[-1] == "[DONE]"
    assert all("kv_transfer_params" not in e for e in events[:-1])  # stripped from the client
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_client_sees_prefills_cached_tokens_not_the_transfer(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    prompt = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 2 whole blocks cached the 2nd time
    answers = []
    for _ in range(2):
        response = await cluster.client.post("/v1/chat/completions", json=chat(
            messages=[{"role": "user", "content": prompt}]))  # fmt: skip
        assert response.status_code == 200
        answers.append(response.json())
    assert all("kv_transfer_params" not in a for a in answers)
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 32]
    # What the decode itself said: the whole transferred prompt as a "hit".
    assert cluster.decode.events.find("request_end", status=200)


async def test_prompt_logprobs_come_from_prefill_and_decode_reads_the_kv(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    for path, body in (("/v1/completions", completion(prompt_logprobs=1)),
                       ("/v1/chat/completions", chat(prompt_logprobs=1))):  # fmt: skip
        response = await cluster.client.post(path, json=body)
        assert response.status_code == 200
        answer = response.json()
        logprobs = answer["prompt_logprobs"] if "messages" in body else answer["choices"][0][
            "prompt_logprobs"]  # fmt: skip
        assert logprobs[0] is None and len(logprobs) == len(PROMPT.split())
    sent = [s["body"] for s in starts(cluster.decode)]
    assert len(sent) == 2 and all("prompt_logprobs" not in b for b in sent)
    assert not cluster.decode.events.find("recomputed")  # it read the blocks
    assert len(cluster.prefill.events.find("kv_read", found=True)) == 2


async def test_echo_with_logprobs_comes_from_prefill_as_one_engine_would_answer(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """vLLM turns echo + logprobs into prompt logprobs, which would make the decode recompute
    the prompt: the router asks the echo of the prefill and merges it into the decode's."""
    cluster = await start_vllm_cluster(nursery, blocks)
    body = completion(echo=True, logprobs=1)
    response = await cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200
    (sent,) = starts(cluster.decode)
    assert "echo" not in sent["body"] and sent["body"]["logprobs"] == 1
    assert not cluster.decode.events.find("recomputed")  # it read the blocks
    # The same request on one engine, no PD: what the client must see, byte for byte.
    async with httpx2.AsyncClient(timeout=10) as direct:
        alone = (await direct.post(cluster.decode.url + "/v1/completions", json=body)).json()
    merged = response.json()["choices"][0]
    assert merged["text"].startswith(PROMPT)
    assert orjson.dumps(merged["logprobs"]) == orjson.dumps(alone["choices"][0]["logprobs"])
    assert merged["text"] == alone["choices"][0]["text"]
    # One engine answers the prompt's logprobs too (echo asks them; issue 27 finding 8).
    assert alone["choices"][0]["prompt_logprobs"]
    assert merged["prompt_logprobs"] == alone["choices"][0]["prompt_logprobs"]


async def test_n_samples_each_run_as_a_pd_request_of_its_own(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    response = await cluster.client.post("/v1/completions", json=completion(n=3))
    assert response.status_code == 200
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
    handoffs = [
        s["body"]["kv_transfer_params"]["remote_request_id"] for s in starts(cluster.decode)
    ]
    assert len(starts(cluster.prefill)) == 3 and len(set(handoffs)) == 3  # one consumer each
    assert all(s["body"].get("n") in (None, 1) for s in starts(cluster.prefill))


async def test_what_vllm_pairs_cannot_take_never_reaches_a_worker(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    generate = await cluster.client.post("/generate", json={"text": PROMPT})
    batch = await cluster.client.post("/v1/completions", json=completion(prompt=["a b", "c d"]))
    assert generate.status_code == 400 and "/generate" in generate.json()["error"]["message"]
    assert batch.status_code == 400 and "one prompt" in batch.json()["error"]["message"]
    assert starts(cluster.prefill) == [] and starts(cluster.decode) == []


# ---- prefill fails ---------------------------------------------------------------------------


async def test_prefill_4xx_is_relayed_byte_for_byte_and_decode_never_called(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    response = await cluster.client.post("/v1/chat/completions", json={"model": "sim-model"})
    assert response.status_code == 400
    expected = {"error": {"message": "`messages` is required", "type": "BadRequestError",
                          "param": "messages", "code": 400}}  # fmt: skip
    assert response.content == orjson.dumps(expected)
    assert len(starts(cluster.prefill)) == 1 and starts(cluster.decode) == []


@pytest.mark.parametrize("fault", ["prefill:status:500", "prefill:close"])
async def test_prefill_5xx_or_transport_is_502_and_decode_never_called(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], fault: str
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    response = await cluster.client.post("/v1/completions", json=completion(sim_fault=fault))
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "upstream_error"
    assert len(starts(cluster.prefill)) == 1 and starts(cluster.decode) == []
    # The prefill's breaker saw a failure; the decode, a bystander, nothing.
    p_worker, d_worker = cluster.router.fleet.workers("prefill")[0], cluster.router.fleet.workers(
        "decode")[0]  # fmt: skip
    assert p_worker.breaker.consecutive_failures == 1
    assert d_worker.breaker.consecutive_failures == 0


async def test_prefill_5xx_is_retried_on_another_prefill_before_anything_went_to_decode(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(
        nursery, blocks, n_prefill=2, retry=FAST_RETRIES,
        policy=attrs.evolve(RouterConfig().policy, policy="round_robin"),
    )  # fmt: skip
    broken, healthy = cluster.prefills
    broken.set_faults(["prefill:status:500"])
    for _ in range(2):  # round robin: one of them starts on the broken prefill
        response = await cluster.client.post("/v1/completions", json=completion())
        assert response.status_code == 200
    assert len(starts(broken)) >= 1 and len(starts(healthy)) == 2
    handoffs = [s["body"]["kv_transfer_params"] for s in starts(cluster.decode)]
    assert len(handoffs) == 2  # the failed attempt sent the decode nothing
    assert {h["remote_engine_id"] for h in handoffs} == {healthy.state.engine_id}


@pytest.mark.parametrize("policy", ["decode-local", "fail"])
async def test_prefill_200_without_params_follows_the_flag_and_is_counted(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], policy: str
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, vllm_missing_kv_params=policy)
    body = completion(sim_fault="prefill:no_params")
    response = await cluster.client.post("/v1/completions", json=body)
    missing = cluster.metric("trio_pd_vllm_kv_params_missing_total", action=policy)
    assert missing == 1
    if policy == "fail":
        assert response.status_code == 502
        assert starts(cluster.decode) == []
        assert cluster.metric("trio_pd_vllm_prompts_recomputed_total", reason="missing_params") == 0
    else:
        assert response.status_code == 200
        (sent,) = starts(cluster.decode)
        assert sent["body"] == body  # the plain request: no handoff
        assert cluster.decode.events.find("recomputed", why="no_params")
        assert cluster.metric("trio_pd_vllm_prompts_recomputed_total", reason="missing_params") == 1


# ---- decode fails ----------------------------------------------------------------------------


async def test_decode_refusal_is_relayed_and_the_prefills_blocks_are_freed(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """min_tokens > max_tokens: the prefill (min clamped) succeeds, the decode refuses it."""
    cluster = await start_vllm_cluster(nursery, blocks, retry=FAST_RETRIES)
    response = await cluster.client.post("/v1/completions", json=completion(min_tokens=9))
    assert response.status_code == 400
    assert "min_tokens must be less than or equal" in response.json()["error"]["message"]
    assert len(starts(cluster.prefill)) == 1 and len(starts(cluster.decode)) == 1  # no retry
    assert cluster.prefill.pool.freed["notified"] == 1  # the refusal notice freed them
    assert cluster.prefill.held_blocks == 0


@pytest.mark.parametrize("fault", ["decode:status:503", "decode:status:500"])
async def test_decode_refused_or_5xx_is_never_retried_with_the_same_params(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], fault: str
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, n_decode=2, retry=FAST_RETRIES)
    cluster.decodes[0].set_faults([fault])
    cluster.decodes[1].set_faults([fault])
    response = await cluster.client.post("/v1/completions", json=completion())
    handoffs = [
        s["body"]["kv_transfer_params"]["remote_request_id"]
        for d in cluster.decodes
        for s in starts(d)
    ]
    assert len(handoffs) >= 2  # it was retried...
    assert len(set(handoffs)) == len(handoffs)  # ...each time with a fresh prefill's handoff
    assert len(starts(cluster.prefill)) == len(handoffs)
    if fault.endswith("503"):  # the decode's refusal, relayed as it came
        assert response.status_code == 503
    else:  # vLLM's generation error once the decode had the handoff
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "kv_transfer_failed"
    assert cluster.prefill.pool.freed["notified"] == len(handoffs)  # each refusal freed its own


@pytest.mark.parametrize("n_decode", [1, 2])
async def test_a_dead_decode_costs_one_prefill_lease_per_decode_tried(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], n_decode: int
) -> None:
    """Finding 1 of issue 27 (measured on the real pair: 5 prefills, each leasing KV blocks for
    30 s, for one request to a dead decode): a decode that failed after its prefill answered is
    retried only on a decode that has not failed the request, so the retries stop once every
    decode has; never again a fresh prefill for the same dead decode."""
    cluster = await start_vllm_cluster(
        nursery, blocks, prefill={"kv_lease_duration": 1.0}, n_decode=n_decode,
        retry=FAST_RETRIES,
    )  # fmt: skip
    for decode in cluster.decodes:
        decode.set_faults(["decode:close"])
    response = await cluster.client.post("/v1/completions", json=completion())
    assert response.status_code == 502
    closed = [f for d in cluster.decodes for f in d.events.find("fault") if f["kind"] == "close"]
    assert len(closed) == n_decode  # each decode was reached once and dropped the request...
    assert len(starts(cluster.prefill)) == n_decode  # ...each after a prefill of its own
    assert FAST_RETRIES.max_retries > n_decode  # the policy allowed more attempts than that
    declined = cluster.metric("trio_pd_retries_declined_total", reason="no_fresh_decode")
    # One decode: this rule stops it; two: the same failure on two decodes is the request's.
    assert declined == (1 if n_decode == 1 else 0)


async def test_decode_kv_read_failure_is_502_kv_transfer_failed(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    # The failed read leaves the prefill's blocks to its lease: a short one here.
    cluster = await start_vllm_cluster(nursery, blocks, prefill={"kv_lease_duration": 1.0})
    for stream in (False, True):
        body = completion(sim_fault="decode:kv_fail", stream=stream)
        response = await cluster.client.post("/v1/completions", json=body)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "kv_transfer_failed"
    assert cluster.metric("trio_pd_vllm_kv_read_failures_total", stream="not_started") == 2
    decode_worker = cluster.router.fleet.workers("decode")[0]
    prefill_worker = cluster.router.fleet.workers("prefill")[0]
    assert decode_worker.breaker.consecutive_failures == 2  # the decode's fault, per §5
    assert prefill_worker.breaker.consecutive_failures == 0
    assert cluster.prefill.held_blocks > 0  # nobody read them: held until the lease ends
    await cluster.prefill.wait_blocks_free(timeout=5)
    assert cluster.prefill.pool.freed["expired"] == 2


async def test_a_stream_failing_after_it_started_ends_with_a_valid_json_error_frame(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks)
    body = completion(sim_fault="decode:stream_error:2", stream=True)
    async with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)  # each one parsed as JSON: valid frames only
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500
    assert [e["choices"][0]["text"] for e in events[:2]] == ["tok0", " tok1"]
    # Counted once the attempt ended, just after the client's stream did.
    await settle(
        lambda: cluster.metric("trio_pd_vllm_kv_read_failures_total", stream="started") == 1
    )
    await settle(
        lambda: cluster.router.fleet.workers("decode")[0].breaker.consecutive_failures == 1
    )


# ---- the client leaves -----------------------------------------------------------------------


async def client_leaves_after(cluster: VllmCluster, body: dict[str, Any], secs: float) -> None:
    with trio.move_on_after(secs):
        await cluster.client.post("/v1/completions", json=body)
        raise AssertionError("the request ended before the client left")


async def test_client_gone_during_prefill_closes_it_at_once_and_frees_its_blocks(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(nursery, blocks, prefill={"prefill_ms_per_token": 500})
    await client_leaves_after(cluster, completion(), 0.5)
    closed = await cluster.prefill.events.wait_for("connection_closed", timeout=5)
    assert closed["kv_role"] == "prefill"
    await cluster.prefill.events.wait_for("blocks_freed", reason="aborted", timeout=5)
    assert starts(cluster.decode) == []


async def test_client_gone_during_decode_closes_it_and_the_handoff_is_freed(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    cluster = await start_vllm_cluster(
        nursery, blocks, decode={"heartbeat_interval": 0.1}, prefill={"kv_lease_duration": 30}
    )
    await client_leaves_after(cluster, completion(sim_fault="decode:hang"), 1.0)
    assert cluster.decode.events.find("heartbeat_sent")  # it held the handoff meanwhile
    await cluster.decode.events.wait_for("connection_closed", timeout=5)
    await cluster.prefill.events.wait_for("kv_notified", found=True, timeout=5)
    await settle(lambda: cluster.prefill.held_blocks == 0)  # freed now, not in 30 s


@pytest.mark.parametrize("fixed", [False, True])
async def test_heartbeats_extend_the_lease_unless_it_is_the_old_fixed_one(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle], fixed: bool
) -> None:
    """A decode that holds the handoff longer than the lease (here it hangs 2 s, the lease is
    1.2 s) keeps it with its heartbeats; the old fixed lease ignores them and expires."""
    cluster = await start_vllm_cluster(
        nursery, blocks,
        prefill={"kv_lease_duration": 1.2, "fixed_lease": fixed},
        decode={"heartbeat_interval": 0.2},
    )  # fmt: skip
    await client_leaves_after(cluster, completion(sim_fault="decode:hang"), 2.0)
    assert len(cluster.prefill.events.find("heartbeat_received")) >= 5
    assert cluster.prefill.pool.freed["expired"] == (1 if fixed else 0)
    await cluster.prefill.events.wait_for("kv_notified", timeout=5)  # the decode's notice
    assert cluster.prefill.pool.freed["notified"] == (0 if fixed else 1)


# ---- tracing and drain -----------------------------------------------------------------------


async def test_a_vllm_attempt_is_traced_like_an_sglang_one(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    from tests.otlp_receiver import otlp_receiver
    from tests.router.test_tracing import complete, ids_seen, one, parent_header

    with otlp_receiver() as receiver:
        cluster = await start_vllm_cluster(
            nursery, blocks, enable_trace=True, otlp_traces_endpoint=receiver.endpoint
        )
        rid = "traced-vllm"
        response = await cluster.client.post(
            "/v1/completions", json=completion(), headers={"x-request-id": rid}
        )
        assert response.status_code == 200
        spans = await receiver.wait_for(complete(rid), f"the spans of {rid}")
        prefill, decode = one(spans, "pd_prefill"), one(spans, "pd_decode")
        assert one(spans, "pd_attempt").attributes == {"attempt": 1, "outcome": "ok"}
        assert ids_seen(cluster.prefill, rid) == [parent_header(prefill)]
        assert ids_seen(cluster.decode, rid) == [parent_header(decode)]
        assert prefill.end_ns <= decode.end_ns  # sequential: prefill's leg ends first
        await cluster.client.aclose()


async def test_a_shutdown_closes_a_vllm_prefill_in_flight(
    nursery: trio.Nursery, blocks: list[VllmEngineHandle]
) -> None:
    """The drain's end cancels what still runs: the prefill's connection closes and its
    blocks are freed, the decode never called."""
    cluster = await start_vllm_cluster(nursery, blocks, prefill={"prefill_ms_per_token": 1000})
    answers: list[httpx2.Response] = []

    async def ask() -> None:
        answers.append(await cluster.client.post("/v1/completions", json=completion()))

    nursery.start_soon(ask)
    await cluster.prefill.events.wait_for("blocks_allocated", timeout=5)
    cluster.router.drain.expire()  # the grace period is over: what still runs is cut
    await cluster.prefill.events.wait_for("connection_closed", timeout=5)
    await cluster.prefill.events.wait_for("blocks_freed", reason="aborted", timeout=5)
    await settle(lambda: len(answers) == 1)
    assert answers[0].status_code == 504  # drain.cut_by_shutdown
    assert starts(cluster.decode) == []
    prefill_worker = cluster.router.fleet.workers("prefill")[0]
    assert prefill_worker.breaker.consecutive_failures == 0  # a shutdown is nobody's fault
