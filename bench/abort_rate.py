"""Scenario `abort-rate`: does the abort service keep up with a storm of failing requests?

Issue 19 asks for the figure at 500 failing requests a second. A real router (`trio-pd serve`)
sits in front of two instant engines (bench/instant_engine.py): a prefill that answers every
request with status 500 at once (`--prefill-status 500`) and a decode that holds every request's
slot until an abort names its rid, or `HOLD_SECS` pass (`--decode-hold`: a decode waiting for a KV
cache its prefill will never send, which closing the connection does not free). Both record what
they did with `time.monotonic()`, one clock for every process on the machine (`--record-aborts`).

An open-loop client (fixed arrival times, not a closed loop: a slow router does not slow the
arrivals) sends non-stream `/generate` at each rate for `seconds`, on keep-alive connections
(a new one when none is idle). Every request fails; the router cancels its decode leg and hands
one abort per rid to the service, which POSTs it at once and again 2 s later (pd/aborts.py: the
prefill leg has its answer, so it is not aborted). After the load the run waits for the repeats
and reads, per rate:

- `sent`, `failed` (the client's non-2xx), `decode_got` (requests the decode engine held: the
  rest were cancelled before their bytes went out, a race with the prefill's instant 500);
- `legs_cancelled` (the router's `trio_pd_legs_cancelled_total`: the abort jobs expected, one per
  rid), `rids_aborted` (rids the decode engine received an abort for), `not_posted` (the
  difference: legs counted cancelled whose request no engine saw; 0 since the router counts and
  aborts only legs that reached the write, `Leg.sending`; with aborts off it is every
  cancelled leg), `posts` (abort POSTs received; 2 per rid when all is
  well), `got_not_freed` (held requests no abort freed: the figure that must be 0);
- `dropped` / `failed_posts` (the router's `trio_pd_aborts_total` counters, from /metrics);
- `abort_p50_ms` / `abort_p99_ms`: from the prefill's failure to the decode engine receiving the
  rid's first abort; `freed_p99_ms`: to the abort that freed the slot (the first one can land
  before the decode request did, and the engine drops it: the repeat frees it);
- `held_end`: decode slots still held at the end (0 when every abort arrived), once the router's
  abort counters stopped moving; `settle_s`: how long after the load that was (a saturated
  router is still sending its backlog);
- `router_cpu_s` over the load and the wait, and per request.

The baseline in the same run is the same load on `--no-abort-on-cancel`: every doomed decode keeps
its slot until the hold timeout. Each (mode, rate) gets fresh processes, `--repeat` times
interleaved; the table has the medians, the JSON every run too.

    .venv/bin/python -m bench.abort_rate [--quick] [--rates 100,250,500,750] [--seconds 10]
        [--repeat 3] [--modes aborts,noabort] [--profile]   # py-spy the router (pip install)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import orjson

from bench import stats
from bench.harness import cpu, output, procs
from bench.harness.output import print_flush
from bench.harness.procs import HOST
from bench.stats import pct

NAME = "abort_rate"
HOLD_SECS = 30.0  # the decode's hold timeout (SGLang's KV waiting timeout in the storm)
REPEAT_WAIT = 3.0  # after the last answer: the 2 s repeat, and some
SETTLE_MAX = 30.0  # then until the router's abort counters stop moving, at most this long
MAX_CONNECTIONS = 4096
MODES = {"aborts": "trio_pd", "noabort": "trio_pd_noabort"}
COLUMNS = (
    "mode", "rate", "achieved", "sent", "failed", "decode_got", "legs_cancelled", "rids_aborted",
    "not_posted", "posts", "dropped", "failed_posts", "abort_p50_ms", "abort_p99_ms",
    "freed_p99_ms", "held_end", "settle_s", "router_cpu_s", "cpu_ms_per_req", "client_p50_ms",
)  # fmt: skip
BODY = orjson.dumps({"text": "abort storm", "sampling_params": {"max_new_tokens": 16}})


# ---- the open-loop client -------------------------------------------------------------------
class _Conn(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer recorded."""

    def __init__(self, client: OpenLoop, first: list[float]) -> None:
        self.client = client
        self.current: list[float] | None = first  # [scheduled, sent, ended, status]
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        assert self.current is not None
        self.send(self.current)

    def send(self, record: list[float]) -> None:
        assert self.transport is not None
        self.current = record
        record[1] = time.monotonic()
        self.transport.write(self.client.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end(-1)
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        self._end(self.parser.get_status_code())
        self.parser = httptools.HttpResponseParser(self)
        if self.transport is not None and not self.transport.is_closing():
            self.client.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(-1)
        with contextlib.suppress(ValueError):
            self.client.idle.remove(self)
        self.client.open -= 1

    def _end(self, status: int) -> None:
        if self.current is not None:
            self.current[2] = time.monotonic()
            self.current[3] = status
            self.current = None
            self.client.answered += 1


class OpenLoop:
    """Fixed arrival times: request i goes at t0 + i / rate, on an idle connection or a new one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.request = (
            f"POST /generate HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.idle: list[_Conn] = []
        self.records: list[list[float]] = []
        self.open = 0
        self.answered = 0
        self.refused = 0

    def fire(self, scheduled: float) -> None:
        record = [scheduled, 0.0, 0.0, 0]
        self.records.append(record)
        if self.idle:
            self.idle.pop().send(record)
            return
        if self.open >= MAX_CONNECTIONS:
            record[3] = -2  # the client's own limit: counted, not sent
            self.refused += 1
            return
        self.open += 1
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(lambda: _Conn(self, record), HOST, self.port)
        loop.create_task(connect).add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            self.open -= 1
            self.answered += 1

    async def run(self, rate: float, seconds: float, t0: float) -> None:
        count = int(rate * seconds)
        i = 0
        while i < count:
            now = time.monotonic()
            while i < count and t0 + i / rate <= now:
                self.fire(t0 + i / rate)
                i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        deadline = time.monotonic() + 15.0
        while self.answered < count - self.refused and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for conn in list(self.idle):
            if conn.transport is not None:
                conn.transport.close()


def drive(port: int, rate: float, seconds: float, t0: float) -> OpenLoop:
    import uvloop

    client = OpenLoop(port)
    uvloop.run(client.run(rate, seconds, t0))
    return client


# ---- processes ------------------------------------------------------------------------------
def start_instant(role: str, logdir: Path, args: list[str]) -> procs.Engine:
    return procs.start_instant(role, logdir, ["--record-aborts", *args])


@contextlib.contextmanager
def started(mode: str) -> Iterator[tuple[procs.Cluster, int]]:
    """Engines and a router; yields the cluster and the router's metrics port."""
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-aborts-"))
    c = None
    try:
        prefill = start_instant("prefill", logdir, ["--prefill-status", "500"])
        try:
            decode = start_instant("decode", logdir, ["--decode-hold", str(HOLD_SECS)])
        except BaseException:
            prefill.proc.stop()
            raise
        c = procs.Cluster(logdir, prefill, decode)
        kind = MODES[mode]
        port = procs.free_port()
        argv = procs.router_argv(kind, [prefill], decode, port, procs.failure_router_args(kind))
        metrics_port = int(argv[argv.index("--prometheus-port") + 1])
        c.router = procs.Proc(f"router-{kind}", argv, logdir)
        c.router_kind, c.router_port = kind, port
        procs.wait_until(lambda: procs.http_get(port, "/health") == 200, 60, kind, c.router)
        # One request through both engines: the router reaches them (it fails, as all will).
        procs.wait_until(
            lambda: procs.http_post(port, "/generate", procs.probe_body()) == 502,
            30,
            f"{kind} first request",
            c.router,
        )
        yield c, metrics_port
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(logdir, ignore_errors=True)


def records(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/records", timeout=30) as resp:
        return orjson.loads(resp.read())


SAMPLE = re.compile(r"^(trio_pd_aborts_total|trio_pd_legs_cancelled_total)\{([^}]*)\} (\S+)$", re.M)
RESULT = re.compile(r'result="([^"]+)"')


def abort_counters(metrics_port: int) -> dict[str, float]:
    """The router's `trio_pd_aborts_total` by result (summed over roles), and
    `legs_cancelled`: every leg cancelled while its request was out (one abort job each)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, labels, value in SAMPLE.findall(text):
        found = RESULT.search(labels)
        key = found.group(1) if name == "trio_pd_aborts_total" and found else "legs_cancelled"
        out[key] = out.get(key, 0.0) + float(value)
    return out


# ---- one (mode, rate) -----------------------------------------------------------------------
def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy recording the router through the load (`--profile`; bench/profile.py reads it)."""
    spy = shutil.which("py-spy") or str(procs.VENV_BIN / "py-spy")
    argv = [spy, "record", "--native", "--format", "raw", "--pid", str(pid), "--duration",
            str(max(1, int(seconds))), "--rate", "200", "--output", str(out)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(mode: str, rate: float, seconds: float, profile: bool = False) -> dict[str, Any]:
    with started(mode) as (c, metrics_port):
        assert c.router is not None
        before = abort_counters(metrics_port)
        cpu0 = cpu.tree_cpu(c.router.pid)
        t0 = time.monotonic() + 0.2
        spy = None
        if profile:
            output.RESULTS.mkdir(parents=True, exist_ok=True)
            raw = output.RESULTS / f"{NAME}-profile-{mode}-{rate:g}.raw"
            spy = py_spy(c.router.pid, seconds, raw)
        client = drive(c.router_port, rate, seconds, t0)
        if spy is not None:
            spy.wait(30)
            print_flush(f"  profile: python -m bench.profile --summarize {raw}")
        t_load_end = time.monotonic()
        time.sleep(REPEAT_WAIT)
        settled = settle(metrics_port) - t_load_end
        router_cpu = cpu.tree_cpu(c.router.pid) - cpu0
        after = abort_counters(metrics_port)
        prefill, decode = records(c.prefill.port), records(c.decode.port)
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    window = (t0, t_load_end)
    row = summarize(mode, rate, seconds, client, window, prefill, decode, counters, router_cpu)
    row["settle_s"] = round(settled, 1)
    return row


def settle(metrics_port: int) -> float:
    """Wait until the router has sent no abort for a second (a saturated router is still
    working through its queue after the load); returns when it settled."""
    deadline = time.monotonic() + SETTLE_MAX
    last = None
    while time.monotonic() < deadline:
        counters = abort_counters(metrics_port)
        done = sum(counters.get(k, 0.0) for k in ("sent", "failed", "dropped"))
        if done == last:
            return time.monotonic() - 1.0
        last = done
        time.sleep(1.0)
    return time.monotonic()


def summarize(
    mode: str, rate: float, seconds: float, client: OpenLoop, window: tuple[float, float],
    prefill: dict[str, Any], decode: dict[str, Any], counters: dict[str, float], router_cpu: float,
) -> dict[str, Any]:  # fmt: skip
    t0, t1 = window
    failures = {rid: t for rid, t in prefill["failures"].items() if t0 <= t <= t1}
    first: dict[str, float] = {}
    freed: dict[str, float] = {}
    posts = 0
    for rid, t, did_free in decode["aborts"]:
        if rid not in failures:
            continue
        posts += 1
        first.setdefault(rid, t)
        if did_free:
            freed[rid] = t
    got = [rid for rid, t in decode["received"].items() if t0 <= t <= t1]
    held_end = sum(1 for rid in decode["held"] if rid in failures)
    sent = [r for r in client.records if r[1] > 0]
    answered = [r for r in sent if r[2] > 0]
    ends = [r[1] for r in sent]
    achieved = (len(sent) - 1) / (max(ends) - min(ends)) if len(ends) > 1 else None
    abort_lat = [first[rid] - failures[rid] for rid in first]
    freed_lat = [freed[rid] - failures[rid] for rid in freed]
    n = len(client.records)
    return {
        "mode": mode,
        "rate": rate,
        "seconds": seconds,
        "achieved": round(achieved, 1) if achieved else None,
        "sent": len(sent),
        "failed": sum(1 for r in answered if not 200 <= r[3] < 300),
        "client_limit": client.refused,
        "decode_got": len(got),
        "prefill_failures": len(failures),
        "legs_cancelled": counters.get("legs_cancelled", 0.0),
        "rids_aborted": len(first),
        "not_posted": counters.get("legs_cancelled", 0.0) - len(first),
        "got_not_freed": sum(1 for rid in got if rid not in freed),
        "posts": posts,
        "dropped": counters.get("dropped", 0.0),
        "failed_posts": counters.get("failed", 0.0),
        "sent_posts": counters.get("sent", 0.0),
        "coalesced": counters.get("coalesced", 0.0),
        "abort_p50_ms": stats.ms(pct(abort_lat, 50)),
        "abort_p99_ms": stats.ms(pct(abort_lat, 99)),
        "freed_p99_ms": stats.ms(pct(freed_lat, 99)),
        "freed_by_first": sum(1 for rid in freed if freed[rid] == first.get(rid)),
        "held_end": held_end,
        "router_cpu_s": round(router_cpu, 2),
        "cpu_ms_per_req": round(1000 * router_cpu / n, 3) if n else None,
        "client_p50_ms": stats.ms(pct([r[2] - r[1] for r in answered], 50)),
        "client_p99_ms": stats.ms(pct([r[2] - r[1] for r in answered], 99)),
    }


def run(
    rates: list[float], seconds: float, modes: list[str], repeat: int = 1, profile: bool = False
) -> dict[str, Any]:
    """Every (mode, rate) `repeat` times, interleaved (the machine's noise spreads over all),
    and their medians."""
    rows = []
    for rep in range(repeat):
        for rate in rates:
            for mode in modes:
                row = measure(mode, rate, seconds, profile)
                row["rep"] = rep
                print_flush(
                    f"  {mode} @ {rate:g}/s: sent {row['sent']} (achieved {row['achieved']}/s), "
                    f"aborted {row['rids_aborted']}/{row['legs_cancelled']:g} rids, "
                    f"dropped {row['dropped']:g}, p50/p99 {row['abort_p50_ms']}/"
                    f"{row['abort_p99_ms']} ms, held at end {row['held_end']}, "
                    f"router CPU {row['router_cpu_s']} s"
                )
                rows.append(row)
    return {
        "scenario": NAME,
        "settings": {
            "rates": rates,
            "seconds": seconds,
            "hold_secs": HOLD_SECS,
            "modes": modes,
            "repeat": repeat,
        },
        "runs": rows,
        "rows": medians(rows, rates, modes),
    }


def medians(rows: list[dict[str, Any]], rates: list[float], modes: list[str]) -> list[dict]:
    """One row per (mode, rate): the median of each figure over the repetitions."""
    out = []
    for rate in rates:
        for mode in modes:
            reps = [r for r in rows if r["mode"] == mode and r["rate"] == rate]
            row: dict[str, Any] = {"mode": mode, "rate": rate, "reps": len(reps)}
            for key, value in reps[0].items():
                if key in row or key == "rep":
                    continue
                if isinstance(value, (int, float)) or value is None:
                    row[key] = stats.median(r[key] for r in reps)
                else:
                    row[key] = value
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100 and 500 req/s, 3 s each")
    parser.add_argument("--rates", default=None, help="comma-separated req/s")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--modes", default="aborts,noabort")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; quick 1)")
    parser.add_argument("--profile", action="store_true", help="py-spy the router (pip install)")
    args = parser.parse_args(argv)
    default_rates = "100,500" if args.quick else "100,250,500,750"
    rates = [float(r) for r in (args.rates or default_rates).split(",")]
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    repeat = args.repeat or (1 if args.quick else 3)
    result = run(rates, seconds, modes, repeat, args.profile)
    result["quick"] = args.quick
    title = f"aborts at storm rate ({seconds:g} s per rate, medians of {repeat})"
    output.report(NAME, result, COLUMNS, title)


if __name__ == "__main__":
    main()
