"""Scenario `router-bound`: the router's own cost, with engines that answer instantly.

Load shape (printed with every run): wrk (C, one thread, keep-alive, closed loop) POSTs a small
non-streaming `/generate` (bench/wrk/generate.lua) to a router whose prefill and decode engines
are `bench/instant_engine.py` (uvloop + httptools, answer at once): the router is the only busy
program. This is not the `overhead` scenario's shape: there, the engines are trio_pd's simulator
(hypercorn, event logs), the client is the Python load generator, and "direct" is the client
doing the PD dance itself. Here "direct" is wrk straight at the instant decode engine.

One target at a time, alternating the order every repetition (forward, then reversed: ABBA for
any two targets), each with fresh engines and a fresh router:

1. non-stream phase: a wrk warm-up, then wrk at concurrency 1, 32 and 256. Inside each wrk run a
   window (after a lead-in) measures the measured process tree's CPU (psutil, user+sys, children
   included) and the requests the decode engine (or the floor app) completed: CPU per request.
   Latency p50/p99 are wrk's, over its whole run.
2. paced phase: 128 concurrent streams (a uvloop + httptools client in its own process), each
   64 SSE events, one decode step every 20 ms (every running stream gets one event per step, as a
   batched decode engine does); CPU per event the client received inside the window.

Targets: `floor` (bench/floor.py: a bare ASGI app on hypercorn's trio worker, served like
trio_pd: the same wrk levels, its own timers for the paced streams), `direct` (wrk at the
instant decode engine; the engine's own CPU; no paced phase), and the routers (trio_pd,
trio_pd_w2, smg, mini_lb). For `--workers 2` the per-process CPU split (busiest / idlest worker
process) is reported too.

Then: a table of medians, the issue's targets with ratios and PASS/MISS, and a capacity table
(Markdown) computed from the measured CPU. One JSON under bench/results/.

    .venv/bin/python -m bench.router_bound [--quick] [--routers trio_pd,smg,...] [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httptools
import orjson
import psutil

from bench import common, stats
from bench.common import HOST, print_flush
from bench.floor import read_counters

NAME = "router-bound"
LOAD_SHAPE = (
    "router-bound: wrk (1 thread, keep-alive, closed loop) POSTing a small non-stream /generate, "
    "and 128 paced SSE streams (64 events, one 20 ms decode step per event) from a uvloop "
    "client, through the router to instant uvloop+httptools engines (bench/instant_engine.py); "
    "'direct' = wrk straight at the instant decode engine. Not the `overhead` shape (simulator "
    "engines, Python load generator, client-side PD dance)."
)
LEVELS = (1, 32, 256)
STREAM_BODY = {
    "text": "Tell me a long story",
    "sampling_params": {"max_new_tokens": 64},
    "stream": True,
}
WRK_SCRIPT = common.BENCH / "wrk" / "generate.lua"
LABELS = {
    "trio_pd": "trio_pd",
    "trio_pd_w2": "trio_pd --workers 2",
    "trio_pd_noabort": "trio_pd --no-abort-on-cancel",
    "smg": "SMG",
    "mini_lb": "mini_lb",
    "floor": "floor (bare ASGI app, hypercorn trio worker)",
    "direct": "direct (instant engine alone)",
}


@attrs.frozen
class Settings:
    lead: float  # seconds of each wrk run before the CPU window opens
    window: float  # the CPU window
    warmup: float  # the wrk warm-up run at the start of each target (c=256)
    paced_warmup: float  # streams run this long before the paced window opens
    paced_window: float
    streams: int = 128
    events: int = 64
    interval_ms: float = 20.0

    @property
    def wrk_seconds(self) -> int:  # wrk takes whole seconds; the window ends before wrk does
        return math.ceil(self.lead + self.window + 0.3)


def settings(quick: bool) -> Settings:
    cycle = 64 * 0.020  # one stream's life: the window spans whole cycles
    if quick:
        return Settings(lead=0.5, window=2.0, warmup=1.0, paced_warmup=1.5, paced_window=2 * cycle)
    return Settings(lead=1.0, window=5.0, warmup=2.0, paced_warmup=2.0, paced_window=6 * cycle)


# ---- machine ------------------------------------------------------------------------------------
def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def peak_rss_mb(pid: int) -> float | None:
    """Sum over the process tree of each process's peak RSS (VmHWM) so far."""
    total = 0
    for proc in common.tree_procs(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return round(total / 2**20, 1) if total else None


def worker_pids(pid: int) -> list[int]:
    """The processes of a router that serve requests: the root, or its spawned workers."""
    workers = []
    for proc in common.tree_procs(pid)[1:]:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline())
            if "resource_tracker" not in cmdline and "semaphore_tracker" not in cmdline:
                workers.append(proc.pid)
    return workers or [pid]


