"""Entry point: `python -m bench run [--quick] [--routers ...] [--scenarios ...] [--repeat N]
[--peers] [--publish]`.

Every selected scenario runs on the harness (bench/harness/run.py): its routers alternate inside
each repetition (so slow drifts of a shared machine hit all of them alike), each figure is also
taken against the baseline measured in the same repetition (the first router; router-bound's
floor), and each scenario prints its tables and writes one JSON under bench/results/. Then, with
more than one router or repetition, one side-by-side table of every scenario's medians with
ratios to the first router, a combined `bench-*.json` and the storm PNG. `--publish` writes the
summaries of storm and router-bound under bench/published/ (`python -m bench.publish` then
rewrites docs/benchmarks.md and the README from them).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback
from typing import Any

from bench import overhead, router_bound, soak, storm, stream, teardown, wide
from bench.harness import output, procs
from bench.harness import run as harness
from bench.harness.output import print_flush
from bench.report import plot_storm, side_by_side

SCENARIOS: dict[str, harness.Scenario] = {
    "overhead": harness.adapted("overhead", "instant engines, closed loop", overhead.run,
                                overhead.summary),
    "stream": harness.adapted("stream", "32 streams of 256 tokens", stream.run, stream.summary),
    "stream-paced": harness.adapted("stream-paced", "128 streams, 20 ms between tokens",
                                    stream.run_paced, stream.summary),
    "teardown": harness.adapted("teardown", "one failure per case", teardown.run,
                                teardown.summary),
    "soak": harness.adapted("soak", "mixed endpoints with faults", soak.run, soak.summary),
    "wide": harness.adapted("wide", "1000 concurrent streams", wide.run, wide.summary),
    "storm": storm.SCENARIO,
    "router-bound": router_bound.SCENARIO,
}  # fmt: skip
# The per-run tables of the scenarios that keep their own rows, and the side-by-side tables.
COLUMNS: dict[str, Any] = {
    "overhead": overhead.COLUMNS, "stream": stream.COLUMNS["stream"],
    "stream-paced": stream.COLUMNS["stream-paced"], "teardown": teardown.COLUMNS,
    "wide": wide.COLUMNS,
    "soak": ("router", "requests", "ok", "rss_start_mb", "rss_end_mb", "rss_idle_mb", "fds_max",
             "fds_idle", "tcp_max", "tcp_idle"),
}  # fmt: skip
COMPARE = {"teardown": teardown.compare}
PUBLISHED = ("storm", "router-bound")  # the scenarios docs/benchmarks.md is written from
# `wide` (1000 concurrent streams) runs on request: `--scenarios wide`.
DEFAULT_SCENARIOS = (
    "overhead", "stream", "stream-paced", "teardown", "storm", "soak", "router-bound",
)  # fmt: skip
PEER_SCENARIOS = ("overhead", "stream", "stream-paced", "teardown", "storm", "router-bound")


def run(args: argparse.Namespace) -> int:
    routers = args.routers.split(",") if args.routers else ["trio_pd"]
    scenarios = args.scenarios.split(",") if args.scenarios else list(DEFAULT_SCENARIOS)
    for name in scenarios:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    routers = procs.usable_routers(routers)
    started = time.monotonic()
    print_flush(f"trio_pd bench: routers {routers}, scenarios {scenarios}, repeat {args.repeat}, "
                f"quick={args.quick}; {output.meta()}")  # fmt: skip
    wrk = shutil.which("wrk") or "not installed"
    print_flush(f"load generators: Python raw-socket clients (bench/httpc.py), wrk: {wrk}")
    summaries: dict[str, list[dict[str, Any]]] = {
        r: [{} for _ in range(args.repeat)] for r in routers
    }
    failures: list[str] = []
    done: dict[str, dict[str, Any]] = {}
    for name in scenarios:
        if name == "router-bound" and wrk == "not installed":
            failures.append("router-bound: wrk is not installed (apt-get install wrk)")
            continue
        scenario = SCENARIOS[name]
        try:
            result = harness.run(scenario, routers, args.repeat, args.quick)
        except Exception as exc:  # one broken scenario must not sink the others
            traceback.print_exc()
            failures.append(f"{name}: {exc!r}")
            continue
        done[name] = result
        failures += [f"{name} {failure}" for failure in result["failures"]]
        labels = scenario.metrics
        for rep, flat in enumerate(result["per_repetition"]):
            for router, metrics in flat.items():
                if router in summaries:
                    summaries[router][rep].update({f"{name} {labels[k]}" if labels else k: v
                                                   for k, v in metrics.items()
                                                   if not labels or k in labels})  # fmt: skip
        if args.publish and name in PUBLISHED:
            print_flush("published:", harness.publish(scenario, result))
        print_flush("")
    for name, result in done.items():
        if name in COLUMNS:
            rows = [row for r in result["runs"] for row in r["rows"]]
            print_flush(output.table(rows, COLUMNS[name], f"== {name} =="), "\n")
        if name in COMPARE and len(routers) > 1:
            by_router: dict[str, list[dict[str, Any]]] = {}
            for r in result["runs"]:
                by_router.setdefault(r["target"], []).append(r)
            print_flush(COMPARE[name](by_router), "\n")
    combined: dict[str, Any] = {
        "routers": routers, "scenarios": scenarios, "repeat": args.repeat, "quick": args.quick,
        "summaries": summaries, "failures": failures,
        "results_files": {name: r["results_file"] for name, r in done.items()},
    }  # fmt: skip
    if len(routers) > 1 or args.repeat > 1:
        text, rows = side_by_side(summaries, reference=routers[0])
        print_flush(text)
        combined["side_by_side"] = rows
    if "storm" in done:
        last = {r["target"]: r for r in done["storm"]["runs"] if r["repetition"] == args.repeat}
        if last:
            print_flush("storm plot:", plot_storm(last, done["storm"]["settings"]))
    print_flush("results:", output.write_result("bench", combined))
    print_flush(f"total {time.monotonic() - started:.0f} s")
    for failure in failures:
        print_flush("FAILED:", failure)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("run", help="run scenarios")
    p.add_argument("--quick", action="store_true", help="short runs (make bench)")
    p.add_argument("--routers", default="trio_pd", help=f"comma list of {','.join(procs.ROUTERS)}")
    p.add_argument("--scenarios", default=None, help=f"comma list of {','.join(SCENARIOS)}")
    p.add_argument("--repeat", type=int, default=None, help="default 1 (--peers: 3)")
    p.add_argument(
        "--peers",
        action="store_true",
        help="trio_pd, trio_pd_w2, smg, mini_lb; the peer scenarios; 3 repetitions "
        "(make bench-peers)",
    )
    p.add_argument(
        "--publish",
        action="store_true",
        help="write bench/published/<scenario>.json for storm and router-bound (full runs)",
    )
    args = parser.parse_args(argv)
    if args.peers:
        args.routers = args.routers if args.routers != "trio_pd" else ",".join(procs.PEER_ROUTERS)
        args.scenarios = args.scenarios or ",".join(PEER_SCENARIOS)
    if args.repeat is None:
        args.repeat = 3 if args.peers else 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
