"""The router's event loop keeps turning while adversarial requests are in flight.

One router process relays everyone's tokens, so a request that costs seconds of CPU on the event
loop (parsing megabytes of tiny JSON values, building millions of bootstrap rooms for a huge
`n`) would freeze every stream it carries. What decides the test is the CPU time of the longest
single task step on the loop (a trio instrument reading `time.thread_time()` around each step,
garbage collections included): a step that parses 16 MB in one go costs its CPU time whether
the machine is idle or busy, while the wall-clock gap between a ticking task's wakeups also
counts the time the OS scheduler gave the CPU to other processes (on a busy 2-core machine,
279-648 ms stalls were seen while no step cost more than 164 ms). The wall-clock stall is
measured and printed beside it, never asserted (timing belongs in `bench/`). Three windows:

- calibration: a task burns 0.5 s of CPU in one step on the loop; the instrument must see it
  (>= 0.45 s of CPU), or it could not fail;
- baseline: normal requests only;
- adversarial: chat `n` of 2**64-1, 3e6 and 1e8 (refused 400 at once, no worker touched), a
  `/generate` text list of 10**6 items (refused 400), bodies of 1 to 16 MB of tiny JSON values
  (`{"messages": [{}, {}, ...]}`, `{"input_ids": [0, 1, ...]}`, passed on), and deeply nested
  JSON (refused 400), all at once.

The router runs in the test process, as everywhere in the suite, but here the two engines are
separate processes (`python -m trio_pd.testing.engine`): an in-process simulator parsing
the same 16 MB bodies on the same loop would be measured too. Their JSON-lines event logs say
which request reached them.
"""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx2
import orjson
import trio

from tests.conftest import ROUTER_DEFAULTS, start_router, wait_until_ready
from tests.router.helpers import generate_body
from trio_pd.config import RouterConfig
from trio_pd.spec import WorkerSpec

STEP_CPU_BOUND = 0.25  # CPU seconds in one step: "a few milliseconds, not seconds"
CALIBRATION_BURN = 0.5  # CPU seconds the calibration's one step burns
MB = 1 << 20


@attrs.define
class StallMeter:
    """The longest gap between the wakeups of a task that sleeps `period` in a loop."""

    period: float = 0.001
    worst: float = 0.0
    wakeups: int = 0

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await trio.sleep(self.period)
            self.worst = max(self.worst, time.perf_counter() - before - self.period)
            self.wakeups += 1


class LongestStep(trio.abc.Instrument):
    """The single task step on the loop that cost the most CPU time (this thread's
    `time.thread_time()`, which the OS scheduler's choices do not inflate), which task took
    it, and the longest step in wall-clock time (reported only)."""

    def __init__(self) -> None:
        self.worst_cpu = 0.0
        self.task = ""
        self.worst_wall = 0.0
        self._started: tuple[float, float] | None = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = (time.thread_time(), time.perf_counter())

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._started is None:  # the step began before the instrument was added
            return
        cpu, wall = time.thread_time() - self._started[0], time.perf_counter() - self._started[1]
        self.worst_wall = max(self.worst_wall, wall)
        if cpu > self.worst_cpu:
            self.worst_cpu, self.task = cpu, task.name


class LongestCollection:
    """The longest pause of Python's cyclic garbage collector (a stall no task step shows)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.worst = max(self.worst, time.perf_counter() - self._started)


@attrs.frozen
class Window:
    step_cpu: float  # what the test asserts on
    step_task: str
    stall: float  # wall clock, reported only
    step_wall: float  # wall clock, reported only
    gc_pause: float  # wall clock, reported only
    wakeups: int

    def __str__(self) -> str:
        return (
            f"costliest step {self.step_cpu * 1000:.1f} ms of CPU in {self.step_task}; wall "
            f"clock: longest stall {self.stall * 1000:.1f} ms ({self.wakeups} wakeups), longest "
            f"step {self.step_wall * 1000:.1f} ms, longest gc pause {self.gc_pause * 1000:.1f} ms"
        )


async def measured(work: Callable[[], Awaitable[Any]]) -> Window:
    """Run `work` while the stall meter, the step instrument and a gc callback watch the loop.

    The garbage left by earlier tests in this process is collected first: the window measures
    what the router does now, not the test session's heap."""
    meter, steps, collections = StallMeter(), LongestStep(), LongestCollection()
    gc.collect()
    trio.lowlevel.add_instrument(steps)
    gc.callbacks.append(collections)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(meter.run)
            await trio.sleep(0.05)  # the meter is turning before the work starts
            await work()
            nursery.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(collections)
        trio.lowlevel.remove_instrument(steps)
    return Window(
        steps.worst_cpu, steps.task, meter.worst, steps.worst_wall, collections.worst, meter.wakeups
    )


# -- engines in their own processes ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.frozen
class ExternalEngine:
    url: str
    bootstrap_port: int | None
    events: Path

    def started(self, rid: str) -> int:
        """How many `request_start` events the engine logged for `rid` (a cheap scan: a line
        holding a 16 MB body is not parsed)."""
        needle = b'"rid":' + orjson.dumps(rid) + b","
        count = 0
        with self.events.open("rb") as lines:
            for line in lines:
                if line.startswith(b'{"event":"request_start"') and needle in line[:400]:
                    count += 1
        return count


