"""Issue 25's fault matrix on the simulator, in `make test`: the engines are processes of their
own (`python -m trio_pd.testing.engine`), frozen and killed with real signals, in front of a real
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
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx2
import orjson
import trio

from tests.conftest import ROUTER_DEFAULTS, start_router, wait_until_ready
from tests.tcp import unread_from
from trio_pd.config import RouterConfig
from trio_pd.spec import WorkerSpec

PREFILL_CONTEXT = 64  # words: a longer prompt gets the prefill's 400 at once
OVER_CONTEXT = " ".join(["word"] * 200)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        sys.executable, "-m", "trio_pd.testing.engine", "--role", role,
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
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with (
        engine_process(tmp_path, "prefill", "--context-length", str(PREFILL_CONTEXT)) as prefill,
        engine_process(tmp_path, "decode") as decode,
    ):
        config = RouterConfig(prefill=(prefill.spec,), decode=(decode.spec,), **ROUTER_DEFAULTS)
        router, url = await start_router(nursery, config)
        client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(60.0))
        await wait_until_ready(client)
        body = {"text": OVER_CONTEXT, "sampling_params": {"max_new_tokens": 4}}

        # Round 0, the decode running: its abort opens the abort pool's connection.
        assert (await client.post("/generate", json=body)).status_code == 400
        with trio.fail_after(30):
            while not decode.events("abort_request"):
                await trio.sleep(0.01)

        cancelled = decode_legs_cancelled(router)
        decode.signal(signal.SIGSTOP)
        try:
            rids: list[str] = []

            async def doomed() -> None:
                response = await client.post("/generate", json=body)
                assert response.status_code == 400, response.text
                rids.append(response.headers["x-request-id"])

            async with trio.open_nursery() as requests:
                for _ in range(6):
                    requests.start_soon(doomed)
            # Every cancelled decode leg's abort waits unread in the frozen decode's sockets.
            with trio.fail_after(30):
                while True:
                    aborted = decode_legs_cancelled(router) - cancelled
                    if aborted and unread_from(os.getpid(), decode.port) >= aborted:
                        break
                    await trio.sleep(0.005)
        finally:
            decode.signal(signal.SIGCONT)

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
