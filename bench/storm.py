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
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
import trio

from bench import common, stats, teardown
from bench.common import CpuMeter, print_flush
from bench.httpc import one_request
from bench.loadgen import sleep_until
from bench.stats import pct

NAME = "storm"
COLUMNS = (
    "router", "rate", "seconds", "sent", "ok", "goodput", "good_ratio", "ok_p50_ms", "ok_p99_ms",
    "fail_wait_p50_ms", "wasted_slot_s", "doomed_slots", "wasted_per_doomed_ms", "freed_by",
    "useful_slot_s", "router_cpu_s", "loadgen_cpu_s",
)  # fmt: skip
# the side-by-side table (`compare`): row key -> label
COMPARE_METRICS = {
    "goodput": "goodput req/s",
    "ok": "successful requests",
    "ok_p50_ms": "successes p50 ms",
    "ok_p99_ms": "successes p99 ms",
    "fail_wait_p50_ms": "failed clients' wait p50 ms",
    "wasted_slot_s": "decode slot-s wasted (doomed)",
    "doomed_slots": "doomed requests holding a slot",
    "wasted_per_doomed_ms": "mean hold per doomed slot ms",
    "freed_by": "doomed slots freed by",
    "router_cpu_s": "router CPU s",
}
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


async def open_loop(port: int, s: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    count = int(s["rate"] * s["seconds"])
    records: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        b: dict[str, Any] = {
            "text": f"storm request {i}",
            "sampling_params": {"max_new_tokens": s["tokens"]},
        }
        reply = await one_request(
            common.HOST, port, "POST", "/generate", orjson.dumps(b), timeout=s["client_timeout"]
        )
        records.append(
            {
                "i": i,
                "t_send": reply.t_start - t0,
                "t_end": reply.t_end - t0,
                "status": reply.status,
                "error": reply.error,
                "ok": reply.ok,
            }
        )

    async with trio.open_nursery() as nursery:
        for i in range(count):
            await sleep_until(t0 + i / s["rate"])
            nursery.start_soon(one, i)
    return records


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


def run(router: str, quick: bool = False) -> dict[str, Any]:
    s = settings(quick)
    decode_args = [
        "--max-running", str(s["max_running"]), "--waiting-timeout", str(s["waiting_timeout"]),
        "--inter-token-ms", str(s["inter_token_ms"]),
        "--disconnect-poll-secs", str(s["disconnect_poll_secs"]),
    ]  # fmt: skip
    with common.cluster(
        router,
        decode_args=decode_args,
        router_args=common.failure_router_args(router),
        prefill2_args=["--fault", "prefill:500"],
    ) as c:
        meter = CpuMeter({"router": c.router.pid} if c.router else {})
        t0 = time.monotonic() + 0.2
        c0 = time.process_time()
        meter.start()
        records = trio.run(open_loop, c.router_port, s, t0)
        meter.stop()
        loadgen_cpu = time.process_time() - c0
        t_stop = time.monotonic() - t0
        slots = slot_intervals(c.decode.events(), t0, t_stop)
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    lat = [r["t_end"] - r["t_send"] for r in ok]
    good_intended = len(records) * (1 - s["fail_ratio"])
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r["error"] or r["status"])
        statuses[key] = statuses.get(key, 0) + 1
    doomed = [(b, e, reason) for b, e, reason in slots if reason != "finished"]
    wasted = sum(e - b for b, e, _ in doomed)
    useful = sum(e - b for b, e, reason in slots if reason == "finished")
    freed_by = teardown.tally([FREED_BY.get(reason, reason) for _, _, reason in doomed])
    row = {
        "router": router,
        "rate": s["rate"],
        "seconds": s["seconds"],
        "sent": len(records),
        "ok": len(ok),
        "goodput": round(len(ok) / s["seconds"], 2),
        "good_ratio": round(len(ok) / good_intended, 3) if good_intended else None,
        "ok_p50_ms": stats.ms(pct(lat, 50)),
        "ok_p99_ms": stats.ms(pct(lat, 99)),
        "fail_wait_p50_ms": stats.ms(pct([r["t_end"] - r["t_send"] for r in failed], 50)),
        "wasted_slot_s": round(wasted, 1),
        "doomed_slots": len(doomed),
        "wasted_per_doomed_ms": stats.ms(wasted / len(doomed)) if doomed else None,
        "freed_by": freed_by,
        "useful_slot_s": round(useful, 1),
        "statuses": statuses,
        "router_cpu_s": meter.result.get("router"),
        "loadgen_cpu_s": round(loadgen_cpu, 2),
        "wall_s": round(t_stop, 1),
    }
    horizon = max([s["seconds"]] + [r["t_end"] for r in records])
    print_flush(
        f"  storm {router}: goodput {row['goodput']} req/s ({row['ok']} ok of "
        f"{len(records)}, {row['good_ratio']} of the healthy prefill's share), "
        f"p50/p99 {row['ok_p50_ms']}/{row['ok_p99_ms']} ms, "
        f"wasted {row['wasted_slot_s']} slot-s ({len(doomed)} doomed slots freed by {freed_by})"
    )
    return {
        "scenario": NAME,
        "router": router,
        "quick": quick,
        "settings": s,
        "rows": [row],
        "series": series(records, slots, horizon),
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    row = result["rows"][0]
    return {
        "storm goodput req/s": row["goodput"],
        "storm ok p50 ms": row["ok_p50_ms"],
        "storm ok p99 ms": row["ok_p99_ms"],
        "storm fail wait p50 ms": row["fail_wait_p50_ms"],
        "storm wasted slot-s": row["wasted_slot_s"],
        "storm doomed slots": row.get("doomed_slots"),
    }


def compare(results: dict[str, list[dict[str, Any]]]) -> str:
    """The routers side by side (a row per metric, medians over the repetitions, ratios to the
    first router): the successes' latency and the decode slots the doomed requests held."""
    from bench.report import side_by_side

    summaries = {
        router: [{label: res["rows"][0].get(key) for key, label in COMPARE_METRICS.items()}
                 for res in reps]
        for router, reps in results.items()
    }  # fmt: skip
    text, _ = side_by_side(
        summaries, reference=next(iter(results)), title="== storm side by side =="
    )
    return text


def main(argv: list[str] | None = None) -> None:
    args = common.scenario_parser(__doc__).parse_args(argv)
    result = run(args.router, args.quick)
    print_flush(common.table(result["series"], SERIES_COLUMNS, "storm, per second"))
    common.report(NAME, result, COLUMNS, "storm")
    from bench.report import plot_storm

    print_flush("wrote", plot_storm({args.router: result}))


if __name__ == "__main__":
    main()
