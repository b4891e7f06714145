"""trio_pd in front of a real SGLang pair: what passes with today's router.

Each router is a real `trio-pd serve` subprocess from the router's venv (the CLI as users run
it, real sockets; a sync fixture can start it while the pair is session-scoped). What the
engines saw is read from their own `/v1/loads`.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import httpx2
import pytest
import trio

from tests.sglang import scenarios
from tests.sglang.conftest import ROUTER_FLAGS
from tests.sglang.probe import Probe

# The decode's log when an abort ends a request waiting for its KV (disaggregation/decode.py),
# and when its own disconnect poll aborts a non-stream request (managers/tokenizer_manager.py).
ABORTED_WAITING = "Decode transfer failed for request"
POLL_ABORT = "disconnected from the client side"


@pytest.fixture
async def engines():
    async with scenarios.client() as c:
        yield c


@pytest.fixture
def router(main_pair, start_router):
    return start_router(main_pair, *ROUTER_FLAGS)


@pytest.fixture
async def client(router):
    async with httpx2.AsyncClient(base_url=router.url, timeout=httpx2.Timeout(60.0)) as c:
        yield c


async def _idle_both(engines, main_pair, timeout=10.0):
    for url in (main_pair.prefill_url, main_pair.decode_url):
        await scenarios.wait_idle(engines, url, timeout)


async def test_generate_text_and_input_ids(client, engines, main_pair):
    r = await client.post("/generate", json=scenarios.GEN)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    r = await client.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == 3
    assert len(r.json()["output_ids"]) == 3
    await _idle_both(engines, main_pair)


async def test_generate_stream(client, engines, main_pair):
    events = []
    async with client.stream("POST", "/generate", json={**scenarios.GEN, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    assert events[-1] == "[DONE]" and len(events) >= 2
    await _idle_both(engines, main_pair)


async def test_chat_and_completions(client, engines, main_pair):
    r = await client.post("/v1/chat/completions", json=scenarios.CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and len(r.json()["choices"]) == 1
    r = await client.post("/v1/completions", json={"prompt": "once", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    await _idle_both(engines, main_pair)


async def test_v1_models(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200, r.text
    assert r.json()["data"], r.text


# A doomed request's decode leg may be torn down before the decode engine has read it (its
# server drops a request whose connection closed before the handler read the body): nothing to
# free then, and nothing provoked. Seen once in CI on a busy machine (2026-12-05).
DOOMED_TRIES = 5  # at most, until one reached the decode and waited for its KV
SEEN_SECS = 10.0  # for the decode's log to show the abort of one that did


async def test_real_prefill_400_while_decode_waits(router, client, engines, main_pair):
    """A prompt over the prefill's --context-length: the client gets the prefill's 400 with
    its body byte for byte; the decode (waiting for KV) is freed by the router's abort.

    The provoked thing is read from the decode's own log (a request that waited for its KV
    and was ended by an abort); a try whose decode leg was cut before the engine read it is
    sent again (`DOOMED_TRIES`), and every try must leave the decode idle."""
    body = {"text": "word " * scenarios.LONG_PROMPT_WORDS, "sampling_params": {"max_new_tokens": 4}}
    direct = await engines.post(
        main_pair.prefill_url + "/generate",
        json={
            **body,
            **scenarios.bootstrap(
                scenarios.Target(
                    main_pair.prefill_url, main_pair.decode_url, main_pair.bootstrap_port
                )
            ),
        },
    )
    assert direct.status_code == 400
    log = main_pair.decode.log_text
    polled_before = log().count(POLL_ABORT)
    sent_before = await aborts_sent(engines, router)
    tries = 0
    while tries < DOOMED_TRIES:
        tries += 1
        aborted_before = log().count(ABORTED_WAITING)
        t0 = time.monotonic()
        r = await client.post("/generate", json=body)
        answered = time.monotonic() - t0
        assert r.status_code == 400
        assert r.content == direct.content
        # The decode had registered the request and waited for its KV when an abort ended it
        # (its log says so; too brief for its load snapshot, published every 50 ms, to show it)
        t1 = time.monotonic()
        with trio.move_on_after(SEEN_SECS):
            while log().count(ABORTED_WAITING) == aborted_before:
                await trio.sleep(0.005)
        await scenarios.wait_idle(engines, main_pair.decode_url, timeout=10.0)
        if log().count(ABORTED_WAITING) > aborted_before:
            break
    else:
        raise AssertionError(f"no try of {DOOMED_TRIES} reached the decode before its abort")
    freed = time.monotonic() - t1
    print(
        f"\nprefill 400 through the router (try {tries}): client answered in "
        f"{answered * 1000:.0f} ms, decode idle {freed * 1000:.0f} ms after",
        file=sys.stderr,
    )
    # ... the router's: it sent the decode an abort, and the engine's own disconnect poll (which
    # logs its abort before the scheduler ends the request) never fired. The router counts its
    # abort once the engine's answer to it is read, which can be after the engine logged it.
    with trio.move_on_after(SEEN_SECS):
        while await aborts_sent(engines, router) == sent_before:
            await trio.sleep(0.01)
    assert await aborts_sent(engines, router) > sent_before
    assert log().count(POLL_ABORT) == polled_before, log()[-3000:]


async def aborts_sent(engines, router) -> float:
    metrics = (await engines.get(f"http://127.0.0.1:{router.metrics_port}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("trio_pd_aborts_total{")
        and 'role="decode"' in line
        and 'result="sent"' in line
    )


async def test_client_leaves_mid_request(router, engines, main_pair):
    """The client goes away right after sending (prefill running or decode waiting for KV):
    both engines end up idle."""
    body = {"text": "word " * 300, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    for _ in range(3):
        async with httpx2.AsyncClient(base_url=router.url, timeout=30) as leaving:
            with trio.move_on_after(0.05):
                await leaving.post("/generate", json=body)
        await _idle_both(engines, main_pair, timeout=10.0)


async def test_client_leaves_mid_stream(router, engines, main_pair):
    body = {
        "text": "go",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        "stream": True,
    }
    async with httpx2.AsyncClient(base_url=router.url, timeout=30) as leaving:
        async with leaving.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        # Left after the first event, mid-stream.
        assert (await scenarios.busy_count(engines, main_pair.decode_url)) >= 0
    t0 = time.monotonic()
    await scenarios.wait_idle(engines, main_pair.decode_url, timeout=5.0)
    print(
        f"\nmid-stream leave: decode idle after {(time.monotonic() - t0) * 1000:.0f} ms",
        file=sys.stderr,
    )


BURSTS = 5  # at most, until one shows its hand-offs in the prefill's bootstrap queue


async def test_hand_offs_sit_in_the_prefill_bootstrap_queue(router, client, main_pair):
    """A burst through the router: the prefill's `num_waiting_reqs` counts the requests waiting
    for their decode's handshake (`prefill_bootstrap_queue_reqs`), normal PD operation, which
    the overload veto leaves out (docs/overload.md): it never vetoed the prefill."""
    body = {"text": "word " * 200, "sampling_params": {"max_new_tokens": 8}}
    bootstrap = queued = bursts = 0
    # The hand-offs sit in the queue for milliseconds: a burst that came and went between two
    # polls showed nothing (seen once on a quiet machine), so bursts go on until one shows.
    while bootstrap == 0 and bursts < BURSTS:
        bursts += 1
        probe = Probe({"prefill": main_pair.prefill_url})  # its cancel scope: one run each
        async with trio.open_nursery() as nursery:
            await nursery.start(probe.run)
            t0 = time.monotonic()
            async with trio.open_nursery() as burst:
                for _ in range(16):
                    burst.start_soon(partial(client.post, "/generate", json=body))
            probe.stop()
        samples = [s for s in probe.samples["prefill"] if s.sent >= t0 and s.held is not None]
        bootstrap = max(s.queues.get("prefill_bootstrap_queue_reqs", 0) for s in samples)
        queued = max(s.queues["waiting"] for s in samples)  # num_waiting_reqs, bootstrap in it
    print(
        f"\nburst {bursts} of 16: prefill bootstrap queue up to {bootstrap}, num_waiting_reqs "
        f"up to {queued} ({len(samples)} snapshots)",
        file=sys.stderr,
    )
    assert bootstrap > 0  # the provoked thing: hand-offs showed in the bootstrap queue
    metrics = (await client.get(f"http://127.0.0.1:{router.metrics_port}/metrics")).text
    vetoes = [
        line
        for line in metrics.splitlines()
        if line.startswith("trio_pd_overload_decisions_total{")
        and 'role="prefill"' in line
        and ('outcome="vetoed"' in line or 'outcome="fallback"' in line)
    ]
    assert all(line.endswith(" 0.0") for line in vetoes), vetoes
