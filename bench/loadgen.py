"""Closed-loop load from several processes, each a trio loop of raw keep-alive connections.

Two targets:
- `router`: POST the body to the router, which does the PD dance;
- `direct`: the client does the PD dance itself (fresh bootstrap_room, the same body to prefill
  and decode at once, decode's answer is the result): the same load straight at the engines,
  the baseline from which the router's added latency and CPU are read.

All processes start together at a shared monotonic time T0 (CLOCK_MONOTONIC is system-wide), run a
warm-up, then a measured window; only requests that *finish* inside the window count. Each
process reports its own CPU seconds inside the window, so the load generator's cost is visible.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
import time
from collections.abc import Callable
from typing import Any

import attrs
import orjson
import trio

from bench.harness.procs import HOST
from bench.httpc import Connection, Reply, one_request

MAX_ROOM = 2**63 - 1


@attrs.frozen
class LoadSpec:
    mode: str  # "router" | "direct"
    path: str
    body: dict[str, Any]
    concurrency: int
    duration: float
    warmup: float = 1.0
    router_port: int = 0
    prefill_port: int = 0
    decode_port: int = 0
    bootstrap_port: int | None = None
    host: str = "127.0.0.1"
    itl: bool = False  # keep inter-event gaps of streams
    max_requests: int = 2_000_000  # per process, a hard bound on the loop


def processes_for(concurrency: int) -> int:
    return 1 if concurrency < 8 else 2


def run_load(spec: LoadSpec, processes: int | None = None, meter: Any = None) -> dict[str, Any]:
    """Run the load and merge the processes' results; `meter` (CpuMeter) brackets the window."""
    n = min(processes or processes_for(spec.concurrency), spec.concurrency)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    ready = ctx.Barrier(n + 1)
    start_at = ctx.Value("d", 0.0)
    shares = [spec.concurrency // n + (1 if i < spec.concurrency % n else 0) for i in range(n)]
    procs = [
        ctx.Process(target=_child, args=(spec, share, i, ready, start_at, queue))
        for i, share in enumerate(shares)
        if share > 0
    ]
    for p in procs:
        p.start()
    ready.wait(timeout=60)
    t0 = time.monotonic() + 0.2
    start_at.value = t0
    ready.wait(timeout=60)
    if meter is not None:
        _sleep_until(t0 + spec.warmup)
        meter.start()
        _sleep_until(t0 + spec.warmup + spec.duration)
        meter.stop()
    parts = [queue.get(timeout=spec.warmup + spec.duration + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return merge(parts, spec)


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


async def sleep_until(t: float) -> None:
    """Sleep until a time.monotonic() instant (trio's own clock has an arbitrary offset)."""
    await trio.sleep(max(0.0, t - time.monotonic()))


async def open_loop(
    port: int, path: str, body: Callable[[int], dict[str, Any]], rate: float, seconds: float,
    client_timeout: float, t0: float, extra: Callable[[Any], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Request i (`body(i)`, POSTed to `path`) goes at t0 + i / rate whatever came back before:
    an open loop, so a slow router meets the same arrivals as a fast one. One record a request
    (send and end times from t0, status, error, ok, plus `extra(reply)`)."""
    records: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        reply = await one_request(HOST, port, "POST", path, orjson.dumps(body(i)),
                                  timeout=client_timeout)  # fmt: skip
        record = {"i": i, "t_send": reply.t_start - t0, "t_end": reply.t_end - t0,
                  "status": reply.status, "error": reply.error, "ok": reply.ok}  # fmt: skip
        if extra is not None:
            record.update(extra(reply))
        records.append(record)

    async with trio.open_nursery() as nursery:
        for i in range(int(rate * seconds)):
            await sleep_until(t0 + i / rate)
            nursery.start_soon(one, i)
    return records


def _child(spec: LoadSpec, share: int, index: int, ready: Any, start_at: Any, queue: Any) -> None:
    ready.wait(timeout=60)
    ready.wait(timeout=60)  # the parent has set start_at
    result = trio.run(_child_main, spec, share, start_at.value)
    queue.put(result)


async def _child_main(spec: LoadSpec, share: int, t0: float) -> dict[str, Any]:
    w0 = t0 + spec.warmup
    w1 = w0 + spec.duration
    acc: dict[str, Any] = {
        "lat": [],
        "ttft": [],
        "itl": [],
        "status": {},
        "errors": {},
        "events": 0,
        "done": 0,
        "cpu": 0.0,
        "bytes": 0,
    }
    await sleep_until(t0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cpu_window, acc, w0, w1)
        for _ in range(share):
            nursery.start_soon(_user, spec, acc, w0, w1)
    return acc


async def _cpu_window(acc: dict[str, Any], w0: float, w1: float) -> None:
    await sleep_until(w0)
    c0 = time.process_time()
    await sleep_until(w1)
    acc["cpu"] = time.process_time() - c0


def _record(acc: dict[str, Any], reply: Reply, w0: float, w1: float, itl: bool) -> None:
    if not w0 <= reply.t_end < w1:
        return
    acc["done"] += 1
    key = str(reply.status) if reply.error is None else reply.error
    acc["status"][key] = acc["status"].get(key, 0) + 1
    if reply.stream_error:
        acc["errors"]["stream_error"] = acc["errors"].get("stream_error", 0) + 1
    if not reply.ok:
        return
    acc["lat"].append(reply.latency)
    acc["events"] += reply.events
    acc["bytes"] += len(reply.body)
    if reply.events:
        acc["ttft"].append(reply.t_first_event - reply.t_start)
    if itl and reply.event_times:
        times = reply.event_times
        acc["itl"].extend(b - a for a, b in itertools.pairwise(times))


async def _user(spec: LoadSpec, acc: dict[str, Any], w0: float, w1: float) -> None:
    stream = bool(spec.body.get("stream"))
    deadline = w1 + 30.0  # a request still running 30 s after the window is abandoned
    with trio.move_on_after(deadline - time.monotonic()):
        if spec.mode == "router":
            conn = Connection(spec.host, spec.router_port)
            body = orjson.dumps(spec.body)
            for _ in range(spec.max_requests):
                if time.monotonic() >= w1:
                    break
                reply = await conn.request(
                    "POST", spec.path, body, keep_body=not stream, event_times=spec.itl
                )
                _record(acc, reply, w0, w1, spec.itl)
                if reply.error:
                    await trio.sleep(0.01)  # do not spin on a refusing target
            await conn.aclose()
        else:
            await _direct_user(spec, acc, w0, w1, stream)


async def _direct_user(
    spec: LoadSpec, acc: dict[str, Any], w0: float, w1: float, stream: bool
) -> None:
    pconn = Connection(spec.host, spec.prefill_port)
    dconn = Connection(spec.host, spec.decode_port)
    rng = random.Random()
    for _ in range(spec.max_requests):
        if time.monotonic() >= w1:
            break
        body = dict(spec.body)
        body["bootstrap_host"] = spec.host
        body["bootstrap_port"] = spec.bootstrap_port
        body["bootstrap_room"] = rng.randint(0, MAX_ROOM)
        raw = orjson.dumps(body)
        replies: dict[str, Reply] = {}

        async def leg(name: str, conn: Connection, raw: bytes = raw, r=replies) -> None:
            keep = name == "prefill" or not stream
            r[name] = await conn.request(
                "POST", spec.path, raw, keep_body=keep, event_times=spec.itl and name == "decode"
            )

        t_start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leg, "prefill", pconn)
            nursery.start_soon(leg, "decode", dconn)
        reply = replies["decode"]
        prefill = replies["prefill"]
        reply.t_start = t_start
        if not stream:  # a router answers a non-stream request once both legs are done
            reply.t_end = max(reply.t_end, prefill.t_end)
        if prefill.error or not 200 <= prefill.status < 300:
            reply.error = reply.error or f"prefill_{prefill.error or prefill.status}"
        _record(acc, reply, w0, w1, spec.itl)
        if reply.error:
            await trio.sleep(0.01)
    await pconn.aclose()
    await dconn.aclose()


def merge(parts: list[dict[str, Any]], spec: LoadSpec) -> dict[str, Any]:
    from bench.stats import ms, pct

    lat: list[float] = [x for p in parts for x in p["lat"]]
    ttft: list[float] = [x for p in parts for x in p["ttft"]]
    itl: list[float] = [x for p in parts for x in p["itl"]]
    status: dict[str, int] = {}
    for p in parts:
        for k, v in p["status"].items():
            status[k] = status.get(k, 0) + v
    done = sum(p["done"] for p in parts)
    ok = len(lat)
    events = sum(p["events"] for p in parts)
    return {
        "mode": spec.mode,
        "concurrency": spec.concurrency,
        "duration": spec.duration,
        "requests": done,
        "ok": ok,
        "status": status,
        "rps": round(ok / spec.duration, 2),
        "p50_ms": ms(pct(lat, 50)),
        "p99_ms": ms(pct(lat, 99)),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(itl, 50)),
        "itl_p99_ms": ms(pct(itl, 99)),
        "events": events,
        "events_per_s": round(events / spec.duration, 1),
        "loadgen_cpu_s": round(sum(p["cpu"] for p in parts), 3),
        "loadgen_procs": len(parts),
    }
