"""`make bench-cache`, real half: the prefill policies in front of real SGLang 0.5.23 engines.

The same multi-turn trace as the simulator half (`bench/cache.py`: tenants with long shared
system prompts, sessions growing a turn at a time, interleaved), sent by 4 closed-loop clients
through TWO router replicas taking turns, in front of the same three real servers (the tier's
`.venv-sglang` and tiny model, `testing/trio_pd_testing/sglang/launcher.py`): two prefills
publishing their KV events with a small KV pool (`--max-total-tokens`, so they evict) and one
decode. Rows:
trio_pd's `random`, `round_robin`, `cache_aware` (the approximate tree) and `kv_aware`, and SMG
1.13's `cache_aware` (`smg launch --pd-disaggregation --policy cache_aware`, from bench/.peers;
skipped without it). Each row starts from empty caches (`/flush_cache` on both prefills).

The figure is the engines' own count: `sglang:cached_tokens_total / sglang:prompt_tokens_total`
over both prefills' `/metrics` (`--enable-metrics`), taken before and after the row. Beside it:
request latency p50/p99 (max_new_tokens 1: about the time to first token), the routers' CPU
seconds per request (both replicas, process trees), and kv_aware's self-check error (mean over
workers and replicas). Engines need the real-engine lock: `flock /work/real-engine.lock make
bench-cache`.

    .venv/bin/python -m bench.cache_real [--sessions 12] [--turns 4] [--rows kv_aware,smg]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2

from bench.cache import trace, vocabulary
from bench.harness import cpu as cpu_meter
from bench.harness import output, procs
from trio_pd_testing.sglang.launcher import (
    MODEL_DIR,
    Engine,
    distinct_free_ports,
    engine_command,
    sglang_shm_files,
    spawn_engine,
    wait_ready,
)

ROWS = ("random", "round_robin", "cache_aware", "kv_aware", "smg_cache_aware")
POOL_TOKENS = 4096
PROBE = {"text": "warm up", "sampling_params": {"max_new_tokens": 1}}
METRIC = re.compile(r"^(sglang:(?:cached|prompt)_tokens_total)\{[^}]*\} ([0-9.e+]+)$", re.M)


def start_engines(logdir: Path, pool: int) -> list[Engine]:
    """Two prefills (KV events, small pools, metrics) and a decode, started together."""
    ports = distinct_free_ports(9)
    engines = []
    for i in range(2):
        port, bootstrap, pub, replay = ports[4 * i : 4 * i + 4]
        events = {
            "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}", "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }  # fmt: skip
        extra = (
            "--kv-events-config", json.dumps(events), "--max-total-tokens", str(pool),
            "--enable-metrics", "--enable-cache-report",
        )  # fmt: skip
        command = engine_command("prefill", port, bootstrap_port=bootstrap, extra_args=extra)
        engines.append(
            spawn_engine(
                "prefill", port, logdir / f"prefill-{i}.log", command, bootstrap_port=bootstrap
            )
        )
    command = engine_command("decode", ports[8])
    engines.append(spawn_engine("decode", ports[8], logdir / "decode.log", command))
    try:
        wait_ready(engines, 300)
    except BaseException:
        for engine in engines:
            engine.kill()
        raise
    return engines


def engine_counts(prefills: list[Engine]) -> tuple[float, float]:
    """(cached, prompt) tokens the prefills counted so far, summed over their label sets."""
    cached = prompt = 0.0
    for engine in prefills:
        text = httpx2.get(engine.url + "/metrics", timeout=10).text
        for name, value in METRIC.findall(text):
            if name.startswith("sglang:cached"):
                cached += float(value)
            else:
                prompt += float(value)
    return cached, prompt


def router_argv(row: str, prefills: list[Engine], decode: Engine, port: int) -> list[str]:
    workers: list[str] = []
    for prefill in prefills:
        workers += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    workers += ["--decode", decode.url, "--host", procs.HOST, "--port", str(port)]
    metrics = ["--prometheus-host", procs.HOST, "--prometheus-port", str(procs.free_port())]
    if row == "smg_cache_aware":
        smg = str(procs.PEERS / "bin" / "smg")
        return [smg, "launch", "--pd-disaggregation", *workers, "--policy", "cache_aware",
                "--log-level", "warn", *metrics]  # fmt: skip
    argv = [procs.trio_pd_bin(), "serve", *workers, "--log-level", "warning", *metrics,
            "--admin-port", str(procs.free_port())]  # fmt: skip
    if row == "kv_aware":
        return [*argv, "--policy", "round_robin", "--prefill-policy", "kv_aware",
                "--tokenizer-path", str(MODEL_DIR)]  # fmt: skip
    return [*argv, "--policy", row]


def start_replicas(row: str, engines: list[Engine], logdir: Path) -> list[tuple[procs.Proc, int]]:
    replicas = []
    for i in range(2):
        port = procs.free_port()
        proc = procs.Proc(f"{row}-{i}", router_argv(row, engines[:2], engines[2], port), logdir)
        replicas.append((proc, port))
    for proc, port in replicas:
        procs.wait_until(lambda p=port: procs.http_get(p, "/health") == 200, 60, proc.name, proc)
        if row.startswith("smg"):
            procs.wait_until(lambda p=port: procs.smg_workers_registered(p, 3), 60,
                              f"{proc.name} workers", proc)  # fmt: skip
        procs.wait_until(lambda p=port: procs.http_post(p, "/generate", PROBE, 30) == 200, 120,
                          f"{proc.name} first request", proc)  # fmt: skip
        if row == "kv_aware":
            procs.wait_until(lambda p=port: kv_precise(p), 60, f"{proc.name} precise", proc)
    return replicas


def kv_workers(port: int) -> list[dict[str, Any]]:
    data = procs.http_get_json(port, "/workers") or {}
    return [w.get("kv_events") or {} for w in data.get("workers", [])
            if w.get("worker_type") == "prefill"]  # fmt: skip


def kv_precise(port: int) -> bool:
    kv = kv_workers(port)
    return len(kv) == 2 and all(k.get("state") == "precise" for k in kv)


def flush(prefills: list[Engine]) -> None:
    for engine in prefills:
        answer = httpx2.post(engine.url + "/flush_cache", timeout=60)
        assert answer.status_code == 200, answer.text


def run_row(row: str, engines: list[Engine], prompts: list[str], args: argparse.Namespace,
            logdir: Path) -> dict[str, Any]:  # fmt: skip
    replicas = start_replicas(row, engines, logdir)
    try:
        flush(engines[:2])
        time.sleep(1.0)  # the AllBlocksCleared events reach kv_aware's index
        cached0, prompt0 = engine_counts(engines[:2])
        meter = cpu_meter.CpuMeter({p.name: p.pid for p, _ in replicas})
        latencies: list[float] = []
        failures = 0
        queue = list(enumerate(prompts))

        def client() -> None:
            nonlocal failures
            with httpx2.Client(timeout=300) as http:
                while True:
                    try:
                        n, text = queue.pop(0)
                    except IndexError:
                        return
                    port = replicas[n % 2][1]
                    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
                    t0 = time.perf_counter()
                    try:
                        answer = http.post(f"http://{procs.HOST}:{port}/generate", json=body)
                        failures += answer.status_code != 200
                    except httpx2.HTTPError:
                        failures += 1
                    latencies.append(time.perf_counter() - t0)

        meter.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for _ in range(args.concurrency):
                pool.submit(client)
        cpu = meter.stop()
        time.sleep(1.0)  # the last requests' metrics are counted
        cached1, prompt1 = engine_counts(engines[:2])
        errors = [k["self_check"]["error"] for _, port in replicas for k in kv_workers(port)
                  if row == "kv_aware" and k.get("self_check", {}).get("samples")]  # fmt: skip
        routers_cpu = sum(v for k, v in cpu.items() if k != "machine")
        trips = sum(p.log.read_text(errors="replace").count("disagree with the KV index")
                    for p, _ in replicas)  # fmt: skip
        latencies.sort()
        return {
            "policy": row,
            "cached/prompt": round((cached1 - cached0) / max(prompt1 - prompt0, 1), 3),
            "prompt tokens": int(prompt1 - prompt0),
            "p50 ms": round(latencies[len(latencies) // 2] * 1e3, 1),
            "p99 ms": round(
                latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3, 1
            ),
            "router cpu ms/req": round(routers_cpu / len(prompts) * 1e3, 2),
            "self-check error": round(sum(errors) / len(errors), 4) if errors else None,
            "self-check trips": trips if row == "kv_aware" else None,
            "failures": failures,
            "wall s": round(meter.wall, 1),
        }
    finally:
        for proc, _ in replicas:
            proc.stop()


def main(args: argparse.Namespace) -> None:
    words = vocabulary(2000)
    prompts = trace(words, args.tenants, args.sessions, args.turns, args.seed)
    rows = [r for r in args.rows.split(",") if r]
    if "smg_cache_aware" in rows and not (procs.PEERS / "bin" / "smg").exists():
        print("no bench/.peers/bin/smg (make bench-peers installs smg==1.13.0): SMG row skipped")
        rows.remove("smg_cache_aware")
    before = sglang_shm_files()
    with tempfile.TemporaryDirectory(prefix="bench-cache-real-") as tmp:
        logdir = Path(tmp)
        engines = start_engines(logdir, args.pool)
        try:
            runs = [run_row(row, engines, prompts, args, logdir)
                    for _ in range(args.repeat) for row in rows]  # fmt: skip
        finally:
            for engine in engines:
                with contextlib.suppress(Exception):
                    engine.kill()
            for name in sglang_shm_files() - before:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))
    setup = (f"{len(prompts)} requests, {args.tenants} tenants, {args.sessions} sessions x "
             f"{args.turns} turns, {args.concurrency} clients; 2 router replicas; real SGLang "
             f"0.5.23: 2 prefills ({args.pool}-token KV pools, page 1), 1 decode")  # fmt: skip
    columns = ["policy", "cached/prompt", "prompt tokens", "p50 ms", "p99 ms", "router cpu ms/req",
               "self-check error", "self-check trips", "failures", "wall s"]  # fmt: skip
    results = [summary(row, [r for r in runs if r["policy"] == row]) for row in rows]
    shown = [{**r, "cached/prompt": " ".join(f"{v:.3f}" for v in r["cached/prompt"])}
             for r in results]  # fmt: skip
    print(output.table(shown, columns, setup + f"; {args.repeat} run(s) a row, medians"))
    path = output.write_result("cache-real", {"setup": setup, "rows": results, "runs": runs})
    print(f"written {path}")


def summary(row: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row over its runs: every ratio (run order), the medians, the self-check's worst."""

    def median(key: str) -> Any:
        values = sorted(r[key] for r in runs if r[key] is not None)
        return values[len(values) // 2] if values else None

    return {
        "policy": row,
        "cached/prompt": [r["cached/prompt"] for r in runs],
        **{
            key: median(key)
            for key in ("prompt tokens", "p50 ms", "p99 ms", "router cpu ms/req", "wall s")
        },
        "self-check error": max(
            (r["self-check error"] for r in runs if r["self-check error"] is not None), default=None
        ),
        "self-check trips": sum(r["self-check trips"] or 0 for r in runs)
        if row == "kv_aware"
        else None,
        "failures": sum(r["failures"] for r in runs),
    }


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_real")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeat", type=int, default=1, help="runs of every row, interleaved")
    parser.add_argument("--pool", type=int, default=POOL_TOKENS, help="each prefill's KV tokens")
    # A `timeout` or Ctrl-C still reaches the finally that kills the engines (own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main(parser.parse_args(argv))


if __name__ == "__main__":
    cli()
