"""Memory bounded by design (issue 19, item 3): admission before the body is read, the budget of
bytes held (`--max-buffered-bytes`: 429 while full, 413 for what never fits), the JSON structure
priced before any parse, and `stream` only as a boolean (item 9).

Through a real router over real sockets, checking what the engines saw; RSS of a real
`trio-pd serve` process is in tests/ops/test_memory_bounds.py, the figures in bench/memory.py.
"""

from __future__ import annotations

import httpx2
import orjson
import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import generate_body, settle

KB = 1 << 10
MB = 1 << 20


def starts(cluster: Cluster, rid: str) -> int:
    return sum(
        len(e.events.find("request_start", rid=rid)) for e in (*cluster.prefills, *cluster.decodes)
    )


def flat_body(size: int, **extra: object) -> bytes:
    """A /generate body of about `size` bytes, nearly all of it one string."""
    head = orjson.dumps({"sampling_params": {"max_new_tokens": 2}, **extra})[:-1]
    return head + b',"text":"' + b"a" * max(0, size - len(head) - 10) + b'"}'


async def post_raw(
    cluster: Cluster, body: bytes, rid: str, chunked: bool = False
) -> httpx2.Response:
    headers = {"x-request-id": rid, "content-type": "application/json"}
    if not chunked:
        return await cluster.client.post("/generate", content=body, headers=headers)

    async def pieces():  # no Content-Length: the router learns the size as it reads
        for at in range(0, len(body), 64 * KB):
            yield body[at : at + 64 * KB]

    return await cluster.client.post("/generate", content=pieces(), headers=headers)


class RawUpload:
    """A client that sends one large body as fast as the router takes it, counting what the
    kernel accepted: a router that reads the body lets all of it through, one that has not
    started reading stops it after the socket buffers fill."""

    def __init__(self, url: str, body: bytes, rid: str) -> None:
        self.url, self.body, self.rid = url, body, rid
        self.sent = 0
        self.answer = b""
        self.done = trio.Event()

    async def run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            async with trio.open_nursery() as both:
                both.start_soon(self._send, stream)
                await self._read_answer(stream)
                both.cancel_scope.cancel()  # answered: what is left of the body stays unsent
        finally:
            self.done.set()
            await stream.aclose()

    async def _send(self, stream: trio.SocketStream) -> None:
        head = (
            f"POST /generate HTTP/1.1\r\nhost: x\r\nx-request-id: {self.rid}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(self.body)}\r\n\r\n"
        ).encode()
        view = memoryview(self.body)
        try:
            await stream.send_all(head)
            for at in range(0, len(self.body), 64 * KB):
                piece = view[at : at + 64 * KB]
                await stream.send_all(piece)
                self.sent = at + len(piece)
        except trio.BrokenResourceError:
            pass  # refused before the whole body went out: the router closed the connection

    async def _read_answer(self, stream: trio.SocketStream) -> None:
        while b"\r\n\r\n" not in self.answer:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return
            if not data:
                return
            self.answer += data

    @property
    def status(self) -> int:
        return int(self.answer.split(b" ", 2)[1]) if self.answer else 0


async def test_a_request_waiting_for_admission_has_not_read_its_body(
    nursery: trio.Nursery,
) -> None:
    """One slot, taken by a held request: a 48 MB body waiting in line is not read (its client
    stays stuck behind the socket buffers), a third request finds the line full and gets 429
    without its body read at all, and the waiting one is read, and answered, once admitted.
    On 7462f5a the router read every body whole before admission (all 48 MB went through)."""
    cluster = await start_cluster(nursery, max_concurrent_requests=1, queue_size=1)
    holder: dict[str, int] = {}

    async def hold_the_slot() -> None:
        # Held until the test lets it go (`hold`): however slow the machine, the slot stays
        # taken while the line is examined.
        body = generate_body(sim_fault="decode:hold")
        response = await cluster.client.post("/generate", json=body, headers={"x-request-id": "h"})
        holder["status"] = response.status_code

    nursery.start_soon(hold_the_slot)
    await cluster.decode.events.wait_for("request_start", timeout=LOOSE, rid="h")
    waiting = RawUpload(cluster.url, flat_body(48 * MB), "waits")
    nursery.start_soon(waiting.run)
    await settle(lambda: cluster.router.admission.waiting == 1)
    await trio.sleep(1.0)  # time enough to read 48 MB many times over, were it read
    assert not waiting.done.is_set()
    assert waiting.sent < 16 * MB, waiting.sent  # socket buffers and hypercorn's small queue
    assert cluster.router.budget.in_use < 1 * MB  # the holder's small body only

    refused = RawUpload(cluster.url, flat_body(48 * MB), "refused")
    await refused.run()
    assert refused.status == 429  # its body read and dropped first (intake.DISCARD_SECS)
    assert starts(cluster, "refused") == 0
    assert cluster.router.budget.in_use < 1 * MB
    assert not waiting.done.is_set()

    assert "status" not in holder  # the slot was taken throughout
    cluster.decode.state.release_held()
    with trio.fail_after(120):  # a hang guard: 48 MB read and answered (13 s seen under load)
        await waiting.done.wait()
    assert holder["status"] == 200
    assert waiting.sent == len(waiting.body)
    assert waiting.status == 200
    assert starts(cluster, "waits") == 2
    await settle(lambda: cluster.router.budget.in_use == 0)  # everything given back
    await cluster.client.aclose()