# ---- the measured targets ---------------------------------------------------------------------
@attrs.define
class Target:
    name: str
    port: int  # where the load goes
    root: int  # the measured process tree
    stats_port: int  # who counts completed requests (/stats)
    stream_path: str
    engines: list[int] = attrs.Factory(list)
    router: common.Proc | None = None
    stats_file: Path | None = None  # the floor's counters (a loaded floor answers /stats late)

    def workers(self) -> list[int]:
        return worker_pids(self.root) if self.name == "trio_pd_w2" else [self.root]


def start_instant(role: str, logdir: Path, s: Settings) -> common.Engine:
    port = common.free_port()
    argv = [sys.executable, "-m", "bench.instant_engine", "--role", role, "--host", HOST,
            "--port", str(port), "--events", str(s.events),
            "--interval-ms", str(s.interval_ms)]  # fmt: skip
    bootstrap = None
    if role == "prefill":
        bootstrap = common.free_port()
        argv += ["--bootstrap-port", str(bootstrap)]
    proc = common.Proc(f"instant-{role}", argv, logdir)
    try:
        common.wait_until(lambda: common.http_get(port, "/health") == 200, 20, role, proc)
    except BaseException:
        proc.stop()
        raise
    return common.Engine(role, port, proc, logdir / f"{role}.none", bootstrap)


@contextlib.contextmanager
def started(name: str, s: Settings) -> Iterator[Target]:
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-rb-"))
    procs: list[common.Proc] = []
    try:
        if name == "floor":
            port = common.free_port()
            stats = logdir / "floor.stats"
            argv = [sys.executable, "-m", "bench.floor", "--host", HOST, "--port", str(port),
                    "--events", str(s.events), "--interval-ms", str(s.interval_ms),
                    "--stats-file", str(stats)]  # fmt: skip
            proc = common.Proc("floor", argv, logdir)
            procs.append(proc)
            common.wait_until(lambda: common.http_get(port, "/health") == 200, 20, "floor", proc)
            yield Target(name, port, proc.pid, port, "/stream", stats_file=stats)
            return
        decode = start_instant("decode", logdir, s)
        procs.append(decode.proc)
        if name == "direct":
            yield Target(name, decode.port, decode.proc.pid, decode.port, "/generate")
            return
        prefill = start_instant("prefill", logdir, s)
        procs.append(prefill.proc)
        cluster = common.Cluster(logdir, prefill, decode, keep_logs=True)
        try:
            common.start_router(cluster, name)
        finally:
            if cluster.router is not None:
                procs.insert(0, cluster.router)
        assert cluster.router is not None
        yield Target(name, cluster.router_port, cluster.router.pid, decode.port, "/generate",
                     [prefill.proc.pid, decode.proc.pid], cluster.router)  # fmt: skip
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)


# ---- measurement windows ------------------------------------------------------------------------
@attrs.define
class Snap:
    t: float
    cpu: dict[int, float]  # pid -> CPU seconds (the measured tree)
    engines: float
    machine: float
    counters: dict[str, int]
    client: float = 0.0
    steal: float = 0.0