@asynccontextmanager
async def external_engine(tmp: Path, role: str) -> AsyncIterator[ExternalEngine]:
    port = free_port()
    bootstrap = free_port() if role == "prefill" else None
    events = tmp / f"{role}-events.jsonl"
    command = [
        sys.executable, "-m", "trio_pd.testing.engine", "--role", role,
        "--host", "127.0.0.1", "--port", str(port), "--events", str(events),
        "--disconnect-poll-secs", "0.5", "--waiting-timeout", "60", "--log-level", "warning",
    ]  # fmt: skip
    if bootstrap is not None:
        command += ["--bootstrap-port", str(bootstrap)]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx2.AsyncClient(base_url=url) as probe:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await probe.get("/health")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await trio.sleep(0.1)
        yield ExternalEngine(url, bootstrap, events)
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


# -- the adversarial bodies --------------------------------------------------------------------


def tiny_values(key: bytes, item: bytes, size: int) -> bytes:
    count = size // (len(item) + 1)
    return b'{"' + key + b'":[' + b",".join([item] * count) + b"]}"


def counting_ids(size: int) -> bytes:
    """`{"input_ids": [0, 1, ..., 9, 0, 1, ...]}` of about `size` bytes."""
    digits = b",".join(str(i % 10).encode() for i in range(10))
    return b'{"input_ids":[' + b",".join([digits] * (size // 20)) + b"]}"


def chat_n(n: int) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "n": n}, option=0)


@attrs.frozen
class Adversary:
    name: str
    path: str
    body: bytes
    status: int  # what the router must answer


def adversaries() -> list[Adversary]:
    chat, generate = "/v1/chat/completions", "/generate"
    nested = b'{"text":"x","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    text_list = b'{"text":[' + b",".join([b'"a"'] * 1_000_000) + b"]}"
    return [
        Adversary("n-2**64-1", chat, b'{"messages":[{"role":"user","content":"hi"}],'
                  b'"n":18446744073709551615}', 400),
        Adversary("n-3e6", chat, chat_n(3_000_000), 400),
        Adversary("n-1e8", chat, chat_n(10**8), 400),
        Adversary("text-list-1e6", generate, text_list, 400),
        Adversary("nested-1e5", generate, nested, 400),
        Adversary("messages-1MB", chat, tiny_values(b"messages", b"{}", MB), 200),
        Adversary("messages-16MB", chat, tiny_values(b"messages", b"{}", 16 * MB), 200),
        Adversary("input_ids-4MB", generate, counting_ids(4 * MB), 200),
        Adversary("input_ids-16MB", generate, counting_ids(16 * MB), 200),
    ]  # fmt: skip


# -- the test ----------------------------------------------------------------------------------


async def test_event_loop_keeps_turning_under_adversarial_bodies(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with (
        external_engine(tmp_path, "prefill") as prefill,
        external_engine(tmp_path, "decode") as decode,
    ):
        config = RouterConfig(
            prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
            decode=(WorkerSpec(decode.url, "decode"),),
            # No memory budget: all these bodies at once would not fit the default one (some would
            # get 429, which test_memory shows); the loop's turning is what this test measures.
            **{**ROUTER_DEFAULTS, "request_timeout_secs": 120.0, "max_buffered_bytes": 0},
        )
        _, url = await start_router(nursery, config)
        client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(120.0))
        await wait_until_ready(client)

        async def normal_requests() -> None:
            for _ in range(10):
                response = await client.post("/generate", json=generate_body())
                assert response.status_code == 200

        # 1. The instrument can fail: a step burning half a second of CPU is seen as one.
        async def block_the_loop() -> None:
            await trio.sleep(0.05)
            started = time.thread_time()
            while time.thread_time() - started < CALIBRATION_BURN:
                pass  # the costly step under test
            await trio.sleep(0.05)

        calibration = await measured(block_the_loop)
        assert calibration.step_cpu >= CALIBRATION_BURN * 0.9, calibration

        # 2. Baseline: ordinary traffic.
        baseline = await measured(normal_requests)

        # 3. Adversarial bodies, all in flight at once, with ordinary traffic beside them.
        cases = adversaries()
        results: dict[str, tuple[int, float, bytes]] = {}

        async def send(case: Adversary) -> None:
            started = time.perf_counter()
            response = await client.post(
                case.path, content=case.body, headers={"x-request-id": f"stall-{case.name}"}
            )
            results[case.name] = (
                response.status_code,
                time.perf_counter() - started,
                response.content[:200],
            )

        async def adversarial() -> None:
            async with trio.open_nursery() as load:
                for case in cases:
                    load.start_soon(send, case)
                load.start_soon(normal_requests)

        attack = await measured(adversarial)
        print(f"\nloop stall: calibration {calibration}")
        print(f"loop stall: baseline    {baseline}")
        print(f"loop stall: adversarial {attack}")
        for case in cases:
            status, took, _ = results[case.name]
            print(f"  {case.name:16} {len(case.body) / MB:6.2f} MB -> {status} in {took:.2f}s")

        for case in cases:
            status, _, head = results[case.name]
            assert status == case.status, (case.name, status, head)
            rid = f"stall-{case.name}"
            if case.status == 400:
                assert orjson.loads(head)["error"]["type"] == "invalid_request_error"
                assert prefill.started(rid) == 0, case.name  # refused: no worker touched
                assert decode.started(rid) == 0, case.name
            else:
                assert prefill.started(rid) == 1, case.name  # passed on, to both legs
                assert decode.started(rid) == 1, case.name
        assert attack.step_cpu < STEP_CPU_BOUND, attack
        await client.aclose()
