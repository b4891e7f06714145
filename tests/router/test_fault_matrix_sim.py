"""Issue 25's fault matrix on the simulator, in `make test`: the engines are processes of their
own (`python -m trio_pd_testing.engine`), frozen and killed with real signals, in front of a real
router over real sockets; what they did is read from their own JSON-lines event logs.

The real pair's rows are tests/sglang/test_fault_matrix.py. The rows here are the ones a signal
to the simulator's process reproduces as the real engine shows them:

- **An abort before the decode registered the rid** (AIBrix #2746, the real row
  `test_abort_before_the_decode_registered`). The decode's process SIGSTOPped (the real one's
  front: uvicorn and its tokenizer manager); the prefill answers 400 (a prompt over its
  context); the router cancels the decode legs, and its aborts wait unread in the decode's
  sockets on the abort pool's open connections while the legs' new connections wait in its
  backlog. SIGCONT: the engine reads the aborts first and drops them (the rid is not
  registered; answered 200), then registers the requests, which wait for a KV that will never
  come. The router's early repeat must free them: the engine's log shows a matched abort with
  the router's last repeat still to come after it.
- **The prefill SIGKILLed** with every shape inside it (the decode holds them all, waiting
  for KV): the clients get errors and the decode lets go; the router asked it to abort each.
- **The decode SIGKILLed** while it waits for KV (the prefill still computing): the prefill
  lets go, asked by the router; and **while it streams**: the clients get a cut stream or an
  error, the prefill holds nothing.
- **An abort inside the KV-transfer window** (`--kv-transfer-ms`): every client resets the
  moment the prefill reports transfers in flight (`prefill_inflight_queue_reqs`, as the real
  row triggers): both engines let go, the prefill fails the transfers, both stay healthy.
- **The prefill SIGSTOPped**, then SIGCONTed, with every shape in flight: every answer equals
  its unfaulted reference, nothing is held after.

Each row asserts what the surviving engine reports in `/v1/loads` (nothing held) and what its
log shows (the router's aborts), after asserting that the fault met the requests where the row
needs them (the engines' own counters).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx2
import orjson
import pytest
import trio

from tests.conftest import ROUTER_DEFAULTS, start_router, wait_until_ready
from tests.router.helpers import read_sse
from tests.sglang.probe import held_of
from tests.tcp import unread_from
from trio_pd.config import RouterConfig
from trio_pd.pd import aborts as aborts_module
from trio_pd.spec import WorkerSpec
from trio_pd_testing.ports import free_port

PREFILL_CONTEXT = 64  # words: a longer prompt gets the prefill's 400 at once
OVER_CONTEXT = " ".join(["word"] * 200)


@attrs.frozen
class EngineProcess:
    role: str
    port: int
    bootstrap_port: int | None
    events_path: Path
    process: trio.Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> WorkerSpec:
        return WorkerSpec(self.url, self.role, self.bootstrap_port)  # type: ignore[arg-type]

    def events(self, event: str | None = None, **fields: Any) -> list[dict[str, Any]]:
        """Its log's records of `event` with these fields, in order."""
        found = []
        for line in self.events_path.read_bytes().splitlines():
            record = orjson.loads(line)
            if (event is None or record["event"] == event) and all(
                record.get(k) == v for k, v in fields.items()
            ):
                found.append(record)
        return found

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)


