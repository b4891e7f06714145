"""Scenario `storm`: half the prefills fail while the decode engine is the scarce resource.

Decode: 16 slots (--max-running 16), a 30 s waiting timeout, disconnect poll every 4 s, requests
of 50 tokens at 10 ms per token (~0.5 s of decode). Open loop at 20 req/s for 60 s (--quick:
15 s). Two prefill engines, one healthy and one answering every request with status 500
(`--fault prefill:500`), round robin (mini_lb: random), so half the prefills fail for every
router (SMG drops a request's `sim_fault` field, so engine-wide faults are the common ground).
Retries and breakers off on every router; health checks see both prefills healthy.

Reports goodput (successful requests per second of the run), p50/p99 latency of the successful
requests, the client wait of the failed ones, and the decode slot-seconds wasted on doomed
requests (slots held by requests whose slot was not freed with reason `finished`, from the decode
engine's event log), all also as per-second series (by completion second; slots by occupancy).
`doomed_slots` counts those slots, `wasted_per_doomed_ms` is their mean hold and `freed_by` says
what freed them (as in teardown: `abort` = the router's POST /abort_request, `poll` = the
engine's 4 s disconnect poll, `timeout` = the waiting timeout, `held` = still held at the end).
A doomed request that never got a slot (it queued behind 16 busy ones and was cancelled first)
wastes none and is not counted.

With trio_pd (which aborts cancelled legs) and trio_pd_noabort (`--no-abort-on-cancel`) in one
run, `compare` puts them side by side: without aborts each doomed slot is held until the next
poll tick (0-4 s, 2 s on average), about 10 doomed requests a second against 16 slots, so the
successes queue behind them.

One harness run (bench/harness/run.py): the routers alternate, trio_pd is the same-run baseline.

    .venv/bin/python -m bench.storm [--quick] [--routers trio_pd,smg,...] [--repeat N] [--publish]
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

from bench import stats, teardown
from bench.harness import procs, run
from bench.harness.cpu import CpuMeter
from bench.harness.output import print_flush
from bench.harness.run import Phase, Scenario, Verdict
from bench.loadgen import open_loop
from bench.stats import pct

NAME = "storm"
LOAD = (
    "20 req/s open loop of non-stream /generate (50 tokens at 10 ms) for 60 s (--quick 15), "
    "two simulated prefills of which one answers every request with 500, round robin (mini_lb: "
    "random); a decode of 16 slots, a 30 s KV waiting timeout and SGLang's 4 s disconnect poll; "
    "retries and breakers off on every router"
)
FREED_BY = {**teardown.FREED_BY, "held at end": "held"}
SERIES_COLUMNS = ("t", "sent", "ok", "failed", "p50_ms", "p99_ms", "wasted_slots", "useful_slots")


def settings(quick: bool) -> dict[str, Any]:
    return {
        "rate": 20.0,
        "seconds": 15.0 if quick else 60.0,
        "fail_ratio": 0.5,
        "tokens": 50,
        "inter_token_ms": 10.0,
        "max_running": 16,
        "waiting_timeout": 30.0,
        "disconnect_poll_secs": 4.0,  # like SGLang
        "client_timeout": 45.0,
    }


def storm_body(tokens: int) -> Callable[[int], dict[str, Any]]:
    return lambda i: {"text": f"storm request {i}", "sampling_params": {"max_new_tokens": tokens}}


def slot_intervals(events: list[dict[str, Any]], t0: float, t_end: float):
    acquired: dict[Any, float] = {}
    out = []
    for e in events:
        if e["event"] == "slot_acquired":
            acquired[e["room"]] = e["t"] - t0
        elif e["event"] == "slot_freed" and e["room"] in acquired:
            out.append((acquired.pop(e["room"]), e["t"] - t0, e.get("reason")))
    out.extend((start, t_end, "held at end") for start in acquired.values())
    return out


def series(records: list[dict[str, Any]], slots: list[Any], horizon: float) -> list[dict]:
    n = math.ceil(horizon)
    rows = [
        {"t": k, "sent": 0, "ok": 0, "failed": 0, "lat": [], "wasted": 0.0, "useful": 0.0}
        for k in range(n)
    ]
    for r in records:
        if 0 <= r["t_send"] < n:
            rows[int(r["t_send"])]["sent"] += 1
        k = int(r["t_end"])
        if 0 <= k < n:
            if r["ok"]:
                rows[k]["ok"] += 1
                rows[k]["lat"].append(r["t_end"] - r["t_send"])
            else:
                rows[k]["failed"] += 1
    for start, end, reason in slots:
        key = "useful" if reason == "finished" else "wasted"
        for k in range(max(0, int(start)), min(n, math.ceil(end))):
            overlap = min(end, k + 1) - max(start, k)
            if overlap > 0:
                rows[k][key] += overlap
    out = []
    for row in rows:
        lat = row.pop("lat")
        row["p50_ms"] = stats.ms(pct(lat, 50))
        row["p99_ms"] = stats.ms(pct(lat, 99))
        row["wasted_slots"] = round(row.pop("wasted"), 2)
        row["useful_slots"] = round(row.pop("useful"), 2)
        out.append(row)
    return out


def measure(router: str, s: dict[str, Any]) -> dict[str, Any]:
    """One storm through `router` with fresh engines; its metrics and per-second series."""
    decode_args = [
        "--max-running", str(s["max_running"]), "--waiting-timeout", str(s["waiting_timeout"]),
        "--inter-token-ms", str(s["inter_token_ms"]),
        "--disconnect-poll-secs", str(s["disconnect_poll_secs"]),
    ]  # fmt: skip
    with procs.cluster(
        router,
        decode_args=decode_args,
        router_args=procs.failure_router_args(router),
        prefill2_args=["--fault", "prefill:500"],
    ) as c:
        assert c.router is not None
        meter = CpuMeter({"router": c.router.pid})
        t0 = time.monotonic() + 0.2
        c0 = time.process_time()
        meter.start()
        records = trio.run(open_loop, c.router_port, "/generate", storm_body(s["tokens"]),
                           s["rate"], s["seconds"], s["client_timeout"], t0)  # fmt: skip
        meter.stop()
        loadgen_cpu = time.process_time() - c0
        t_stop = time.monotonic() - t0
        slots = slot_intervals(c.decode.events(), t0, t_stop)
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    lat = [r["t_end"] - r["t_send"] for r in ok]
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r["error"] or r["status"])
        statuses[key] = statuses.get(key, 0) + 1
    doomed = [(b, e, reason) for b, e, reason in slots if reason != "finished"]
    wasted = sum(e - b for b, e, _ in doomed)
    metrics = {
        "sent": len(records),
        "ok": len(ok),
        "goodput": round(len(ok) / s["seconds"], 2),
        "ok_p50_ms": stats.ms(pct(lat, 50)),
        "ok_p99_ms": stats.ms(pct(lat, 99)),
        "fail_wait_p50_ms": stats.ms(pct([r["t_end"] - r["t_send"] for r in failed], 50)),
        "wasted_slot_s": round(wasted, 1),
        "doomed_slots": len(doomed),
        "wasted_per_doomed_ms": stats.ms(wasted / len(doomed)) if doomed else None,
        "freed_by": teardown.tally([FREED_BY.get(reason, reason) for _, _, reason in doomed]),
        "useful_slot_s": round(sum(e - b for b, e, why in slots if why == "finished"), 1),
        "router_cpu_s": meter.result.get("router"),
        "loadgen_cpu_s": round(loadgen_cpu, 2),
    }
    m = metrics
    print_flush(
        f"  storm {router}: goodput {m['goodput']} req/s ({m['ok']} ok of {len(records)}), "
        f"p50/p99 {m['ok_p50_ms']}/{m['ok_p99_ms']} ms, wasted {m['wasted_slot_s']} slot-s "
        f"({len(doomed)} doomed slots freed by {m['freed_by']})"
    )
    horizon = max([s["seconds"]] + [r["t_end"] for r in records])
    return {"metrics": metrics, "statuses": statuses, "series": series(records, slots, horizon)}


SCENARIO = Scenario(
    name=NAME,
    load=LOAD,
    settings=settings,
    phases=(Phase("storm", list, measure),),
    baseline="trio_pd",
    metrics={
        "goodput": "goodput (req/s; 10 is all there is)",
        "ok_p50_ms": "successes p50 (ms)",
        "ok_p99_ms": "successes p99 (ms)",
        "fail_wait_p50_ms": "failed clients' wait p50 (ms)",
        "wasted_slot_s": "decode slot-seconds held by doomed requests",
        "doomed_slots": "doomed requests that held a slot",
        "wasted_per_doomed_ms": "mean hold of a doomed request's slot (ms)",
        "freed_by": "what freed the doomed slots",
        "router_cpu_s": "router CPU (s)",
    },
    verdicts=(
        Verdict("goodput: trio_pd (of 10 req/s)", "goodput", "trio_pd", None, "at_least", 9.5,
                ">= 9.5 req/s"),
        Verdict("slot-seconds held by doomed requests: trio_pd", "wasted_slot_s", "trio_pd", None,
                "value", 5.0, "<= 5 slot-s"),
    ),
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return run.main(SCENARIO, __doc__, argv, routers="trio_pd,trio_pd_noabort,smg,mini_lb",
                    repeat=3)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
