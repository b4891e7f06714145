"""Scenario `overload`: one of two decodes saturated by another tenant, overload protection on
and off, trio_pd against SMG 1.13 (`smg launch`) in the same run (docs/overload.md).

Engines (simulator processes): one prefill; decode A healthy (5 ms a token); decode B saturated:
it reports 20 more requests queued for compute in `/v1/loads` (`--extra-queued 20`: another
router's load) and is five times slower (25 ms a token), as a busy engine is. Round robin, loads
polled every second (`--worker-startup-check-interval 1`, SMG's `--load-monitor-interval 1`).
Open loop, non-stream `/generate`, 40 tokens, 16 req/s for 8 s (`--quick`: 5 s) per router, on
fresh engines each:

- `trio_pd`: its defaults (protection on: decode B is vetoed while A is under the thresholds);
- `trio_pd_off`: `--disable-worker-overload-protection` (round robin sends B half);
- `smg113`, `smg113_off`: the same two with SMG 1.13's `smg launch --pd-disaggregation`
  (`python -m smg` in bench/.peers, see bench/harness/procs.py; skipped without).

A second part, `trio_pd_shed` and `smg113_shed` with `--worker-overload-shed`: both decodes
healthy and the prefill slow (80 ms a token), so each decode holds about twenty requests waiting
for their KV cache, ordinary PD operation that SGLang counts in `num_waiting_reqs`. SMG 1.13 counts
them against `--worker-overload-waiting-requests` and sheds; trio_pd counts the compute queue.

Reports goodput (answers 200 per second), p50/p99 of the successes, and how many requests each
decode engine saw (from its event log). Writes bench/results/overload-*.json.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from bench import stats
from bench.harness import output, procs
from bench.harness.output import print_flush
from bench.harness.procs import HOST, Proc, free_port, http_get, wait_until
from bench.loadgen import open_loop
from bench.stats import pct

NAME = "overload"
ROUTERS = ("trio_pd", "trio_pd_off", "smg113", "smg113_off")
# The second part: both decodes healthy, prefills slow, shedding on (`--worker-overload-shed`).
SHED_ROUTERS = ("trio_pd_shed", "smg113_shed")
COLUMNS = ("router", "sent", "ok", "goodput", "ok_p50_ms", "ok_p99_ms", "to_saturated",
           "to_healthy")  # fmt: skip
SHED_COLUMNS = ("router", "sent", "ok", "shed_503", "goodput", "ok_p50_ms", "ok_p99_ms")


def settings(quick: bool) -> dict[str, Any]:
    return {"rate": 16.0, "seconds": 5.0 if quick else 8.0, "tokens": 40, "healthy_ms": 5.0,
            "saturated_ms": 25.0, "extra_queued": 20, "client_timeout": 30.0,
            "shed_prefill_ms": 80.0}  # fmt: skip


def router_argv(
    kind: str, prefill: procs.Engine, decodes: list[procs.Engine], port: int
) -> list[str]:
    workers = ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    for decode in decodes:
        workers += ["--decode", decode.url]
    workers += ["--host", HOST, "--port", str(port), "--policy", "round_robin"]
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    off = ["--disable-worker-overload-protection"] if kind.endswith("_off") else []
    if kind.endswith("_shed"):
        off = ["--worker-overload-shed"]
    if kind.startswith("smg113"):
        return [*procs.SMG, "launch", "--pd-disaggregation", *workers,
                "--load-monitor-interval", "1", "--log-level", "warn", *metrics, *off]  # fmt: skip
    return [procs.trio_pd_bin(), "serve", *workers, "--log-level", "warning", *metrics,
            "--admin-port", str(free_port()), "--worker-startup-check-interval", "1",
            *off]  # fmt: skip


def body(tokens: int, i: int) -> dict[str, Any]:
    return {"text": f"overload request {i} " + "word " * 20,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}  # fmt: skip


def started(engine: procs.Engine) -> int:
    return sum(1 for e in engine.events() if e.get("event") == "request_start")


def run(kind: str, quick: bool) -> dict[str, Any]:
    """One router on fresh engines; a `_shed` router gets the second part's engines: both
    decodes healthy, the prefill slow (`shed_prefill_ms` a token), so each decode holds about
    twenty requests waiting for their KV (normal PD operation, num_waiting_reqs over 8)."""
    s = settings(quick)
    shed_part = kind.endswith("_shed")
    logdir = Path(tempfile.mkdtemp(prefix=f"overload-{kind}-"))
    running: list[Proc] = []
    try:
        prefill_ms = s["shed_prefill_ms"] if shed_part else 0.2
        prefill = procs.start_engine("prefill", logdir,
                                      args=["--prefill-ms-per-token", str(prefill_ms)])  # fmt: skip
        healthy = procs.start_engine("decode", logdir, name="decode-healthy",
                                      args=["--inter-token-ms", str(s["healthy_ms"])])  # fmt: skip
        busy = ["--inter-token-ms", str(s["saturated_ms"]), "--extra-queued",
                str(s["extra_queued"])]  # fmt: skip
        saturated = procs.start_engine(
            "decode",
            logdir,
            name="decode-saturated",
            args=["--inter-token-ms", str(s["healthy_ms"])] if shed_part else busy,
        )
        running += [prefill.proc, healthy.proc, saturated.proc]
        port = free_port()
        router = Proc(f"router-{kind}", router_argv(kind, prefill, [healthy, saturated], port),
                      logdir)  # fmt: skip
        running.append(router)
        wait_until(lambda: http_get(port, "/health") == 200, 60, f"router {kind}", router)
        probe = {"text": "probe", "sampling_params": {"max_new_tokens": 1}}
        wait_until(lambda: procs.http_post(port, "/generate", probe) == 200, 60,
                   f"router {kind} first request", router)  # fmt: skip
        time.sleep(2.5)  # two load polls: the saturated decode's figures are known
        before = (started(saturated), started(healthy))
        t0 = time.monotonic() + 0.2
        records = trio.run(open_loop, port, "/generate", partial(body, s["tokens"]), s["rate"],
                           s["seconds"], s["client_timeout"], t0)  # fmt: skip
        to_saturated = started(saturated) - before[0]
        to_healthy = started(healthy) - before[1]
    finally:
        for proc in reversed(running):
            proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    ok = [r for r in records if r["ok"]]
    lat = [r["t_end"] - r["t_send"] for r in ok]
    row = {
        "router": kind, "sent": len(records), "ok": len(ok),
        "goodput": round(len(ok) / s["seconds"], 2),
        "ok_p50_ms": stats.ms(pct(lat, 50)), "ok_p99_ms": stats.ms(pct(lat, 99)),
        "to_saturated": to_saturated, "to_healthy": to_healthy,
        "shed_503": sum(1 for r in records if r["status"] == 503),
    }  # fmt: skip
    print_flush(f"  overload {kind}: {row}")
    return {"router": kind, "row": row, "records": records}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """p99 and goodput of each router with protection on over the same router with it off."""
    out: dict[str, Any] = {}
    for base in ("trio_pd", "smg113"):
        on, off = rows.get(base), rows.get(f"{base}_off")
        if on and off and on["ok_p99_ms"] and off["ok_p99_ms"]:
            out[f"{base}_p99_on_over_off"] = round(on["ok_p99_ms"] / off["ok_p99_ms"], 3)
            out[f"{base}_goodput_on_over_off"] = round(on["goodput"] / max(off["goodput"], 1e-9), 3)
    return out


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Each request's latency against its send time, one colour a router: the first part (one
    decode saturated) above, the shed part below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the bench extra
        return None
    parts = (ROUTERS, SHED_ROUTERS)
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for ax, names in zip(axes, parts, strict=True):
        for n, run_ in enumerate(r for r in result["runs"] if r["router"] in names):
            row = run_["row"]
            ok = [
                (r["t_send"], (r["t_end"] - r["t_send"]) * 1000) for r in run_["records"] if r["ok"]
            ]
            shed = [r["t_send"] for r in run_["records"] if r["status"] == 503]
            label = (f"{row['router']}: p99 {row['ok_p99_ms']:.0f} ms, {row['to_saturated']} to "
                     f"decode B, {row['shed_503']} shed")  # fmt: skip
            if ok:
                ax.scatter(*zip(*ok, strict=True), s=8, color=f"C{n}", label=label)
            if shed:
                ax.scatter(shed, [0] * len(shed), s=14, marker="x", color=f"C{n}")
        ax.set_ylabel("latency of each ok request, ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = result["settings"]
    axes[0].set_title(f"overload, {s['rate']:g} req/s open loop: decode B saturated")
    axes[1].set_title(
        "both decodes healthy, KV waiters, --worker-overload-shed (x: a request shed)"
    )
    axes[1].set_xlabel("send time, s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    every = (*ROUTERS, *SHED_ROUTERS)
    parser.add_argument("--routers", nargs="*", default=list(every), choices=every)
    parser.add_argument(
        "--plot", type=Path, help="also draw the run as a PNG (docs/overload-*.png)"
    )
    parser.add_argument("--plot-from", type=Path, help="draw a run's JSON again, run nothing")
    args = parser.parse_args(argv)
    if args.plot_from is not None:
        drawn = plot(orjson.loads(args.plot_from.read_bytes()), args.plot or Path("overload.png"))
        print_flush(f"drew {drawn}")
        return
    routers = list(args.routers)
    if not procs.peers_available() and any(r.startswith("smg113") for r in routers):
        print_flush("bench/.peers is missing (make bench-overload): skipping smg113*")
        routers = [r for r in routers if not r.startswith("smg113")]
    results = [run(kind, args.quick) for kind in routers]
    rows = {r["router"]: r["row"] for r in results}
    summary = ratios(rows)
    first = [row for name, row in rows.items() if name in ROUTERS]
    second = [row for name, row in rows.items() if name in SHED_ROUTERS]
    if first:
        print(output.table(first, COLUMNS, "overload: one of two decodes saturated"))
    if second:
        title = "overload: both decodes healthy, slow prefills, --worker-overload-shed"
        print(output.table(second, SHED_COLUMNS, title))
    for key, value in summary.items():
        print(f"  {key}: {value}")
    path = output.write_result(NAME, {"scenario": NAME, "settings": settings(args.quick),
                                      "rows": list(rows.values()), "ratios": summary,
                                      "runs": results})  # fmt: skip
    print_flush(f"wrote {path}")
    if args.plot is not None:
        print_flush(f"drew {plot(orjson.loads(path.read_bytes()), args.plot)}")


if __name__ == "__main__":
    main()