@asynccontextmanager
async def engine_process(tmp: Path, role: str, *args: str) -> AsyncIterator[EngineProcess]:
    """A simulator engine in its own process, healthy; killed (and resumed first) at the end."""
    port = free_port()
    bootstrap = free_port() if role == "prefill" else None
    events = tmp / f"{role}-events.jsonl"
    events.touch()
    command = [
        sys.executable, "-m", "trio_pd_testing.engine", "--role", role,
        "--host", "127.0.0.1", "--port", str(port), "--events", str(events),
        "--waiting-timeout", "120", "--log-level", "warning", *args,
    ]  # fmt: skip
    if bootstrap is not None:
        command += ["--bootstrap-port", str(bootstrap)]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    engine = EngineProcess(role, port, bootstrap, events, process)
    try:
        async with httpx2.AsyncClient(base_url=engine.url) as probe:
            with trio.fail_after(30):  # a hang guard: the process starts in about a second
                while True:
                    try:
                        if (await probe.get("/health")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await trio.sleep(0.05)
        yield engine
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def decode_legs_cancelled(router: Any) -> float:
    """Decode legs the router cancelled after their request went out: each one it aborts."""
    total = 0.0
    for metric in router.metrics.legs_cancelled.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("role") == "decode":
                total += sample.value
    return total


async def test_an_abort_before_the_decode_registered_is_repeated_early(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every abort must still wait unread when the decode resumes. Each POST gives up after
    # aborts.TIMEOUT_SECS (2 s) and closes its connection; on a busy machine the six prefill
    # 400s spread over more than that, the first aborts were closed before the last went out,
    # and the wait below never saw them all unread at once (CI, 2026-12-05; 3 of 3 under load).
    monkeypatch.setattr(aborts_module, "TIMEOUT_SECS", 600.0)
    async with (
        engine_process(tmp_path, "prefill", "--context-length", str(PREFILL_CONTEXT)) as prefill,
        engine_process(tmp_path, "decode") as decode,
    ):
        config = RouterConfig(prefill=(prefill.spec,), decode=(decode.spec,), **ROUTER_DEFAULTS)
        router, url = await start_router(nursery, config)
        client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(60.0))
        await wait_until_ready(client)
        body = {"text": OVER_CONTEXT, "sampling_params": {"max_new_tokens": 4}}

        # Round 0, the decode running: its aborts open the abort pool's connections, one for
        # each POST at once; they are idle again once its repeats went out.
        async with trio.open_nursery() as requests:
            for _ in range(6):
                requests.start_soon(partial(client.post, "/generate", json=body))
        with trio.fail_after(60):
            while not decode.events("abort_request") or (router.aborts and router.aborts.pending):
                await trio.sleep(0.01)

        rids: list[str] = []

        async def doomed() -> None:
            response = await client.post("/generate", json=body)
            assert response.status_code == 400, response.text
            rids.append(response.headers["x-request-id"])

        # Six doomed requests to the frozen decode, again (at most 5 times) while none of their
        # decode legs went out: each prefill reuses an idle connection, each decode leg opens a
        # new one, and on a busy machine every 400 came back before a decode leg had its
        # connection (nothing sent, nothing to abort: right, but nothing provoked).
        aborted = 0.0
        for _ in range(5):
            cancelled = decode_legs_cancelled(router)  # counted before each answer goes out
            decode.signal(signal.SIGSTOP)
            try:
                async with trio.open_nursery() as requests:
                    for _ in range(6):
                        requests.start_soon(doomed)
                aborted = decode_legs_cancelled(router) - cancelled
                if not aborted:
                    continue
                # Every cancelled decode leg's abort waits unread in the frozen decode's sockets.
                unread = 0
                with trio.move_on_after(30):
                    while unread < aborted:
                        await trio.sleep(0.005)
                        unread = unread_from(os.getpid(), decode.port)
                assert unread >= aborted, f"{aborted:g} aborted decode legs, {unread} aborts unread"
                break
            finally:
                decode.signal(signal.SIGCONT)
        assert aborted, "in 5 tries no decode leg was cancelled after its request went out"

        # The router's last repeats are sent (about 2 s), then the engine's log is read.
        with trio.fail_after(60):
            while router.aborts is not None and router.aborts.pending:
                await trio.sleep(0.05)
        hits = 0
        for rid in rids:
            starts = decode.events("request_start", rid=rid)
            if not starts:
                continue  # the engine read the leg's closed connection and never started it
            aborts = decode.events("abort_request", sglang_rid=starts[0]["sglang_rid"])
            if aborts[0].get("dropped") != "unregistered":
                continue  # its first abort matched: not this row's case
            hits += 1
            matched = [i for i, a in enumerate(aborts) if a.get("matched")]
            assert matched, aborts  # an abort freed it ...
            assert matched[0] < len(aborts) - 1, aborts  # ... before the router's last repeat
            (end,) = decode.events("request_end", rid=rid)
            assert end["t"] < aborts[-1]["t"], (end, aborts)  # released before the last
        assert hits, "no first abort reached the decode before it registered the rid"
        print(f"{hits} of {len(rids)} first aborts reached the decode before the rid")
        await client.aclose()


# ------------------------------------------------------------------------ the kill and freeze rows

ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")
SHAPES = tuple((route, stream) for route in ROUTES for stream in (False, True))


def shaped(route: str, stream: bool, words: int, tokens: int) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    if route == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": tokens}, "stream": stream}
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "stream": stream}  # fmt: skip
    return {"prompt": text, "max_tokens": tokens, "stream": stream}


