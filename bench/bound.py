"""Measurements where the router is the only busy program (router-bound, trace_cost, profile):
a target behind instant engines (bench/instant_engine.py), loaded by wrk or the paced streams'
client, its CPU taken in a window inside the load.

Targets: `floor` (bench/floor.py: a bare ASGI app on hypercorn's trio worker, served like
trio_pd; its own timers for the paced streams), `direct` (the instant decode engine alone) and
any router of bench/harness/procs.py in front of an instant prefill and decode.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from bench import paced as paced_client
from bench.floor import read_counters
from bench.harness import cpu, procs, wrk
from bench.harness.output import print_flush
from bench.harness.procs import HOST

LEVELS = (1, 32, 256)  # wrk's concurrencies


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


@attrs.define
class Target:
    name: str
    port: int  # where the load goes
    root: int  # the measured process tree
    stats_port: int  # who counts completed requests (/stats)
    stream_path: str
    engines: list[int] = attrs.Factory(list)
    router: procs.Proc | None = None
    stats_file: Path | None = None  # the floor's counters (a loaded floor answers /stats late)

    def workers(self) -> list[int]:
        return cpu.worker_pids(self.root) if self.name == "trio_pd_w2" else [self.root]

    def counters(self) -> dict[str, int]:
        if self.stats_file is not None:
            return read_counters(self.stats_file)
        stats = procs.http_get_json(self.stats_port, "/stats", timeout=10.0)
        if not isinstance(stats, dict):
            raise RuntimeError(f"{self.name}: no answer from /stats on port {self.stats_port}")
        return stats

    def snap(self, client: int | None, counters: dict[str, int] | None = None) -> cpu.Snap:
        return cpu.snap(self.root, self.engines, counters or self.counters(), client)


def instant_args(s: Settings) -> list[str]:
    return ["--events", str(s.events), "--interval-ms", str(s.interval_ms)]


@contextlib.contextmanager
def started(name: str, s: Settings) -> Iterator[Target]:
    """The target with fresh processes, all of them reaped on the way out."""
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-rb-"))
    started: list[procs.Proc] = []
    try:
        if name == "floor":
            port = procs.free_port()
            stats = logdir / "floor.stats"
            argv = [sys.executable, "-m", "bench.floor", "--host", HOST, "--port", str(port),
                    *instant_args(s), "--stats-file", str(stats)]  # fmt: skip
            proc = procs.Proc("floor", argv, logdir)
            started.append(proc)
            procs.wait_until(lambda: procs.http_get(port, "/health") == 200, 20, "floor", proc)
            yield Target(name, port, proc.pid, port, "/stream", stats_file=stats)
            return
        decode = procs.start_instant("decode", logdir, instant_args(s))
        started.append(decode.proc)
        if name == "direct":
            yield Target(name, decode.port, decode.proc.pid, decode.port, "/generate")
            return
        prefill = procs.start_instant("prefill", logdir, instant_args(s))
        started.append(prefill.proc)
        cluster = procs.Cluster(logdir, prefill, decode, keep_logs=True)
        try:
            procs.start_router(cluster, name)
        finally:
            if cluster.router is not None:
                started.insert(0, cluster.router)
        assert cluster.router is not None
        yield Target(name, cluster.router_port, cluster.router.pid, decode.port, "/generate",
                     [prefill.proc.pid, decode.proc.pid], cluster.router)  # fmt: skip
    finally:
        for proc in started:
            with contextlib.suppress(Exception):
                proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def wrk_level(target: Target, conc: int, s: Settings) -> dict[str, Any]:
    """One wrk run at `conc` connections; the CPU window opens after `s.lead` seconds."""
    settled = cpu.settle(target.root)
    load = wrk.start(target.port, conc, s.wrk_seconds)
    t0 = time.monotonic()
    sleep_until(t0 + s.lead)
    a = target.snap(load.pid)
    sleep_until(t0 + s.lead + s.window)
    b = target.snap(load.pid)
    printed, _ = load.communicate(timeout=s.wrk_seconds + 60)
    w = cpu.window(a, b, "requests", target.workers())
    row = {"target": target.name, "c": conc, **wrk.summary(printed), "settled_s": settled}
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
        requests=w["requests"], split=w.get("split"), worker_cpu_s=w.get("worker_cpu_s"),
    )  # fmt: skip
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b not in (None, 0) else None


def nonstream(name: str, s: Settings) -> dict[str, Any]:
    """A warm-up, then wrk at each of LEVELS; metrics `c{N}_{key}` per level."""
    with started(name, s) as target:
        warm = wrk.start(target.port, max(LEVELS), max(1, round(s.warmup)))
        wrk.summary(warm.communicate(timeout=s.warmup + 60)[0])
        rows = []
        for conc in LEVELS:
            row = wrk_level(target, conc, s)
            rows.append(row)
            print_flush(
                f"  {name} c={conc}: {row['rps']} req/s, p50 {row['p50_ms']} ms, "
                f"p99 {row['p99_ms']} ms, {row['cpu_us_per_req']} us CPU/req"
                + (f", split {row['split']}" if row.get("split") else "")
                + (f", {row['errors']} errors" if row["errors"] else "")
            )
        rss = cpu.peak_rss_mb(target.root) if name != "direct" else None
    metrics: dict[str, Any] = {"peak_rss_mb": rss}
    for row in rows:
        for key in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "machine_busy", "steal",
                    "engines_us_per_req", "wrk_us_per_req", "split", "errors"):  # fmt: skip
            metrics[f"c{row['c']}_{key}"] = row.get(key)
    return {"metrics": metrics, "rows": rows}


def paced(name: str, s: Settings) -> dict[str, Any]:
    """`s.streams` concurrent streams of `s.events` events `s.interval_ms` apart; CPU per event
    the client received inside the window."""
    ctx = multiprocessing.get_context("spawn")
    counters = ctx.RawArray("q", 5)
    EVENTS, STREAMS, ERRORS, STARTED, STOP = (paced_client.EVENTS, paced_client.STREAMS,
                                              paced_client.ERRORS, paced_client.STARTED,
                                              paced_client.STOP)  # fmt: skip

    def counts() -> dict[str, int]:
        return {"events": counters[EVENTS], "streams": counters[STREAMS],
                "errors": counters[ERRORS]}  # fmt: skip

    with started(name, s) as target:
        args = (target.port, target.stream_path, s.streams, counters)
        client = ctx.Process(target=paced_client.client, args=args)
        client.start()
        try:
            deadline = time.monotonic() + 30
            while counters[STARTED] < s.streams and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()
            sleep_until(t0 + s.paced_warmup)
            a = target.snap(client.pid, counts())
            sleep_until(t0 + s.paced_warmup + s.paced_window)
            b = target.snap(client.pid, counts())
        finally:
            counters[STOP] = 1
            client.join(10)
            if client.is_alive():
                client.kill()
                client.join(5)
        w = cpu.window(a, b, "events", target.workers())
        rss = cpu.peak_rss_mb(target.root)
    metrics = {
        "paced_events_per_s": w["per_s"],
        "paced_cpu_us_per_event": w["cpu_us"],
        "paced_engines_us_per_event": w["engines_us"],
        "paced_client_us_per_event": w["client_us"],
        "paced_machine_busy": w["machine_busy"],
        "paced_split": w.get("split"),
        "paced_errors": b.counters["errors"],
        "paced_peak_rss_mb": rss,
    }
    print_flush(
        f"  {name} paced: {w['per_s']} events/s (ideal {s.streams * 1000.0 / s.interval_ms:,.0f}),"
        f" {w['cpu_us']} us CPU/event"
        + (f", split {w['split']}" if w.get("split") else "")
        + (f", {b.counters['errors']} errors" if b.counters["errors"] else "")
    )
    return {"metrics": metrics, "window": w}
