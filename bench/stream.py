"""Scenarios `stream` and `stream-paced`.

- `stream`: decode streams 256 tokens with no delay, 32 concurrent streams: tokens/s through the
  router vs straight at the engines (the client doing the PD dance).
- `stream-paced`: 128 concurrent streams, 20 ms between tokens: the router's CPU per relayed
  event and the inter-token latency it adds (p50/p99 of the gaps between SSE events, router
  minus direct).
"""

from __future__ import annotations

from typing import Any

from bench.harness import output, procs
from bench.harness.output import print_flush

COLUMNS = {
    "stream": (
        "router", "c", "tokens_per_s", "direct_tokens_per_s", "ratio", "ttft_p50_ms",
        "direct_ttft_p50_ms", "cpu_us_per_event", "loadgen_cores", "machine_busy",
    ),
    "stream-paced": (
        "router", "c", "itl_p50_ms", "itl_p99_ms", "direct_itl_p50_ms", "direct_itl_p99_ms",
        "added_itl_p50_ms", "added_itl_p99_ms", "cpu_us_per_event", "loadgen_cores",
        "machine_busy",
    ),
}  # fmt: skip


def params(name: str, quick: bool) -> dict[str, Any]:
    if name == "stream":
        return {"c": 32, "tokens": 256, "itm": 0.0, "duration": 3.0 if quick else 6.0}
    # 64 tokens x 20 ms = ~1.3 s per stream
    return {"c": 128, "tokens": 64, "itm": 20.0, "duration": 4.0 if quick else 8.0}


def run(router: str, quick: bool = False, name: str = "stream") -> dict[str, Any]:
    p = params(name, quick)
    body = {
        "text": "Tell me a long story",
        "sampling_params": {"max_new_tokens": p["tokens"]},
        "stream": True,
    }
    decode_args = ["--max-running", "512", "--inter-token-ms", str(p["itm"])]
    paced = name == "stream-paced"
    with procs.cluster(router, decode_args=decode_args) as c:
        base = dict(
            path="/generate", body=body, concurrency=p["c"], duration=p["duration"],
            warmup=2.0 if paced else 1.0, itl=paced,
        )  # fmt: skip
        via, direct, cpu = procs.router_and_direct(c, **base)
    events = via["events"]
    row = {
        "router": router,
        "c": p["c"],
        "tokens": p["tokens"],
        "inter_token_ms": p["itm"],
        "ok": via["ok"],
        "status": via["status"],
        "direct_status": direct["status"],
        "tokens_per_s": via["events_per_s"],
        "direct_tokens_per_s": direct["events_per_s"],
        "ratio": round(via["events_per_s"] / direct["events_per_s"], 3)
        if direct["events_per_s"]
        else None,
        "ttft_p50_ms": via["ttft_p50_ms"],
        "direct_ttft_p50_ms": direct["ttft_p50_ms"],
        "itl_p50_ms": via["itl_p50_ms"],
        "itl_p99_ms": via["itl_p99_ms"],
        "direct_itl_p50_ms": direct["itl_p50_ms"],
        "direct_itl_p99_ms": direct["itl_p99_ms"],
        "added_itl_p50_ms": _sub(via["itl_p50_ms"], direct["itl_p50_ms"]),
        "added_itl_p99_ms": _sub(via["itl_p99_ms"], direct["itl_p99_ms"]),
        "router_cpu_s": cpu.get("router"),
        "cpu_us_per_event": round(1e6 * cpu["router"] / events, 1) if events else None,
        "loadgen_cores": round(via["loadgen_cpu_s"] / p["duration"], 3),
        "machine_busy": round(cpu["machine"] / p["duration"], 2),
    }
    print_flush(
        f"  {name} {router}: {row['tokens_per_s']} tok/s (direct {row['direct_tokens_per_s']}), "
        f"itl p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms "
        f"(direct {row['direct_itl_p50_ms']}/{row['direct_itl_p99_ms']}), "
        f"router {row['cpu_us_per_event']} us CPU/event"
    )
    return {"scenario": name, "router": router, "quick": quick, "rows": [row]}


def run_paced(router: str, quick: bool = False) -> dict[str, Any]:
    return run(router, quick, "stream-paced")


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    row = result["rows"][0]
    if result["scenario"] == "stream":
        return {
            "stream tokens/s": row["tokens_per_s"],
            "stream vs direct": row["ratio"],
            "stream CPU us/event": row["cpu_us_per_event"],
        }
    return {
        "paced itl p50 ms": row["itl_p50_ms"],
        "paced itl p99 ms": row["itl_p99_ms"],
        "paced added itl p99 ms": row["added_itl_p99_ms"],
        "paced CPU us/event": row["cpu_us_per_event"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = procs.scenario_parser(__doc__)
    parser.add_argument("--paced", action="store_true", help="run stream-paced instead")
    args = parser.parse_args(argv)
    name = "stream-paced" if args.paced else "stream"
    result = run(args.router, args.quick, name)
    output.report(name, result, COLUMNS[name], name)


if __name__ == "__main__":
    main()