async def held(client: httpx2.AsyncClient, engine: EngineProcess) -> int:
    """What the engine's `/v1/loads` says it holds: requests in every queue."""
    return held_of((await client.get(engine.url + "/v1/loads")).json())[0]


async def until(predicate: Any, timeout: float = 30.0) -> None:
    """A hang guard around an awaited condition (polled; never a speed bound)."""
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.01)


@asynccontextmanager
async def matrix(
    nursery: trio.Nursery, tmp: Path, prefill_args: tuple[str, ...], decode_args: tuple[str, ...]
) -> AsyncIterator[tuple[EngineProcess, EngineProcess, httpx2.AsyncClient, httpx2.AsyncClient]]:
    """Two engine processes, a router in front (aborts on, no retries): (prefill, decode, the
    router's client, a client for the engines)."""
    async with (
        engine_process(tmp, "prefill", *prefill_args) as prefill,
        engine_process(tmp, "decode", *decode_args) as decode,
        httpx2.AsyncClient(timeout=httpx2.Timeout(60.0)) as engines,
    ):
        config = RouterConfig(prefill=(prefill.spec,), decode=(decode.spec,), **ROUTER_DEFAULTS)
        _, url = await start_router(nursery, config)
        client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(60.0))
        await wait_until_ready(client)
        yield prefill, decode, client, engines
        await client.aclose()


async def answer(client: httpx2.AsyncClient, route: str, stream: bool, body: dict) -> tuple:
    """(status, whether it ended normally, what it carried) of one request."""
    try:
        if not stream:
            response = await client.post(route, json=body)
            if response.status_code != 200:
                return response.status_code, False, None
            data = response.json()
            if route == "/generate":
                return 200, True, (data["text"], data["meta_info"]["prompt_tokens"])
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return 200, True, (text, data["usage"]["prompt_tokens"])
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                return response.status_code, False, None
            events = await read_sse(response)
    except httpx2.HTTPError:
        return 0, False, None
    complete = events[-1:] == ["[DONE]"] and not any(
        isinstance(e, dict) and "error" in e for e in events
    )
    return 200, complete, len(events)


async def test_prefill_killed_with_the_requests_inside(nursery: trio.Nursery, tmp_path: Path):
    async with matrix(nursery, tmp_path, ("--prefill-ms-per-token", "200"), ()) as (
        prefill, decode, client, engines,
    ):  # fmt: skip
        results: list[tuple] = []

        async def one(route: str, stream: bool) -> None:
            results.append(await answer(client, route, stream, shaped(route, stream, 40, 4)))

        async with trio.open_nursery() as requests:
            for route, stream in SHAPES:
                requests.start_soon(one, route, stream)
            # The provoked thing: every one is in the prefill and held by the decode.
            await until(lambda: _at_least(engines, decode, len(SHAPES)))
            prefill.signal(signal.SIGKILL)
        assert all(status != 200 or not complete for status, complete, _ in results), results
        await until(lambda: _nothing(engines, decode))
        # The router asked it to abort every one (a stream's own disconnect may free it first).
        aborted = {a["sglang_rid"] for a in decode.events("abort_request")}
        assert len(aborted) >= len(SHAPES), decode.events("abort_request")


