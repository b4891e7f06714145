"""Scenario `storm-vllm`: the storm in vLLM mode, trio_pd against vllm-router 0.1.17.

Engines: the simulator's vLLM mode (`python -m trio_pd_testing.engine.vllm`) as processes. Two
prefills, one healthy and one answering every request 500 (`--fault prefill:status:500`), round
robin, so half the prefills fail; one decode with 16 running requests (`--max-num-seqs 16`),
50 tokens at 10 ms a token (~0.5 s). Open loop, non-stream `/v1/completions`, 20 req/s for 10 s
(`--quick`: 6 s) per router, the routers in one run, one after the other on fresh engines:

- `trio_pd` with retries and breakers off (one attempt per request, as every storm router);
- `trio_pd_retry`: trio_pd's defaults (a failed prefill is retried on the other one while
  nothing went to the decode);
- `vllm_router`: `vllm-router --vllm-pd-disaggregation` (bench/.peers, `make bench-peers`),
  retries and breaker off.

Reports goodput, the successes' p50/p99, the failed clients' wait and what they were answered
(status and content type: a JSON envelope or not), and the KV blocks the prefills still hold
at the end (every handoff read or freed: 0) with the peak held during the run (sampled from
`GET /sim/kv_blocks` every 100 ms). Writes bench/results/storm-vllm-*.json and, with
`--plot PATH`, the PNG (docs/storm-vllm-<date>.png).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import trio

from bench import stats
from bench.harness import cpu, output, procs
from bench.harness.output import print_flush
from bench.harness.procs import HOST, PEERS, Proc, free_port, http_get, wait_until
from bench.httpc import one_request
from bench.loadgen import open_loop
from bench.stats import pct

NAME = "storm-vllm"
ROUTERS = ("trio_pd", "trio_pd_retry", "vllm_router")
COLUMNS = ("router", "sent", "ok", "goodput", "ok_p50_ms", "ok_p99_ms", "fail_wait_p50_ms",
           "failed_as", "held_peak", "held_end", "router_cpu_s")  # fmt: skip


def settings(quick: bool) -> dict[str, Any]:
    return {"rate": 20.0, "seconds": 6.0 if quick else 10.0, "tokens": 50, "inter_token_ms": 10.0,
            "max_num_seqs": 16, "client_timeout": 30.0}  # fmt: skip


def engine(name: str, logdir: Path, args: list[str]) -> tuple[Proc, int]:
    port = free_port()
    argv = [sys.executable, "-m", "trio_pd_testing.engine.vllm", "--host", HOST,
            "--port", str(port), "--role", name, *args]  # fmt: skip
    proc = Proc(name, argv, logdir)
    wait_until(lambda: http_get(port, "/health") == 200, 20, name, proc)
    return proc, port


def router(kind: str, logdir: Path, prefills: list[int], decode: int) -> tuple[Proc, int]:
    port = free_port()
    workers: list[str] = []
    for p in prefills:
        workers += ["--prefill", f"http://{HOST}:{p}"]
    workers += ["--decode", f"http://{HOST}:{decode}", "--host", HOST, "--port", str(port)]
    off = ["--disable-retries", "--disable-circuit-breaker"]
    if kind == "vllm_router":
        argv = [str(PEERS / "bin" / "vllm-router"), "--vllm-pd-disaggregation", *workers,
                "--policy", "round_robin", *off]  # fmt: skip
    else:
        argv = [procs.trio_pd_bin(), "serve", "--vllm-pd-disaggregation", *workers,
                "--policy", "round_robin", "--log-level", "warning",
                "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                "--admin-port", str(free_port()), *(off if kind == "trio_pd" else [])]  # fmt: skip
    proc = Proc(f"router-{kind}", argv, logdir)
    body = {"prompt": "probe", "max_tokens": 1}
    wait_until(lambda: procs.http_post(port, "/v1/completions", body) in (200, 500, 502), 60,
               f"router {kind}", proc)  # fmt: skip
    return proc, port


async def held_blocks(port: int) -> int:
    reply = await one_request(HOST, port, "GET", "/sim/kv_blocks", timeout=2.0)
    try:
        return int(orjson.loads(reply.body)["held_blocks"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return -1


async def storm_loop(port: int, s: dict[str, Any], prefills: list[int], t0: float) -> dict:
    records: list[dict[str, Any]] = []
    samples: list[tuple[float, int]] = []
    done = trio.Event()

    def body(i: int) -> dict[str, Any]:
        return {"model": "sim-model", "prompt": f"storm request {i} " + "word " * 20,
                "max_tokens": s["tokens"]}  # fmt: skip

    def json_answer(reply: Any) -> dict[str, Any]:
        content_type = reply.headers.get("content-type", "")
        return {"json": "json" in str(content_type) or reply.body[:1] == b"{"}

    async def sample() -> None:
        while not done.is_set():
            held = sum([await held_blocks(p) for p in prefills])
            samples.append((time.monotonic() - t0, held))
            await trio.sleep(0.1)

    async with trio.open_nursery() as outer:
        outer.start_soon(sample)
        records += await open_loop(port, "/v1/completions", body, s["rate"], s["seconds"],
                                   s["client_timeout"], t0, json_answer)  # fmt: skip
        await trio.sleep(0.5)  # the last handoffs are read
        done.set()
    end = sum([await held_blocks(p) for p in prefills])
    return {"records": records, "samples": samples, "held_end": end}


def run(kind: str, quick: bool) -> dict[str, Any]:
    s = settings(quick)
    logdir = Path(tempfile.mkdtemp(prefix=f"storm-vllm-{kind}-"))
    running: list[Proc] = []
    try:
        healthy, p1 = engine("prefill-ok", logdir, ["--prefill-ms-per-token", "1"])
        broken, p2 = engine("prefill-500", logdir, ["--fault", "prefill:status:500"])
        pace = ["--inter-token-ms", str(s["inter_token_ms"]), "--max-num-seqs",
                str(s["max_num_seqs"])]  # fmt: skip
        decode, d = engine("decode", logdir, pace)
        running += [healthy, broken, decode]
        router_proc, port = router(kind, logdir, [p1, p2], d)
        running.append(router_proc)
        meter = cpu.CpuMeter({"router": router_proc.pid})
        t0 = time.monotonic() + 0.2
        meter.start()
        out = trio.run(storm_loop, port, s, [p1, p2], t0)
        meter.stop()
    finally:
        for proc in reversed(running):
            proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    records = out["records"]
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    failed_as: dict[str, int] = {}
    for r in failed:
        key = f"{r['error'] or r['status']} {'json' if r['json'] else 'text'}"
        failed_as[key] = failed_as.get(key, 0) + 1
    lat = [r["t_end"] - r["t_send"] for r in ok]
    row = {
        "router": kind, "sent": len(records), "ok": len(ok),
        "goodput": round(len(ok) / s["seconds"], 2),
        "ok_p50_ms": stats.ms(pct(lat, 50)), "ok_p99_ms": stats.ms(pct(lat, 99)),
        "fail_wait_p50_ms": stats.ms(pct([r["t_end"] - r["t_send"] for r in failed], 50)),
        "failed_as": ", ".join(f"{k}: {v}" for k, v in sorted(failed_as.items())) or "-",
        "held_peak": max((h for _, h in out["samples"]), default=0),
        "held_end": out["held_end"],
        "router_cpu_s": meter.result.get("router"),
    }  # fmt: skip
    print_flush(f"  storm-vllm {kind}: {row}")
    return {"scenario": NAME, "router": kind, "settings": s, "rows": [row],
            "samples": out["samples"], "records": records}  # fmt: skip


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the bench extra
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for n, result in enumerate(results):
        row, color = result["rows"][0], f"C{n}"
        horizon = int(result["settings"]["seconds"]) + 2
        per_second = [0] * horizon
        for r in result["records"]:
            if r["ok"] and 0 <= int(r["t_end"]) < horizon:
                per_second[int(r["t_end"])] += 1
        label = f"{row['router']}: {row['ok']} ok of {row['sent']}, p99 {row['ok_p99_ms']} ms"
        axes[0].plot(range(horizon), per_second, color=color, label=label)
        t, held = zip(*result["samples"], strict=True) if result["samples"] else ((), ())
        axes[1].plot(t, held, color=color, label=f"{row['router']}: end {row['held_end']}")
    s = results[0]["settings"]
    axes[0].set_title(f"storm-vllm: {s['rate']:g} req/s open loop, 50% prefill 500s, decode "
                      f"{s['max_num_seqs']} running, vLLM-mode simulator")  # fmt: skip
    axes[0].set_ylabel("successful req/s")
    axes[1].set_ylabel("KV blocks held by prefills")
    axes[1].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    installed = (PEERS / "bin" / "vllm-router").exists()
    routers = [r for r in args.routers if r != "vllm_router" or installed]
    if len(routers) < len(args.routers):
        print_flush("vllm-router is not installed (make bench-peers): trio_pd alone")
    results = [run(kind, args.quick) for kind in routers]
    rows = [r["rows"][0] for r in results]
    print_flush(output.table(rows, COLUMNS, "== storm-vllm side by side =="))
    path = output.write_result(NAME, {"meta": output.meta(), "results": [
        {k: v for k, v in r.items() if k != "records"} for r in results]})  # fmt: skip
    print_flush("wrote", path)
    if args.plot is not None:
        print_flush("wrote", plot(results, args.plot))


if __name__ == "__main__":
    main()