async def test_the_budget_refuses_with_429_while_full_and_413_what_never_fits(
    nursery: trio.Nursery,
) -> None:
    """`--max-buffered-bytes` 1 MiB: ten running requests hold 60 KB each (a body is held twice:
    the client's bytes and the legs' copy); a 250 KB body then gets 429 (it would fit alone),
    one of 600 KB 413 at once (its two copies alone exceed the budget), the same sent chunked
    413 while it is read, and 100 KB of `[{},...]` 413 before any parse (its objects would
    take ~7 MB). None reaches a worker; once the ten are done a 100 KB body runs."""
    cluster = await start_cluster(nursery, max_buffered_bytes=1 * MB)
    budget = cluster.router.budget
    statuses: dict[str, int] = {}

    async def holder(i: int) -> None:
        body = flat_body(30 * KB, sim_fault="decode:slow:3000")
        statuses[f"holder-{i}"] = (await post_raw(cluster, body, f"holder-{i}")).status_code

    async with trio.open_nursery() as holders:
        for i in range(10):
            holders.start_soon(holder, i)
        await settle(lambda: budget.in_use >= 10 * 2 * 29 * KB)
        held = budget.in_use

        busy = await post_raw(cluster, flat_body(250 * KB), "busy")
        assert busy.status_code == 429, busy.text
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
        assert "--max-buffered-bytes" in busy.json()["error"]["message"]

        never = await post_raw(cluster, flat_body(600 * KB), "never")
        assert never.status_code == 413, never.text
        assert "--max-buffered-bytes" in never.json()["error"]["message"]
        chunked = await post_raw(cluster, flat_body(600 * KB), "chunked", chunked=True)
        assert chunked.status_code == 429, chunked.text  # it might fit alone, for all it knows

        empties = b'{"text":"x","extra":[' + b"{}," * (33 * KB) + b"{}]}"
        tiny = await post_raw(cluster, empties, "empties")
        assert tiny.status_code == 413, tiny.text
        assert "parsing the body" in tiny.json()["error"]["message"]
        assert budget.in_use < held + 64 * KB  # the refused hold nothing (the ten: their answers)
    assert all(statuses[f"holder-{i}"] == 200 for i in range(10)), statuses
    await settle(lambda: budget.in_use == 0)
    alone = await post_raw(cluster, flat_body(600 * KB), "alone", chunked=True)
    assert alone.status_code == 413, alone.text  # read until its copies pass the whole budget
    for rid in ("busy", "never", "chunked", "empties", "alone"):
        assert starts(cluster, rid) == 0, rid
    fits = await post_raw(cluster, flat_body(100 * KB), "fits")
    assert fits.status_code == 200, fits.text
    assert starts(cluster, "fits") == 2
    assert 0 < budget.peak <= 1 * MB
    await cluster.client.aclose()


@pytest.mark.parametrize(
    ("path", "stream"),
    [
        ("/generate", 1),
        ("/v1/completions", 1),
        ("/v1/chat/completions", "yes"),
        ("/v1/completions", "true"),
        ("/v1/chat/completions", 1.0),
        ("/generate", {}),
    ],
)
async def test_a_stream_flag_that_is_no_boolean_is_refused(
    cluster: Cluster, path: str, stream: object
) -> None:
    """SGLang's OpenAI routes stream for `1`, `"yes"`, `"true"`... (pydantic's lax bool): a
    router taking them for "no stream" would buffer a stream whole, past its timeouts (two such
    clients took 828 MB on 7462f5a). Refused with 400 before any worker."""
    rid = f"stream-{path}-{stream!r}"
    body: dict[str, object] = {"stream": stream, "max_tokens": 2}
    if path == "/generate":
        body["text"] = "hi"
    elif path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = await cluster.client.post(path, json=body, headers={"x-request-id": rid})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "`stream` must be true or false" in error["message"]
    assert starts(cluster, rid) == 0


async def test_a_null_stream_is_no_stream(cluster: Cluster) -> None:
    response = await cluster.client.post(
        "/generate", json={"text": "hi", "stream": None}, headers={"x-request-id": "null"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert starts(cluster, "null") == 2


async def test_a_client_leaving_while_its_large_body_waits_frees_its_place(
    nursery: trio.Nursery,
) -> None:
    """A body larger than what the line reads is not read while it waits; its client leaving
    is then seen once it is admitted (the read fails at once), and nothing reaches a worker."""
    cluster = await start_cluster(nursery, max_concurrent_requests=1, queue_size=2)

    async def hold_the_slot() -> None:
        body = generate_body(sim_fault="decode:hold")
        await cluster.client.post("/generate", json=body, headers={"x-request-id": "h"})

    nursery.start_soon(hold_the_slot)
    await cluster.decode.events.wait_for("request_start", timeout=LOOSE, rid="h")
    leaving = RawUpload(cluster.url, flat_body(8 * MB), "leaves")
    scope = trio.CancelScope()
    nursery.start_soon(_run_in, scope, leaving)
    await settle(lambda: cluster.router.admission.waiting == 1)
    scope.cancel()
    cluster.decode.state.release_held()  # the slot comes free: the leaver is admitted, and seen
    await settle(lambda: cluster.router.admission.waiting == 0, timeout=LOOSE)
    ok = await cluster.client.post("/generate", json=generate_body())
    assert ok.status_code == 200
    assert starts(cluster, "leaves") == 0
    await settle(lambda: cluster.router.budget.in_use == 0)
    await cluster.client.aclose()


async def _run_in(scope: trio.CancelScope, upload: RawUpload) -> None:
    with scope:
        await upload.run()
