"""A body the router reads and then refuses costs nothing once it is answered (issue 26, N1/F3).

On 486b667 every refused body (invalid JSON, a 400 of body inspection, the 413 of a parse past
`--max-buffered-bytes`) stayed in memory after its answer: the answered error's traceback held
the frames that held the body, in a cycle with the handler's frame that only a full collection
frees, and a router process practically never runs one (`serve/process.py` `tune_gc`).

Measured here in the test's own process: the router runs in it (real sockets, its engines in
processes of their own, so what the engines keep is not counted), Python's cyclic collector is
off while requests are sent (so a body only a collection would free counts as kept), and
tracemalloc counts the bytes still allocated once the answers are in. The control is the same
number of bodies of the same size **accepted** (dispatched to the engines and answered 200) in
the same process; the calibration a body the test keeps on purpose, which the meter must see.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx2
import orjson
import trio

from tests.router.helpers import settle
from tests.router.loop_tools import ExternalEngine, external_engine, routed
from trio_pd.edge.router import Router

MB = 1 << 20
BODY = 8 * MB  # each body
COUNT = 4  # bodies per kind: on 486b667 all four stayed (32 MB), here none may
BUDGET = 128 * MB  # --max-buffered-bytes: an 8 MB body fits, its parse into 2M objects does not


def string_body(size: int, **extra: object) -> bytes:
    """A /generate body of about `size` bytes, nearly all of it one string."""
    head = orjson.dumps({"sampling_params": {"max_new_tokens": 1}, **extra})[:-1]
    return head + b',"text":"' + b"a" * max(0, size - len(head) - 10) + b'"}'


def many_objects(size: int) -> bytes:
    """Valid JSON of about `size` bytes whose parse would build ~size/3 objects."""
    return b'{"text":"x","extra":[' + b"{}," * (size // 3 - 10) + b"{}]}"


@attrs.frozen
class Kind:
    name: str
    body: bytes
    status: int
    says: str  # in the error's message


KINDS = [
    Kind("invalid-json", string_body(BODY)[:-2], 400, "not valid JSON"),
    Kind("inspection-400", string_body(BODY, stream="yes"), 400, "`stream` must be"),
    Kind("parse-413", many_objects(BODY), 413, "parsing the body"),
]


@attrs.define
class Held:
    """Bytes still allocated (tracemalloc) after a window, collector off throughout."""

    kept: list[bytes] = attrs.Factory(list)  # the calibration's body, held on purpose

    async def after(self, work: Callable[[], Awaitable[None]], router: Router) -> int:
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            await work()
            await settle(lambda: router.budget.in_use == 0)
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            gc.enable()


@asynccontextmanager
async def router_with_engines(
    nursery: trio.Nursery, tmp: Path
) -> AsyncIterator[tuple[Router, httpx2.AsyncClient, ExternalEngine]]:
    async with (
        external_engine(tmp, "prefill") as prefill,
        external_engine(tmp, "decode") as decode,
    ):
        router, client = await routed(
            nursery, prefill, decode, request_timeout_secs=60.0, max_buffered_bytes=BUDGET
        )
        try:
            yield router, client, decode
        finally:
            await client.aclose()


async def test_a_refused_body_is_freed_when_it_is_answered(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with router_with_engines(nursery, tmp_path) as (router, client, decode):
        meter = Held()

        async def send(body: bytes, rid: str) -> httpx2.Response:
            return await client.post("/generate", content=body, headers={"x-request-id": rid})

        # Calibration: a body kept on purpose is seen.
        async def keep_one() -> None:
            meter.kept.append(bytes(BODY))

        calibration = await meter.after(keep_one, router)
        meter.kept.clear()
        assert calibration >= BODY, calibration

        # Control: the same number of bodies of the same size, accepted and answered 200.
        control_body = string_body(BODY)

        async def accepted() -> None:
            for i in range(COUNT):
                response = await send(control_body, f"accepted-{i}")
                assert response.status_code == 200, response.text[:300]

        control = await meter.after(accepted, router)
        assert decode.started("accepted-0") == 1  # provoked: they did reach the engines

        held: dict[str, int] = {}
        for kind in KINDS:

            async def refused(kind: Kind = kind) -> None:
                for i in range(COUNT):
                    response = await send(kind.body, f"{kind.name}-{i}")
                    assert response.status_code == kind.status, response.text[:300]
                    assert kind.says in response.json()["error"]["message"], response.text[:300]

            held[kind.name] = await meter.after(refused, router)
            assert decode.started(f"{kind.name}-0") == 0  # refused: no engine saw it
        figures = ", ".join(f"{name} {size / MB:.1f} MB" for name, size in held.items())
        print(
            f"\nstill allocated after {COUNT} x {BODY / MB:.0f} MB: calibration "
            f"{calibration / MB:.1f} MB, control (accepted) {control / MB:.1f} MB, {figures}"
        )
        assert control < BODY, control  # the accepted ones are freed (else no control)
        for name, size in held.items():
            assert size < control + MB, (name, size, control)