def proc_cpu(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    return 0.0


def snap(target: Target, client_pid: int | None = None, counters: Any = None) -> Snap:
    t = time.monotonic()
    cpu = {p.pid: proc_cpu(p.pid) for p in common.tree_procs(target.root)}
    engines = sum(common.tree_cpu(pid) for pid in target.engines)
    machine = common.machine_busy()
    if counters is not None:
        stats = {"events": counters[0], "streams": counters[1], "errors": counters[2]}
    elif target.stats_file is not None:
        stats = read_counters(target.stats_file)
    else:
        stats = common.http_get_json(target.stats_port, "/stats", timeout=10.0)
        if not isinstance(stats, dict):
            raise RuntimeError(f"{target.name}: no answer from /stats on port {target.stats_port}")
    client = proc_cpu(client_pid) if client_pid else 0.0
    steal = getattr(psutil.cpu_times(), "steal", 0.0)
    return Snap(t, cpu, engines, machine, stats, client, steal)


def window(target: Target, a: Snap, b: Snap, count_key: str) -> dict[str, Any]:
    """CPU of the measured tree (and per worker process) between two snapshots, per item."""
    wall = b.t - a.t
    pids = set(a.cpu) | set(b.cpu)
    per = {pid: b.cpu.get(pid, 0.0) - a.cpu.get(pid, 0.0) for pid in pids}
    cpu = sum(per.values())
    count = b.counters.get(count_key, 0) - a.counters.get(count_key, 0)
    out: dict[str, Any] = {
        "window_s": round(wall, 3),
        "cpu_s": round(cpu, 4),
        count_key: count,
        "per_s": round(count / wall, 1) if wall else None,
        "cpu_us": round(1e6 * cpu / count, 1) if count else None,
        "cores": round(cpu / wall, 3) if wall else None,
        "engines_us": round(1e6 * (b.engines - a.engines) / count, 1) if count else None,
        "client_us": round(1e6 * (b.client - a.client) / count, 1) if count and b.client else None,
        "machine_busy": round((b.machine - a.machine) / wall, 2) if wall else None,
        "steal": round((b.steal - a.steal) / wall, 2) if wall else None,
    }
    workers = target.workers()
    if len(workers) > 1:
        shares = [per.get(pid, 0.0) for pid in workers]
        out["worker_cpu_s"] = [round(x, 3) for x in shares]
        out["split"] = round(max(shares) / min(shares), 3) if min(shares) > 0 else None
    return out


def run_wrk(port: int, conc: int, seconds: int) -> subprocess.Popen[str]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk): router-bound needs it")
    argv = [wrk, "-t1", f"-c{conc}", f"-d{seconds}s", "--timeout", "30s", "-s", str(WRK_SCRIPT),
            f"http://{HOST}:{port}"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wrk_summary(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        if line.startswith("WRK_JSON "):
            data = json.loads(line[len("WRK_JSON ") :])
            secs = data["duration_us"] / 1e6
            errors = sum(data[k] for k in ("non2xx", "connect", "read", "write", "timeout"))
            return {
                "wrk_requests": data["requests"],
                "wrk_rps": round(data["requests"] / secs, 1) if secs else None,
                "p50_ms": round(data["p50_us"] / 1000, 3),
                "p99_ms": round(data["p99_us"] / 1000, 3),
                "errors": errors,
            }
    raise RuntimeError(f"wrk printed no summary:\n{output[-2000:]}")


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def settle(target: Target, timeout: float = 15.0) -> float:
    """Wait until the measured tree is idle (under 5 % of a core over 0.2 s): requests a
    finished wrk left behind (its connections closed, the router still working on them) must
    not land in the next measurement. Returns the seconds waited."""
    t0 = time.monotonic()
    before = common.tree_cpu(target.root)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.2)
        now = common.tree_cpu(target.root)
        if now - before < 0.01:
            break
        before = now
    return round(time.monotonic() - t0, 2)


def wrk_level(target: Target, conc: int, s: Settings) -> dict[str, Any]:
    settled = settle(target)
    wrk = run_wrk(target.port, conc, s.wrk_seconds)
    t0 = time.monotonic()
    sleep_until(t0 + s.lead)
    a = snap(target, wrk.pid)
    sleep_until(t0 + s.lead + s.window)
    b = snap(target, wrk.pid)
    out, _ = wrk.communicate(timeout=s.wrk_seconds + 60)
    w = window(target, a, b, "requests")
    row = {"target": target.name, "c": conc, **wrk_summary(out), "settled_s": settled}
    # The window's count (the server's) and wrk's own rate must agree: a mismatch means the
    # counter was misread (the request count is the denominator of every CPU figure).
    row["count_vs_wrk"] = _ratio(w["per_s"], row["wrk_rps"])
    if row["count_vs_wrk"] is not None and abs(row["count_vs_wrk"] - 1) > 0.25:
        print_flush(f"  WARNING {target.name} c={conc}: {w['per_s']} req/s counted in the window,"
                    f" wrk saw {row['wrk_rps']} req/s")  # fmt: skip
    row.update(
        rps=w["per_s"], cpu_us_per_req=w["cpu_us"], router_cores=w["cores"],
        engines_us_per_req=w["engines_us"], wrk_us_per_req=w["client_us"],
        machine_busy=w["machine_busy"], steal=w["steal"], window_s=w["window_s"],
        requests=w["requests"],
        split=w.get("split"), worker_cpu_s=w.get("worker_cpu_s"),
    )  # fmt: skip
    return row


def nonstream(name: str, s: Settings) -> dict[str, Any]:
    with started(name, s) as target:
        warm = run_wrk(target.port, max(LEVELS), max(1, round(s.warmup)))
        wrk_summary(warm.communicate(timeout=s.warmup + 60)[0])
        rows = []
        for conc in LEVELS:
            row = wrk_level(target, conc, s)
            rows.append(row)
            print_flush(
                f"  {name} c={conc}: {fmt(row['rps'])} req/s, p50 {row['p50_ms']} ms, "
                f"p99 {row['p99_ms']} ms, {fmt(row['cpu_us_per_req'])} us CPU/req"
                + (f", split {row['split']}" if row.get("split") else "")
                + (f", {row['errors']} errors" if row["errors"] else "")
            )
        rss = peak_rss_mb(target.root) if name not in ("direct",) else None
    return {"target": name, "rows": rows, "peak_rss_mb": rss}


# ---- paced streams: the client (its own process) --------------------------------------------
EVENTS, STREAMS, ERRORS, STARTED, STOP = range(5)


class _PacedStream(asyncio.Protocol):
    """One keep-alive connection running one stream after another, counting SSE events."""

    def __init__(self, request: bytes, counters: Any, done: asyncio.Future[None]) -> None:
        self.request = request
        self.counters = counters
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending = b""
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        if self.counters[STOP]:
            self.transport.close()
            return
        self.pending = b""
        self.counters[STARTED] += 1
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.counters[ERRORS] += 1
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        data = self.pending + body
        if b"\n\n" not in data:
            self.pending = data
            return
        *events, self.pending = data.split(b"\n\n")
        n = 0
        for event in events:
            if event.startswith(b"data:") and b"[DONE]" not in event[:16]:
                n += 1
        self.counters[EVENTS] += n

    def on_message_complete(self) -> None:
        if self.status == 200:
            self.counters[STREAMS] += 1
        else:
            self.counters[ERRORS] += 1
        self.parser = httptools.HttpResponseParser(self)
        self.send()


async def _paced_main(port: int, path: str, streams: int, counters: Any) -> None:
    body = orjson.dumps(STREAM_BODY)
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()

    async def one() -> None:
        while not counters[STOP]:
            done: asyncio.Future[None] = loop.create_future()
            try:
                await loop.create_connection(
                    partial(_PacedStream, request, counters, done), HOST, port
                )
            except OSError:
                counters[ERRORS] += 1
                await asyncio.sleep(0.05)
                continue
            await done
            if not counters[STOP]:  # the router closed the connection
                counters[ERRORS] += 1
                await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(one()) for _ in range(streams)]
    while not counters[STOP]:  # noqa: ASYNC110 - the flag is set by another process
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def paced_client(port: int, path: str, streams: int, counters: Any) -> None:
    import uvloop

    uvloop.run(_paced_main(port, path, streams, counters))


