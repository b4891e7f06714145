"""Scenario `hostile-stream`: another model's latency beside a worker whose first SSE event never
ends, before and after the linear SSE reader of issue 19 (item 4), in the same run.

One router serves two models. Model A: the simulator (`trio-pd-testing engine`), the victims: a
closed loop of non-stream `/generate` requests (`--concurrency`, default 4) whose p50/p99 are
measured. Model B: bench/hostile_worker.py, with two streaming clients of its own in flight all the
time, in one of three conditions:

- `alone`: B's clients are off: the victims' baseline;
- `benign`: B's decode sends `--rate` bytes a second per stream (8 MB/s) as complete 1 KiB
  events: the control, the same bytes for the router to move;
- `hostile`: the same bytes a second as one `data:` line that never ends. The router of
  7462f5a/d07b3a9 re-copied and re-scanned the whole partial event on every read (quadratic);
  this one scans each byte once and fails the leg at `--max-sse-event-bytes` (16 MiB), and B's
  clients start the next.

Routers, alternating: `before` (commit `--baseline`, bench/baseline.py) and `after` (this
checkout). The table gives p50/p99 per router and condition, and each condition's p50 over the
same router's `alone` p50 (the ratios are what to quote on a noisy 2-core box).

    .venv/bin/python -m bench.hostile_stream [--quick] [--baseline REV] [--rate BPS]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import baseline
from bench.harness import cpu, procs
from bench.harness.output import print_flush, table, write_result
from bench.harness.procs import HOST, Proc, free_port, wait_until
from bench.loadgen import LoadSpec, run_load
from bench.memory import status_kb

CONDITIONS = ("alone", "benign", "hostile")
ROUTERS = ("before", "after")
COLUMNS = (
    "router", "condition", "ok", "errors", "p50_ms", "p99_ms", "p50_vs_alone", "router_cpu",
    "router_rss_mb",
)  # fmt: skip
VICTIM_BODY = {"text": "a victim", "model": "A", "sampling_params": {"max_new_tokens": 4}}


def hostile(role: str, logdir: Path, mode: str, rate: float) -> tuple[Proc, int]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.hostile_worker", "serve", "--port", str(port),
            "--role", role, "--mode", mode, "--rate", str(rate)]  # fmt: skip
    proc = Proc(f"hostile-{role}-{mode}", argv, logdir)
    wait_until(lambda: procs.http_get(port, "/health") == 200, 20, f"hostile {role}", proc)
    return proc, port


def start_router(
    kind: str, a: tuple[procs.Engine, procs.Engine], b: tuple[int, int], logdir: Path,
    tree: Path,
) -> tuple[Proc, int]:  # fmt: skip
    prefill, decode = a
    b_prefill, b_decode = b
    port = free_port()
    flags = [
        "serve", "--host", HOST, "--port", str(port), "--log-level", "warning",
        "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
        "--policy", "round_robin", "--disable-retries", "--disable-circuit-breaker",
        "--prefill", prefill.url, str(prefill.bootstrap_port), "model=A",
        "--decode", decode.url, "model=A",
        "--prefill", f"http://{HOST}:{b_prefill}", "none", "model=B",
        "--decode", f"http://{HOST}:{b_decode}", "model=B",
    ]  # fmt: skip
    if kind == "before":
        proc = Proc(f"router-{kind}", [*baseline.baseline_command(), *flags], logdir,
                    env=baseline.baseline_env(tree), cwd=tree)  # fmt: skip
    else:
        proc = Proc(f"router-{kind}", [procs.trio_pd_bin(), *flags], logdir)
    wait_until(lambda: procs.http_get(port, "/health") == 200, 60, f"router {kind}", proc)
    wait_until(
        lambda: procs.http_post(port, "/generate", VICTIM_BODY) == 200, 60,
        f"router {kind} first request", proc,
    )  # fmt: skip
    return proc, port


def one_run(
    kind: str, condition: str, a: tuple[procs.Engine, procs.Engine],
    b: dict[str, int], logdir: Path, tree: Path, duration: float,
) -> dict[str, Any]:  # fmt: skip
    b_decode = b["hostile"] if condition == "hostile" else b["benign"]
    router, port = start_router(kind, a, (b["prefill"], b_decode), logdir, tree)
    clients = None
    peak_rss = 0
    try:
        if condition != "alone":
            argv = [sys.executable, "-m", "bench.hostile_worker", "client", "--port", str(port),
                    "--model", "B", "--streams", "2"]  # fmt: skip
            clients = Proc(f"clients-{kind}-{condition}", argv, logdir)
            time.sleep(2.0)  # the B streams are under way
        meter = cpu.CpuMeter({"router": router.pid})
        spec = LoadSpec(mode="router", path="/generate", body=VICTIM_BODY, concurrency=4,
                        duration=duration, warmup=1.0, router_port=port)  # fmt: skip
        result = run_load(spec, processes=1, meter=meter)
        for p in cpu.tree_procs(router.pid):
            peak_rss += status_kb(p.pid, "VmHWM")
    finally:
        if clients is not None:
            clients.stop()
        router.stop()
    errors = {k: v for k, v in result["status"].items() if k != "200"}
    return {
        "router": kind, "condition": condition, "ok": result["ok"],
        "errors": ",".join(f"{k}:{v}" for k, v in errors.items()) or "-",
        "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"],
        "router_cpu": meter.result.get("router"), "router_rss_mb": round(peak_rss / 2**20, 1),
    }  # fmt: skip


def run(quick: bool, rev: str, rate: float, repeat: int) -> dict[str, Any]:
    duration = 4.0 if quick else 8.0
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-bench-hostile-"))
    running: list[Proc] = []
    rows: list[dict[str, Any]] = []
    try:
        prefill = procs.start_engine("prefill", logdir)
        decode = procs.start_engine("decode", logdir)
        running += [prefill.proc, decode.proc]
        b: dict[str, int] = {}
        for name, role, mode in (("prefill", "prefill", "benign"),
                                 ("benign", "decode", "benign"),
                                 ("hostile", "decode", "hostile")):  # fmt: skip
            proc, b[name] = hostile(role, logdir, mode, rate)
            running.append(proc)
        with baseline.baseline_tree(rev) as tree:
            for rep in range(repeat):
                for condition in CONDITIONS:
                    for kind in ROUTERS if rep % 2 == 0 else ROUTERS[::-1]:
                        row = one_run(kind, condition, (prefill, decode), b, logdir, tree,
                                      duration)  # fmt: skip
                        row["rep"] = rep
                        rows.append(row)
                        print_flush(table([row], COLUMNS))
    finally:
        for proc in running:
            proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    return {"rows": summarize(rows), "runs": rows, "baseline": rev, "rate": rate,
            "duration": duration, "repeat": repeat}  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the repetitions, and each condition's p50 over its router's `alone`."""
    from bench.stats import median

    out = []
    for kind in ROUTERS:
        alone = median(
            r["p50_ms"] for r in rows if r["router"] == kind and r["condition"] == "alone"
        )
        for condition in CONDITIONS:
            mine = [r for r in rows if r["router"] == kind and r["condition"] == condition]
            p50 = median(r["p50_ms"] for r in mine)
            out.append({
                "router": kind, "condition": condition,
                "ok": median(r["ok"] for r in mine),
                "errors": " ".join(sorted({r["errors"] for r in mine})),
                "p50_ms": p50, "p99_ms": median(r["p99_ms"] for r in mine),
                "p50_vs_alone": p50 / alone if p50 and alone else None,
                "router_cpu": median(r["router_cpu"] for r in mine),
                "router_rss_mb": median(r["router_rss_mb"] for r in mine),
            })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 s windows, one repetition")
    parser.add_argument("--baseline", default=baseline.BEFORE_BOUNDS, help="the 'before' commit")
    parser.add_argument("--rate", type=float, default=8e6, help="bytes a second per B stream")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3, quick 1)")
    args = parser.parse_args()
    repeat = args.repeat or (1 if args.quick else 3)
    result = run(args.quick, args.baseline, args.rate, repeat)
    print_flush()
    title = f"Model A's latency beside model B's streams ({args.rate / 1e6:g} MB/s each, medians)"
    print_flush(table(result["rows"], COLUMNS, title))
    print_flush("wrote", write_result("hostile-stream", result))


if __name__ == "__main__":
    main()
