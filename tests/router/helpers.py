"""Small helpers for router tests: request bodies, SSE reading, waiting on a condition."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import orjson
import trio

# How an engine logs a request the router cancelled: its abort (`/abort_request`, normally
# first) or its disconnect poll (when the abort came before the engine held the rid).
CANCELLED = frozenset(("aborted_request", "aborted_disconnect"))


def generate_body(
    *, stream: bool = False, max_new_tokens: int = 4, sim_fault: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": "the quick brown fox jumps over the lazy dog",
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "stream": stream,
        **extra,
    }
    if sim_fault is not None:
        body["sim_fault"] = sim_fault
    return body


async def read_sse(response: httpx2.Response) -> list[Any]:
    """Every data payload of an SSE response, JSON-decoded; `[DONE]` stays a string."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def settle(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (loosely bounded) until `condition()` holds; fail the test if it never does."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def leave_when(
    request: Callable[[], Awaitable[Any]], happened: Callable[[], Awaitable[Any]]
) -> trio.CancelScope:
    """A client that leaves once something happened, not after a guessed delay: `request` runs
    until `await happened()` returns (a 60 s hang guard), then its scope is cancelled, as a
    client closing its connection. The scope is returned: `cancelled_caught` says the client
    did leave before its answer ended."""
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await request()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        with trio.fail_after(60):
            await happened()
        scope.cancel()
    return scope


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float, what: str, every: float = 0.02
) -> float:
    """Wait until ``await check()`` holds; how long it took. Fails the test after ``timeout``."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while not await check():
            await trio.sleep(every)
        return trio.current_time() - start
    raise AssertionError(f"not within {timeout} s: {what}")