async def test_decode_killed_waiting_for_kv(nursery: trio.Nursery, tmp_path: Path):
    async with matrix(nursery, tmp_path, ("--prefill-ms-per-token", "200"), ()) as (
        prefill, decode, client, engines,
    ):  # fmt: skip
        results: list[tuple] = []

        async def one(route: str, stream: bool) -> None:
            results.append(await answer(client, route, stream, shaped(route, stream, 40, 4)))

        async with trio.open_nursery() as requests:
            for route, stream in SHAPES:
                requests.start_soon(one, route, stream)
            await until(lambda: _at_least(engines, decode, len(SHAPES)))
            await until(lambda: _at_least(engines, prefill, len(SHAPES)))
            decode.signal(signal.SIGKILL)
        assert all(status != 200 or not complete for status, complete, _ in results), results
        await until(lambda: _nothing(engines, prefill))
        aborted = {a["sglang_rid"] for a in prefill.events("abort_request")}
        assert len(aborted) >= len(SHAPES), prefill.events("abort_request")


async def test_decode_killed_mid_stream(nursery: trio.Nursery, tmp_path: Path):
    async with matrix(nursery, tmp_path, (), ("--inter-token-ms", "20")) as (
        prefill, decode, client, engines,
    ):  # fmt: skip
        results: list[tuple] = []
        streams = [route for route, stream in SHAPES if stream]

        async def one(route: str) -> None:
            results.append(await answer(client, route, True, shaped(route, True, 8, 2000)))

        async with trio.open_nursery() as requests:
            for route in streams:
                requests.start_soon(one, route)
            await until(lambda: _decoding(decode, len(streams)))
            decode.signal(signal.SIGKILL)
        assert len(results) == len(streams)
        assert not any(complete for _, complete, _ in results), results  # cut or refused
        await until(lambda: _nothing(engines, prefill))


async def test_prefill_frozen_then_resumed(nursery: trio.Nursery, tmp_path: Path):
    async with matrix(nursery, tmp_path, (), ()) as (prefill, decode, client, engines):
        references = {}
        for shape in SHAPES:
            references[shape] = await answer(client, *shape, shaped(*shape, 12, 8))
        prefill.signal(signal.SIGSTOP)
        results: dict[tuple, tuple] = {}
        try:

            async def one(route: str, stream: bool) -> None:
                body = shaped(route, stream, 12, 8)
                results[route, stream] = await answer(client, route, stream, body)

            async with trio.open_nursery() as requests:
                for route, stream in SHAPES:
                    requests.start_soon(one, route, stream)
                # The provoked thing: the decode holds every one, their prefill frozen.
                await until(lambda: _at_least(engines, decode, len(SHAPES)))
                prefill.signal(signal.SIGCONT)
        finally:
            prefill.signal(signal.SIGCONT)
        assert results == references
        await until(lambda: _nothing(engines, prefill))
        await until(lambda: _nothing(engines, decode))


async def _at_least(engines: httpx2.AsyncClient, engine: EngineProcess, count: int) -> bool:
    return await held(engines, engine) >= count


async def _nothing(engines: httpx2.AsyncClient, engine: EngineProcess) -> bool:
    return await held(engines, engine) == 0


async def _decoding(decode: EngineProcess, count: int) -> bool:
    return len(decode.events("first_token")) >= count


async def test_an_abort_inside_the_kv_transfer_window(nursery: trio.Nursery, tmp_path: Path):
    async with matrix(nursery, tmp_path, ("--kv-transfer-ms", "2000"), ()) as (
        prefill, decode, client, engines,
    ):  # fmt: skip

        async def in_flight() -> bool:
            load = (await engines.get(prefill.url + "/v1/loads")).json()["loads"][0]
            return load["disaggregation"]["prefill_inflight_queue_reqs"] >= len(SHAPES)

        async with trio.open_nursery() as requests:
            for route, stream in SHAPES:
                requests.start_soon(answer, client, route, stream, shaped(route, stream, 20, 4))
            await until(in_flight)  # the provoked thing: every KV is in flight
            requests.cancel_scope.cancel()  # the clients leave; the router aborts both legs
        await until(lambda: _nothing(engines, prefill))
        await until(lambda: _nothing(engines, decode))
        # Every transfer was failed by an abort: the router's, or a stream's own on disconnect.
        ends = [e.get("ended") or "" for e in prefill.events("request_end")]
        assert len(ends) == len(SHAPES) and all(e.startswith("aborted_") for e in ends), ends
        assert not prefill.events("kv_sent")  # no KV reached the decode
        for engine in (prefill, decode):
            assert (await engines.get(engine.url + "/health")).status_code == 200