def paced(name: str, s: Settings) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    counters = ctx.RawArray("q", 5)
    with started(name, s) as target:
        client = ctx.Process(
            target=paced_client, args=(target.port, target.stream_path, s.streams, counters)
        )
        client.start()
        try:
            deadline = time.monotonic() + 30
            while counters[STARTED] < s.streams and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()
            sleep_until(t0 + s.paced_warmup)
            a = snap(target, client.pid, counters)
            sleep_until(t0 + s.paced_warmup + s.paced_window)
            b = snap(target, client.pid, counters)
        finally:
            counters[STOP] = 1
            client.join(10)
            if client.is_alive():
                client.kill()
                client.join(5)
        w = window(target, a, b, "events")
        row = {
            "target": name,
            "streams": s.streams,
            "events_per_stream": s.events,
            "interval_ms": s.interval_ms,
            "events": w["events"],
            "events_per_s": w["per_s"],
            "cpu_us_per_event": w["cpu_us"],
            "router_cores": w["cores"],
            "engines_us_per_event": w["engines_us"],
            "client_us_per_event": w["client_us"],
            "machine_busy": w["machine_busy"],
            "steal": w["steal"],
            "streams_done": b.counters["streams"] - a.counters["streams"],
            "errors": b.counters["errors"],
            "window_s": w["window_s"],
            "split": w.get("split"),
            "worker_cpu_s": w.get("worker_cpu_s"),
            "peak_rss_mb": peak_rss_mb(target.root),
        }
    expected = s.streams * 1000.0 / s.interval_ms
    print_flush(
        f"  {name} paced: {fmt(row['events_per_s'])} events/s (ideal {expected:,.0f}), "
        f"{fmt(row['cpu_us_per_event'])} us CPU/event"
        + (f", split {row['split']}" if row.get("split") else "")
        + (f", {row['errors']} errors" if row["errors"] else "")
    )
    return row


