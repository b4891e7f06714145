"""Hostile workers cannot make the router buffer without bound or answer a 500 (issue 19,
items 4, 9 and 13's last part).

The workers are a few lines of raw trio HTTP (tests/router/hostile.py) behind a real router over
real sockets; each test checks what the client got and that the worker's connection was closed.
"""

from __future__ import annotations

import time

import orjson
import pytest
import trio

from tests.conftest import Cluster, cluster_of
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import settle
from tests.router.hostile import (
    SSE_HEAD,
    HostileWorker,
    Posted,
    Script,
    answer_ok,
    chunk,
    hang,
    json_answer,
    start_hostile,
    until_closed,
)
from trio_pd.config import TimeoutConfig

KB = 1 << 10
MB = 1 << 20


async def hostile_cluster(
    nursery: trio.Nursery, prefill: Script, decode: Script, **router: object
) -> tuple[Cluster, HostileWorker, HostileWorker]:
    p = await start_hostile(nursery, prefill)
    d = await start_hostile(nursery, decode)
    cluster = await cluster_of(nursery, [p], [d], **router)  # type: ignore[list-item]
    return cluster, p, d


def never_ending_event(size: int, piece: int = 64 * KB) -> Script:
    """An SSE stream whose first event never ends: `size` bytes of one `data:` line."""

    async def script(posted: Posted, stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + chunk(b"data: "))
        sent = 0
        while sent < size:
            await stream.send_all(chunk(b"x" * piece))
            sent += piece
        await until_closed(stream)

    return script


