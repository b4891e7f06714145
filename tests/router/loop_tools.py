"""The router's event loop and memory measured with engines in processes of their own: the
helpers of tests/router/test_loop_stall.py, test_containment4_loop.py and
test_containment4_memory.py.

`measured(work)` watches the loop while `work` runs: the CPU time of the costliest single task
step (what the tests assert on: `time.thread_time()`, which the OS scheduler of a busy machine
cannot inflate), and beside it, reported only, the wall-clock stall of a task ticking every
millisecond, the longest step and the longest garbage collection. `calibrated()` shows the meter
can fail. `external_engine` runs the simulator (SGLang's or vLLM's) as a process of its own, so
that its parsing of the same large bodies is not measured with the router's; `routed` puts an
in-process router in front of two of them.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import attrs
import httpx2
import orjson
import trio

from tests.conftest import ROUTER_DEFAULTS, start_router, wait_until_ready
from trio_pd.config import RouterConfig
from trio_pd.edge.router import Router
from trio_pd.spec import WorkerSpec
from trio_pd_testing.ports import free_port

CALIBRATION_BURN = 0.5  # CPU seconds the calibration's one step burns
ENGINE_START_SECS = 30.0  # a hang guard: a simulator process answering /health
CLIENT_SECS = 120.0  # the routed client's timeout, a hang guard

Engine = Literal["sglang", "vllm"]


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


async def calibrated() -> Window:
    """The meter can fail: one step burning half a second of CPU on the loop is seen as one."""

    async def block_the_loop() -> None:
        await trio.sleep(0.05)
        started = time.thread_time()
        while time.thread_time() - started < CALIBRATION_BURN:
            pass  # the costly step under test
        await trio.sleep(0.05)

    calibration = await measured(block_the_loop)
    assert calibration.step_cpu >= CALIBRATION_BURN * 0.9, calibration
    return calibration


# -- engines in their own processes ------------------------------------------------------------


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
async def external_engine(
    tmp: Path, role: str, engine: Engine = "sglang"
) -> AsyncIterator[ExternalEngine]:
    """The simulator as a process of its own (`trio_pd_testing.engine`, or its vLLM mode
    `trio_pd_testing.engine.vllm`), healthy; its JSON-lines events in `tmp`."""
    port = free_port()
    events = tmp / f"{engine}-{role}-events.jsonl"
    module = "trio_pd_testing.engine" if engine == "sglang" else "trio_pd_testing.engine.vllm"
    command = [
        sys.executable, "-m", module, "--role", role,
        "--host", "127.0.0.1", "--port", str(port), "--events", str(events),
    ]  # fmt: skip
    bootstrap = None
    if engine == "sglang":
        command += ["--disconnect-poll-secs", "0.5", "--waiting-timeout", "60"]
        command += ["--log-level", "warning"]
        if role == "prefill":
            bootstrap = free_port()
            command += ["--bootstrap-port", str(bootstrap)]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        yield ExternalEngine(url, bootstrap, events)
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def wait_healthy(url: str) -> None:
    async with httpx2.AsyncClient(base_url=url) as probe:
        with trio.fail_after(ENGINE_START_SECS):
            while True:  # polling, start-up only: /health is a route, not an event
                try:
                    if (await probe.get("/health")).status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                await trio.sleep(0.1)


async def routed(
    nursery: trio.Nursery,
    prefill: ExternalEngine,
    decode: ExternalEngine,
    engine: Engine = "sglang",
    **options: Any,
) -> tuple[Router, httpx2.AsyncClient]:
    """An in-process router (ready) in front of the two, with a client of its data port;
    `options` over the suite's defaults and a request timeout of 120 s."""
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port, engine=engine),),
        decode=(WorkerSpec(decode.url, "decode", engine=engine),),
        vllm_pd_disaggregation=engine == "vllm",
        **{**ROUTER_DEFAULTS, "request_timeout_secs": 120.0, **options},
    )
    router, url = await start_router(nursery, config)
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(CLIENT_SECS))
    await wait_until_ready(client)
    return router, client