# ---- the whole scenario --------------------------------------------------------------------
def run_all(
    routers: Sequence[str], repeat: int = 3, quick: bool = False, show: bool = True
) -> tuple[dict[str, Any], list[dict[str, dict[str, Any]]]]:
    """Every target, both phases, `repeat` times. Returns (result, per-repetition summaries of
    each router for the side-by-side table)."""
    if shutil.which("wrk") is None:
        raise RuntimeError("router-bound needs wrk (apt-get install wrk; make bench installs it)")
    s = settings(quick)
    meta = {**common.meta(), "cpu_model": cpu_model()}
    print_flush(f"== {NAME} == load shape: {LOAD_SHAPE}")
    print_flush(f"   {meta['nproc']} x {meta['cpu_model']}, settings {attrs.asdict(s)}")
    nonstream_order = ["floor", "direct", *routers]
    paced_order = ["floor", *routers]
    runs: dict[str, list[dict[str, Any]]] = {"nonstream": [], "paced": []}
    failures: list[str] = []
    for phase, order, fn in (
        ("nonstream", nonstream_order, nonstream),
        ("paced", paced_order, paced),
    ):
        for rep in range(repeat):
            targets = order if rep % 2 == 0 else list(reversed(order))
            for name in targets:
                print_flush(f"[{NAME} {phase} rep {rep + 1}/{repeat}] {name} ...")
                try:
                    result = fn(name, s)
                except Exception as exc:  # one router that fails must not sink the others
                    msg = str(exc).splitlines()
                    print_flush(f"  FAILED: {msg[0] if msg else exc!r}")
                    failures.append(f"{phase}/{name} rep {rep + 1}: {exc!r}"[:2000])
                    continue
                result["repetition"] = rep + 1
                runs[phase].append(result)
    result: dict[str, Any] = {
        "scenario": NAME,
        "load_shape": LOAD_SHAPE,
        "quick": quick,
        "repeat": repeat,
        "settings": attrs.asdict(s),
        "machine": {"nproc": meta["nproc"], "cpu_model": meta["cpu_model"]},
        "date": meta["date"],
        "commit": meta["commit"],
        "routers": list(routers),
        "runs": runs,
        "failures": failures,
    }
    finish(result)
    if show:
        print_flush("")
        print_flush(render(result))
    return result, per_repetition(runs, routers, repeat)


def finish(result: dict[str, Any]) -> None:
    """Medians, targets and capacity table from the raw runs (also `--render` of a saved JSON)."""
    routers = result["routers"]
    medians = summarize(result["runs"], ["floor", "direct", *routers])
    result["medians"] = medians
    result["targets"] = judge(medians)
    result["capacity"] = capacity_rows(medians, ["floor", *routers])
    result["capacity_markdown"] = capacity_markdown(result["capacity"], result)


