"""Entry point: `python -m bench run [--quick] [--routers ...] [--scenarios ...] [--repeat N]`.

Runs every selected scenario for every selected router, alternating routers inside each
repetition (so slow drifts of a shared machine hit all of them alike), writes one JSON per
scenario run plus a combined `bench-*.json`, prints the per-scenario tables and, with more than one
router, the teardown and storm tables that put the routers side by side, one side-by-side table of
medians with ratios to the first router, and the storm PNG.

`storm` and `router-bound` run after the others on the harness (bench/harness/run.py): each
alternates its own targets and phases, takes its ratios against its same-run baseline (trio_pd;
the floor) and prints its own tables; `--publish` writes their summaries under bench/published/
(`python -m bench.publish` then rewrites docs/benchmarks.md and the README from them).
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

SCENARIOS: dict[str, Any] = {
    "overhead": (overhead.run, overhead.summary, overhead.COLUMNS),
    "stream": (stream.run, stream.summary, stream.COLUMNS["stream"]),
    "stream-paced": (stream.run_paced, stream.summary, stream.COLUMNS["stream-paced"]),
    "teardown": (teardown.run, teardown.summary, teardown.COLUMNS),
    "wide": (wide.run, wide.summary, wide.COLUMNS),
    "soak": (soak.run, soak.summary, ("router", "requests", "ok", "rss_start_mb", "rss_end_mb",
                                     "rss_idle_mb", "fds_max", "fds_idle", "tcp_max", "tcp_idle")),
}  # fmt: skip
# Scenarios with a table of their own that puts the routers side by side (with more than one).
COMPARE = {"teardown": teardown.compare}
# Scenarios on the harness: they run all their routers themselves.
WHOLE = {"storm": storm.SCENARIO, "router-bound": router_bound.SCENARIO}
# `wide` (1000 concurrent streams) runs on request: `--scenarios wide`.
DEFAULT_SCENARIOS = (
    "overhead", "stream", "stream-paced", "teardown", "storm", "soak", "router-bound",
)  # fmt: skip
PEER_SCENARIOS = ("overhead", "stream", "stream-paced", "teardown", "storm", "router-bound")


def run(args: argparse.Namespace) -> int:
    routers = args.routers.split(",") if args.routers else ["trio_pd"]
    scenarios = args.scenarios.split(",") if args.scenarios else list(DEFAULT_SCENARIOS)
    for name in scenarios:
        if name not in SCENARIOS and name not in WHOLE:
            choices = ", ".join([*SCENARIOS, *WHOLE])
            raise SystemExit(f"unknown scenario {name!r}; choose from {choices}")
    whole = [name for name in scenarios if name in WHOLE]
    scenarios = [name for name in scenarios if name not in WHOLE]
    routers = procs.usable_routers(routers)
    started = time.monotonic()
    print_flush(
        f"trio_pd bench: routers {routers}, scenarios {scenarios}, repeat {args.repeat}, "
        f"quick={args.quick}; {output.meta()}"
    )
    wrk = shutil.which("wrk") or "not installed"
    print_flush(
        f"load generator: Python raw-socket clients (bench/httpc.py); wrk cross-check: {wrk}"
    )
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {r: [] for r in routers} for s in scenarios
    }
    summaries: dict[str, list[dict[str, Any]]] = {
        r: [{} for _ in range(args.repeat)] for r in routers
    }
    failures = []
    for rep in range(args.repeat):
        for name in scenarios:
            runner = SCENARIOS[name][0]
            order = routers if rep % 2 == 0 else list(reversed(routers))
            for router in order:
                print_flush(f"[rep {rep + 1}/{args.repeat}] {name} / {router} ...")
                t0 = time.monotonic()
                try:
                    result = runner(router, args.quick)
                except Exception as exc:  # one broken router/scenario must not sink the run
                    traceback.print_exc()
                    failures.append(f"{name}/{router} rep {rep + 1}: {exc!r}")
                    continue
                result["elapsed_s"] = round(time.monotonic() - t0, 1)
                result["repetition"] = rep + 1
                output.write_result(f"{name}-{router}", result)
                results[name][router].append(result)
                summaries[router][rep].update(SCENARIOS[name][1](result))
    whole_results: dict[str, dict[str, Any]] = {}
    for name in whole:
        try:
            result = harness.run(WHOLE[name], routers, args.repeat, args.quick)
        except Exception as exc:
            traceback.print_exc()
            failures.append(f"{name}: {exc!r}")
            continue
        whole_results[name] = result
        failures += [f"{name} {failure}" for failure in result["failures"]]
        labels = WHOLE[name].metrics
        for rep, flat in enumerate(result["per_repetition"]):
            for router, metrics in flat.items():
                if router in routers:
                    summaries[router][rep].update(
                        {f"{name} {labels[k]}": v for k, v in metrics.items() if k in labels}
                    )
        if args.publish:
            print_flush("published:", harness.publish(WHOLE[name], result))
    print_flush("")
    for name in scenarios:
        rows = [row for r in routers for res in results[name][r] for row in res["rows"]]
        if rows:
            print_flush(output.table(rows, SCENARIOS[name][2], f"== {name} =="))
            print_flush("")
        ran = {r: results[name][r] for r in routers if results[name][r]}
        if name in COMPARE and len(ran) > 1:
            print_flush(COMPARE[name](ran))
            print_flush("")
    combined: dict[str, Any] = {
        "routers": routers,
        "scenarios": scenarios + whole,
        "repeat": args.repeat,
        "quick": args.quick,
        "summaries": summaries,
        "failures": failures,
        **{name: {k: r[k] for k in ("results_file", "medians", "ratios", "verdicts")}
           for name, r in whole_results.items()},
    }  # fmt: skip
    if len(routers) > 1 or args.repeat > 1:
        text, rows = side_by_side(summaries, reference=routers[0])
        print_flush(text)
        combined["side_by_side"] = rows
    if "storm" in whole_results:
        storm_runs = whole_results["storm"]["runs"]
        last = {r["target"]: r for r in storm_runs if r["repetition"] == args.repeat}
        if last:
            print_flush("storm plot:", plot_storm(last, whole_results["storm"]["settings"]))
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
    p.add_argument(
        "--scenarios", default=None, help=f"comma list of {','.join([*SCENARIOS, *WHOLE])}"
    )
    p.add_argument("--repeat", type=int, default=None, help="default 1 (--peers: 3)")
    p.add_argument(
        "--publish",
        action="store_true",
        help="write bench/published/<scenario>.json for storm and router-bound (full runs)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="trio_pd, trio_pd_w2, smg, mini_lb; the peer scenarios; 3 repetitions "
        "(make bench-peers)",
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