def assert_envelope(body: bytes, status: int, response_status: int) -> dict[str, object]:
    assert response_status == status, body[:300]
    error = orjson.loads(body)["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["type"] != "internal_error", error
    return error


async def wait_closed(worker: HostileWorker) -> None:
    with trio.fail_after(LOOSE):
        await worker.posts[-1].closed.wait()


# -- item 4: an SSE event has a bound, and finding its end is linear ---------------------------


async def test_a_first_event_that_never_ends_fails_decode_at_the_bound(
    nursery: trio.Nursery,
) -> None:
    """Decode's first event grows past --max-sse-event-bytes (16 MiB by default): decode failed,
    502 with the envelope, decode's connection closed. On 7462f5a the router buffered it,
    re-copying and re-scanning the whole buffer per read, until the first-token timeout (504)."""
    cluster, _, decode = await hostile_cluster(
        nursery,
        answer_ok,
        never_ending_event(24 * MB),
        timeouts=TimeoutConfig(first_token_secs=20.0),
    )
    cpu_before = time.thread_time()  # the router runs on this thread: its CPU, not the clock's
    async with cluster.client.stream(
        "POST", "/generate", json={"text": "hi", "stream": True}
    ) as response:
        body = await response.aread()
    error = assert_envelope(body, 502, response.status_code)
    assert "SSE event larger than 16777216" in str(error["message"])  # not the 20 s first token
    assert time.thread_time() - cpu_before < 10.0  # no re-scan of the whole buffer per read
    await wait_closed(decode)
    await settle(lambda: cluster.router.budget.in_use == 0)
    assert cluster.router.budget.peak <= 16 * MB + 256 * KB  # the partial event, charged


async def test_the_event_bound_is_a_flag(nursery: trio.Nursery) -> None:
    cluster, _, decode = await hostile_cluster(
        nursery, answer_ok, never_ending_event(4 * MB), max_sse_event_bytes=1 * MB
    )
    response = await cluster.client.post("/generate", json={"text": "hi", "stream": True})
    error = assert_envelope(response.content, 502, response.status_code)
    assert "SSE event larger than 1048576" in str(error["message"])
    await wait_closed(decode)


async def test_a_prefill_event_that_never_ends_fails_prefill(nursery: trio.Nursery) -> None:
    """Prefill's SSE is read to its end by the router: a never-ending event fails prefill at the
    bound, and decode (still waiting for its KV cache) is closed at once."""
    cluster, prefill, decode = await hostile_cluster(
        nursery, never_ending_event(4 * MB), hang, max_sse_event_bytes=1 * MB
    )
    response = await cluster.client.post("/generate", json={"text": "hi", "stream": True})
    error = assert_envelope(response.content, 502, response.status_code)
    assert "prefill worker failed" in str(error["message"])
    await wait_closed(prefill)
    await wait_closed(decode)


# -- item 9: answers are bounded --------------------------------------------------------------


async def test_a_stream_sent_to_a_request_for_none_is_refused_unread(
    nursery: trio.Nursery,
) -> None:
    """A decode answering SSE to a non-stream request: the router would have to buffer a stream
    whole (no stream timeout applies to a request for none). A 502 at once, decode closed. On
    7462f5a it was buffered until the request deadline or 256 MiB."""

    async def endless_stream(posted: Posted, stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD)
        with trio.move_on_after(60):
            while True:
                await stream.send_all(chunk(b'data: {"text":"' + b"x" * 60_000 + b'"}\n\n'))
                await trio.sleep(0.05)
        await until_closed(stream)

    cluster, _, decode = await hostile_cluster(nursery, answer_ok, endless_stream)
    started = time.monotonic()
    response = await cluster.client.post("/generate", json={"text": "hi", "stream": False})
    error = assert_envelope(response.content, 502, response.status_code)
    assert "stream" in str(error["message"])
    assert time.monotonic() - started < 30.0  # at once: long before the worker's 60 s stream ends
    await wait_closed(decode)


def slow_answer(size: int, pause: float) -> Script:
    """A whole JSON answer of `size` bytes: half of it, a pause, the rest."""

    async def script(posted: Posted, stream: trio.SocketStream) -> None:
        text = b"x" * (size - 40)
        body = b'{"text":"' + text + b'","meta_info":{"id":"d"}}'
        answer = json_answer(body)
        half = len(answer) // 2
        await stream.send_all(answer[:half])
        await trio.sleep(pause)
        await stream.send_all(answer[half:])

    return script


async def test_whole_answers_are_held_within_the_budget(nursery: trio.Nursery) -> None:
    """`--max-buffered-bytes` 8 MiB, answers of 6 MiB each arriving in two halves: two at once
    cannot both be held: one (at least) gets 503 with Retry-After, no breaker failure (the
    worker did its part), the other its answer; alone one fits. An answer larger than the whole
    budget is the worker's 502. The budget never held more than its limit."""
    cluster, _, _ = await hostile_cluster(
        nursery, answer_ok, slow_answer(6 * MB, 0.5), max_buffered_bytes=8 * MB
    )
    statuses: list[int] = []
    bodies: list[bytes] = []

    async def one() -> None:
        response = await cluster.client.post("/generate", json={"text": "hi"})
        statuses.append(response.status_code)
        bodies.append(response.content)

    async with trio.open_nursery() as two:
        two.start_soon(one)
        two.start_soon(one)
    assert sorted(statuses)[-1] in (200, 503) and 503 in statuses, statuses
    for status, body in zip(statuses, bodies, strict=True):
        if status == 503:
            error = assert_envelope(body, 503, status)
            assert "--max-buffered-bytes" in str(error["message"])
        else:
            assert len(body) > 6 * MB - 64
    budget = cluster.router.budget
    assert budget.peak <= 8 * MB
    alone = await cluster.client.post("/generate", json={"text": "hi"})
    assert alone.status_code == 200
    assert len(alone.content) > 6 * MB - 64
    worker = cluster.router.fleet.workers("decode")[0]
    assert worker.breaker.total_failures == 0

    big, _, big_decode = await hostile_cluster(
        nursery, answer_ok, slow_answer(12 * MB, 0.0), max_buffered_bytes=8 * MB
    )
    response = await big.client.post("/generate", json={"text": "hi"})
    error = assert_envelope(response.content, 502, response.status_code)
    assert "more than --max-buffered-bytes" in str(error["message"])
    await wait_closed(big_decode)
    await cluster.client.aclose()
    await big.client.aclose()


# -- item 13: a deeply nested answer is the worker's fault, never a 500 ------------------------


def deep_list(depth: int, inner: bytes) -> bytes:
    return b"[" * depth + inner + b"]" * depth


def deep_dict(depth: int, inner: bytes) -> bytes:
    return b'{"a":' * depth + inner + b"}" * depth


PREFILL_LOGPROBS = json_answer(
    b'{"text":"","meta_info":{"id":"p","input_token_logprobs":[[-1.0,1,null]]}}'
)


async def answer_prefill_logprobs(posted: Posted, stream: trio.SocketStream) -> None:
    await stream.send_all(PREFILL_LOGPROBS)


def answers(body: bytes, sse: bool = False) -> Script:
    async def script(posted: Posted, stream: trio.SocketStream) -> None:
        if sse:
            await stream.send_all(SSE_HEAD + chunk(b"data: " + body + b"\n\n") + b"0\r\n\r\n")
        else:
            await stream.send_all(json_answer(body))

    return script


@pytest.mark.parametrize(
    ("case", "decode_body", "stream", "logprobs"),
    [
        ("990-deep lists with an error", deep_list(990, b'{"error":"x"}'), False, False),
        ("990-deep lists with an error, streamed", deep_list(990, b'{"error":"x"}'), True, False),
        (
            "300-deep answer to merge logprobs into",
            b'{"meta_info":{"input_token_logprobs":[]},"x":' + deep_dict(300, b"1") + b"}",
            False,
            True,
        ),
        (
            "300-deep first event to merge logprobs into",
            b'{"meta_info":{"input_token_logprobs":[]},"x":' + deep_dict(300, b"1") + b"}",
            True,
            True,
        ),
    ],
)
async def test_a_deeply_nested_answer_is_a_502_not_a_500(
    nursery: trio.Nursery, case: str, decode_body: bytes, stream: bool, logprobs: bool
) -> None:
    """On 7462f5a: a 500 (recursion in the in-band error walk, or orjson refusing to re-encode
    past 255 levels after the logprob merge)."""
    cluster, _, _ = await hostile_cluster(
        nursery, answer_prefill_logprobs, answers(decode_body, sse=stream)
    )
    body = {"text": "hi", "stream": stream, "return_logprob": logprobs}
    response = await cluster.client.post("/generate", json=body)
    error = assert_envelope(response.content, 502, response.status_code)
    assert "decode worker failed" in str(error["message"]), case
    assert cluster.router.metrics.internal_errors._value.get() == 0
