"""Scenario `wide`: 1000 concurrent paced streams through one router worker.

Decode streams 6 tokens 1 s apart (a slow generation; 1000 events/s in all, which this 2-core
machine can carry) to 1000 clients at once; the router's RSS, fds and TCP connections are sampled
every half second. The issue's target: at most 100 MiB RSS
per router worker, and flat.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.harness import output, procs
from bench.harness.output import print_flush
from bench.loadgen import LoadSpec, run_load

NAME = "wide"
STREAMS = 1000
COLUMNS = (
    "router", "streams", "requests", "ok", "itl_p50_ms", "itl_p99_ms", "rss_idle_mb",
    "rss_max_mb", "rss_end_mb", "fds_max", "tcp_max",
)  # fmt: skip


def run(router: str, quick: bool = False) -> dict[str, Any]:
    duration = 8.0 if quick else 16.0
    body = {
        "text": "wide fan of streams",
        "sampling_params": {"max_new_tokens": 80},
        "stream": True,
    }
    decode_args = ["--max-running", "2048", "--inter-token-ms", "50"]
    samples: list[dict[str, Any]] = []
    with procs.cluster(router, decode_args=decode_args) as c:
        idle = procs.router_rss(c)
        result: dict[str, Any] = {}
        spec = LoadSpec(
            mode="router", path="/generate", body=body, concurrency=STREAMS, duration=duration,
            warmup=1.0, router_port=c.router_port, itl=True,
        )  # fmt: skip
        loader = threading.Thread(target=lambda: result.update(run_load(spec)))
        t0 = time.monotonic()
        loader.start()
        while loader.is_alive():
            samples.append({"t": round(time.monotonic() - t0, 1), **procs.router_rss(c)})
            loader.join(0.5)
    row = {
        "router": router,
        "streams": STREAMS,
        "requests": result.get("requests"),
        "ok": result.get("ok"),
        "itl_p50_ms": result.get("itl_p50_ms"),
        "itl_p99_ms": result.get("itl_p99_ms"),
        "rss_idle_mb": idle["rss_mb"],
        "rss_max_mb": max(s["rss_mb"] for s in samples),
        "rss_end_mb": samples[-1]["rss_mb"],
        "fds_max": max(s["fds"] for s in samples),
        "tcp_max": max(s["tcp"] for s in samples),
    }
    print_flush(
        f"  wide {router}: {row['ok']} ok streams, RSS {row['rss_idle_mb']} idle -> max "
        f"{row['rss_max_mb']} MB, fds max {row['fds_max']}, tcp max {row['tcp_max']}"
    )
    return {"scenario": NAME, "router": router, "quick": quick, "rows": [row], "series": samples}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    row = result["rows"][0]
    return {"wide 1000 streams RSS max MB": row["rss_max_mb"]}


def main(argv: list[str] | None = None) -> None:
    args = procs.scenario_parser(__doc__).parse_args(argv)
    result = run(args.router, args.quick)
    output.report(NAME, result, COLUMNS, NAME)


if __name__ == "__main__":
    main()
