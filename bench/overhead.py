"""Scenario `overhead`: instant engines, non-streaming /generate, closed loop at concurrency 1, 32
and 256, through the router and straight at the engines (the client doing the PD dance itself).

Reports req/s, p50/p99 latency, the router's added p50 latency, and the router's CPU time per
request (psutil, the router process and its children, e.g. `--workers 2`). When wrk is installed,
the same closed loop is repeated with wrk (bench/wrk/generate.lua) as a cross-check of the Python
load generator (columns wrk_rps, wrk_p50_ms).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from bench.harness import output, procs
from bench.harness.output import print_flush

NAME = "overhead"
BODY = {
    "text": "The quick brown fox jumps over the lazy dog",
    "sampling_params": {"max_new_tokens": 16},
}
COLUMNS = (
    "router", "c", "rps", "p50_ms", "p99_ms", "direct_rps", "direct_p50_ms", "direct_p99_ms",
    "added_p50_ms", "cpu_ms_per_req", "loadgen_ms_per_req", "machine_busy", "wrk_rps",
    "wrk_p50_ms",
)  # fmt: skip


def levels(quick: bool) -> tuple[int, ...]:
    return (1, 32, 256)


def run(router: str, quick: bool = False, wrk: bool = True) -> dict[str, Any]:
    duration, warmup = (3.0, 1.0) if quick else (6.0, 2.0)
    rows = []
    with procs.cluster(router, decode_args=["--max-running", "1024"]) as c:
        for conc in levels(quick):
            base = dict(
                path="/generate", body=BODY, concurrency=conc, duration=duration, warmup=warmup
            )
            via, direct, cpu = procs.router_and_direct(c, **base)
            cross = wrk_check(c.router_port, conc, duration) if wrk else None
            row = {
                "router": router,
                "c": conc,
                "rps": via["rps"],
                "p50_ms": via["p50_ms"],
                "p99_ms": via["p99_ms"],
                "ok": via["ok"],
                "status": via["status"],
                "direct_rps": direct["rps"],
                "direct_p50_ms": direct["p50_ms"],
                "direct_p99_ms": direct["p99_ms"],
                "direct_status": direct["status"],
                "added_p50_ms": _sub(via["p50_ms"], direct["p50_ms"]),
                "added_p99_ms": _sub(via["p99_ms"], direct["p99_ms"]),
                "router_cpu_s": cpu.get("router"),
                "cpu_ms_per_req": _per(cpu["router"], via["ok"]),
                "engines_cpu_s": round(cpu["prefill"] + cpu["decode"], 3),
                "loadgen_cpu_s": via["loadgen_cpu_s"],
                "loadgen_cores": round(via["loadgen_cpu_s"] / duration, 3),
                "loadgen_ms_per_req": _per(via["loadgen_cpu_s"], via["ok"]),
                "direct_loadgen_cores": round(direct["loadgen_cpu_s"] / duration, 3),
                "machine_busy": round(cpu["machine"] / duration, 2),
                **(cross or {}),
            }
            rows.append(row)
            print_flush(
                f"  overhead {router} c={conc}: {row['rps']} req/s p50 {row['p50_ms']} ms "
                f"(direct {row['direct_rps']} req/s p50 {row['direct_p50_ms']} ms), "
                f"router {row['cpu_ms_per_req']} ms CPU/req"
            )
    return {"scenario": NAME, "router": router, "quick": quick, "rows": rows}


def wrk_check(port: int, conc: int, duration: float) -> dict[str, Any] | None:
    """The same closed loop with wrk (C, 2 threads), when installed: req/s and p50/p99."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    threads = min(2, conc)
    argv = [
        wrk, f"-t{threads}", f"-c{conc}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
        "-s", str(output.BENCH / "wrk" / "generate.lua"), f"http://{procs.HOST}:{port}",
    ]  # fmt: skip
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            data = json.loads(line[len("WRK_JSON ") :])
            secs = data["duration_us"] / 1e6
            good = data["requests"] - data["non2xx"]
            return {
                "wrk_rps": round(good / secs, 1) if secs else None,
                "wrk_p50_ms": round(data["p50_us"] / 1000, 3),
                "wrk_p99_ms": round(data["p99_us"] / 1000, 3),
                "wrk_errors": data["non2xx"] + data["connect"] + data["read"] + data["timeout"],
            }
    return None


def _per(cpu_s: float | None, count: int) -> float | None:
    return round(1000.0 * cpu_s / count, 3) if cpu_s is not None and count else None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Flat metrics for the side-by-side table."""
    out: dict[str, Any] = {}
    for row in result["rows"]:
        c = row["c"]
        out[f"overhead c{c} req/s"] = row["rps"]
        out[f"overhead c{c} p50 ms"] = row["p50_ms"]
        out[f"overhead c{c} p99 ms"] = row["p99_ms"]
        out[f"overhead c{c} added p50 ms"] = row["added_p50_ms"]
        out[f"overhead c{c} CPU ms/req"] = row["cpu_ms_per_req"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = procs.scenario_parser(__doc__).parse_args(argv)
    result = run(args.router, args.quick)
    output.report(NAME, result, COLUMNS, "overhead")


if __name__ == "__main__":
    main()