def _rows(runs: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return [r for r in runs["nonstream"] if r["target"] == name]


def summarize(runs: dict[str, list[dict[str, Any]]], names: Sequence[str]) -> dict[str, Any]:
    """Medians over repetitions, one flat dict per target."""
    med = stats.median
    out: dict[str, Any] = {}
    direct = {r["repetition"]: {row["c"]: row for row in r["rows"]} for r in _rows(runs, "direct")}
    for name in names:
        reps = _rows(runs, name)
        m: dict[str, Any] = {"repetitions": len(reps)}
        levels = sorted({row["c"] for r in reps for row in r["rows"]})
        for c in levels:
            rows = [row for r in reps for row in r["rows"] if row["c"] == c]
            for key in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "machine_busy", "steal",
                        "engines_us_per_req", "wrk_us_per_req", "split"):  # fmt: skip
                m[f"c{c}_{key}"] = med(row.get(key) for row in rows)
            m[f"c{c}_errors"] = sum(row.get("errors") or 0 for row in rows)
        if name != "direct":
            added = []
            for r in reps:
                base = direct.get(r["repetition"], {}).get(1)
                mine = next((row for row in r["rows"] if row["c"] == 1), None)
                if base and mine and base["p50_ms"] is not None and mine["p50_ms"] is not None:
                    added.append(mine["p50_ms"] - base["p50_ms"])
            m["c1_added_p50_ms"] = _round(med(added), 3)
        paced_rows = [r for r in runs["paced"] if r["target"] == name]
        if paced_rows:
            for key in ("cpu_us_per_event", "events_per_s", "machine_busy", "split",
                        "engines_us_per_event"):  # fmt: skip
                m[f"paced_{key}"] = med(r.get(key) for r in paced_rows)
            m["paced_errors"] = sum(r.get("errors") or 0 for r in paced_rows)
        rss = [r.get("peak_rss_mb") for r in reps] + [r.get("peak_rss_mb") for r in paced_rows]
        m["peak_rss_mb"] = max((x for x in rss if x is not None), default=None)
        out[name] = m
    if "trio_pd" in out and "trio_pd_w2" in out:
        for c in (32, 256):
            one = out["trio_pd"].get(f"c{c}_cpu_us_per_req")
            two = out["trio_pd_w2"].get(f"c{c}_cpu_us_per_req")
            out["trio_pd_w2"][f"c{c}_cpu_vs_w1"] = _ratio(two, one)
    return out


def per_repetition(
    runs: dict[str, list[dict[str, Any]]], routers: Sequence[str], repeat: int
) -> list[dict[str, dict[str, Any]]]:
    """Flat metrics per repetition and router (the side-by-side table of `bench run`)."""
    reps: list[dict[str, dict[str, Any]]] = [{r: {} for r in routers} for _ in range(repeat)]
    for r in runs["nonstream"]:
        if r["target"] not in routers:
            continue
        flat = reps[r["repetition"] - 1][r["target"]]
        for row in r["rows"]:
            flat[f"rb c{row['c']} CPU us/req"] = row["cpu_us_per_req"]
            if row["c"] == 256:
                flat["rb c256 p99 ms"] = row["p99_ms"]
            if row["c"] == 1:
                flat["rb c1 p50 ms"] = row["p50_ms"]
    for r in runs["paced"]:
        if r["target"] in routers:
            reps[r["repetition"] - 1][r["target"]]["rb paced CPU us/event"] = r["cpu_us_per_event"]
    return reps


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b not in (None, 0) else None


def _diff(a: float | None, b: float | None) -> float | None:
    return round(a - b, 1) if a is not None and b is not None else None


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def judge(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for trio_pd, from the medians: value, reference, ratio or
    difference, goal, PASS/MISS ('n/a' when a side was not measured)."""

    def get(name: str, key: str) -> float | None:
        return m.get(name, {}).get(key)

    checks = []

    def check(
        what: str, value: Any, ref: Any, kind: str, limit: float, goal: str, unit: str = "us"
    ) -> None:
        if kind in ("ratio", "band"):
            measure = _ratio(value, ref)
        elif kind == "diff":
            measure = _diff(value, ref)
        else:  # "value": the measure itself, no reference
            measure = value
        if measure is None:
            verdict = "n/a"
        elif kind == "band":
            verdict = "PASS" if abs(measure - 1.0) <= limit else "MISS"
        else:
            verdict = "PASS" if measure <= limit else "MISS"
        checks.append({"target": what, "value": value, "reference": ref, "measure": measure,
                       "kind": kind, "unit": unit, "goal": goal, "verdict": verdict})  # fmt: skip

    for c in (32, 256):
        check(f"CPU/req c={c}: trio_pd / mini_lb", get("trio_pd", f"c{c}_cpu_us_per_req"),
              get("mini_lb", f"c{c}_cpu_us_per_req"), "ratio", 0.9, "<= 0.9x")  # fmt: skip
    check("CPU/req c=32: trio_pd - floor (us)", get("trio_pd", "c32_cpu_us_per_req"),
          get("floor", "c32_cpu_us_per_req"), "diff", 250.0, "<= +250 us")  # fmt: skip
    check("CPU/event paced: trio_pd / mini_lb", get("trio_pd", "paced_cpu_us_per_event"),
          get("mini_lb", "paced_cpu_us_per_event"), "ratio", 1.5, "<= 1.5x")  # fmt: skip
    check("CPU/event paced: trio_pd - floor (us)", get("trio_pd", "paced_cpu_us_per_event"),
          get("floor", "paced_cpu_us_per_event"), "diff", 25.0, "<= +25 us")  # fmt: skip
    check("p99 c=256: trio_pd / mini_lb", get("trio_pd", "c256_p99_ms"),
          get("mini_lb", "c256_p99_ms"), "ratio", 1.0, "<= 1.0x", "ms")  # fmt: skip
    check("added p50 c=1: trio_pd / SMG", get("trio_pd", "c1_added_p50_ms"),
          get("smg", "c1_added_p50_ms"), "ratio", 2.0, "<= 2x", "ms")  # fmt: skip
    for c in (32, 256):
        check(f"--workers 2: busiest/idlest worker CPU c={c}", get("trio_pd_w2", f"c{c}_split"),
              None, "value", 1.25, "<= 1.25", "")  # fmt: skip
    for c in (32, 256):
        check(f"--workers 2: CPU/req c={c} / 1 worker", get("trio_pd_w2", f"c{c}_cpu_us_per_req"),
              get("trio_pd", f"c{c}_cpu_us_per_req"), "band", 0.1, "1.0x +/- 10%")  # fmt: skip
    return checks


def capacity_rows(m: dict[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """Router cores for 1,000 non-stream requests/s (CPU/req at c=32) and for 100,000 streamed
    tokens/s (CPU/event of the paced streams, one token per event)."""
    floor_req = m.get("floor", {}).get("c32_cpu_us_per_req")
    floor_evt = m.get("floor", {}).get("paced_cpu_us_per_event")
    rows = []
    for name in names:
        req = m.get(name, {}).get("c32_cpu_us_per_req")
        evt = m.get(name, {}).get("paced_cpu_us_per_event")
        rows.append({
            "router": LABELS.get(name, name),
            "cpu_us_per_req": _round(req),
            "cores_per_1k_rps": _round(req * 1000 / 1e6, 2) if req is not None else None,
            "above_floor_us_per_req": _diff(req, floor_req) if name != "floor" else None,
            "cpu_us_per_event": _round(evt),
            "cores_per_100k_tokens": _round(evt * 100_000 / 1e6, 2) if evt is not None else None,
            "above_floor_us_per_event": _diff(evt, floor_evt) if name != "floor" else None,
        })  # fmt: skip
    return rows


def capacity_markdown(rows: list[dict[str, Any]], result: dict[str, Any]) -> str:
    machine = result["machine"]
    kind = "quick run (short windows, noisy)" if result["quick"] else "full run"
    lines = [
        f"Capacity planning, measured {result['date'][:10]} on {machine['nproc']} x "
        f"{machine['cpu_model']} (nproc {machine['nproc']}), commit {result['commit'][:12]}, "
        f"{kind}, medians of {result['repeat']}; router CPU (user+sys, process tree) with "
        "instant engines (`python -m bench run --scenarios router-bound`). One streamed token = "
        "one SSE event; non-stream CPU at concurrency 32.",
        "",
        "| router | CPU µs / non-stream request | cores per 1,000 req/s | above floor (µs/req) "
        "| CPU µs / streamed token | cores per 100,000 tokens/s | above floor (µs/token) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r["router"],
            num(r["cpu_us_per_req"], 0),
            num(r["cores_per_1k_rps"], 2),
            signed(r["above_floor_us_per_req"]),
            num(r["cpu_us_per_event"], 1),
            num(r["cores_per_100k_tokens"], 2),
            signed(r["above_floor_us_per_event"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


MEDIAN_COLUMNS = (  # (key in the medians, title, decimals)
    ("target", "target", 0), ("c1_p50_ms", "c1 p50 ms", 3),
    ("c1_added_p50_ms", "c1 added p50 ms", 3), ("c1_cpu_us_per_req", "c1 us/req", 1),
    ("c32_rps", "c32 req/s", 0), ("c32_cpu_us_per_req", "c32 us/req", 1),
    ("c256_rps", "c256 req/s", 0), ("c256_cpu_us_per_req", "c256 us/req", 1),
    ("c256_p99_ms", "c256 p99 ms", 1), ("paced_cpu_us_per_event", "paced us/event", 1),
    ("paced_events_per_s", "paced events/s", 0), ("peak_rss_mb", "peak RSS MB", 0),
    ("c32_split", "split c32", 2), ("c256_split", "split c256", 2),
    ("paced_split", "split paced", 2), ("errors", "errors", 0),
)  # fmt: skip


def num(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int) and not isinstance(value, bool):
        return f"{value:,.{digits}f}"
    return str(value)


def signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+,.0f}"


def render(result: dict[str, Any]) -> str:
    m = result["medians"]
    label = "QUICK (short windows, noisy)" if result["quick"] else "full"
    table_rows = []
    for name, values in m.items():
        row = {"target": name, **values}
        row["errors"] = sum(v for k, v in values.items() if k.endswith("errors") and v)
        table_rows.append({title: num(row.get(key), d) for key, title, d in MEDIAN_COLUMNS})
    check_rows = []
    for c in result["targets"]:
        digits = 3 if c["unit"] == "ms" else 2 if c["unit"] == "" else 1
        measure = c["measure"]
        if measure is not None:
            measure = f"{measure:+,.1f} us" if c["kind"] == "diff" else f"{measure:.2f}"
        check_rows.append({
            "target": c["target"], "value": num(c["value"], digits),
            "reference": num(c["reference"], digits), "ratio/diff": measure,
            "goal": c["goal"], "verdict": c["verdict"],
        })  # fmt: skip
    out = [
        f"== {NAME} ({label}; medians of {result['repeat']}; {result['machine']['nproc']} x "
        f"{result['machine']['cpu_model']}; commit {result['commit'][:12]}) ==",
        f"load shape: {result['load_shape']}",
        "us/req and us/event: CPU of the target's process tree (router; floor app; for 'direct' "
        "the instant decode engine) per completed request / relayed event; split: busiest / "
        "idlest worker process CPU",
        common.table(table_rows, [title for _, title, _ in MEDIAN_COLUMNS]),
        "",
        "== targets (trio_pd; values in us, p50/p99 in ms) ==",
        common.table(check_rows, ("target", "value", "reference", "ratio/diff", "goal", "verdict")),
        "",
        result["capacity_markdown"],
    ]
    if result["failures"]:
        out += ["", *(f"FAILED: {f.splitlines()[0]}" for f in result["failures"])]
    return "\n".join(out)


def fmt(value: Any) -> str:
    return common.fmt(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_bound", description=__doc__)
    parser.add_argument("--routers", default="trio_pd,trio_pd_w2,smg,mini_lb")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--render", metavar="JSON", help="print the tables of a saved result")
    args = parser.parse_args(argv)
    if args.render:
        result = orjson.loads(Path(args.render).read_bytes())
        finish(result)
        print_flush(render(result))
        return 0
    routers = args.routers.split(",")
    routers = common.usable_routers(routers)
    result, _ = run_all(routers, args.repeat, args.quick)
    print_flush("wrote", common.write_result(NAME, result))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
