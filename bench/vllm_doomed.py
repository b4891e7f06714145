"""Scenario `doomed-vllm`: KV blocks held by doomed requests on a real vLLM pair (issue 27).

One real vLLM 0.32 prefill/decode pair (`trio_pd_testing.vllm.VllmPair`, NIXL over UCX/TCP,
`.venv-vllm`), trio_pd (`trio-pd serve --vllm-pd-disaggregation`, its defaults) and
vllm-router 0.1.17 (bench/.peers, its defaults) in front of it, one after the other in one run,
round robin. Per router, one request per scenario, each alone on the pair:

- `ok`: a plain 4-token completion (the control: its blocks are freed by the decode's read);
- `client_leaves`: a 1500-token stream whose client leaves after its first event;
- `dead_decode`: the router's only decode passed its first health check, then died (connect
  refused; `trio_pd_testing.vllm.dead_decode`; the routers' health checks off or slow, so they
  take it for up);
- `prefill_400`: a prompt over the prefill's `--max-model-len` (512), under the decode's;
- `n2`: a 4-token completion with `n: 2`.

What the engines held is read from their own `/metrics` every 50 ms, from the request until
both hold nothing (`vllm:kv_cache_usage_perc` 0, nothing running or waiting; bound: the lease
plus 30 s): the peak blocks each held (usage x `num_gpu_blocks`), how long blocks stayed held
after the client had its answer (or left), the block-seconds held after it, the prefills the
prefill finished, the decode's NIXL reads, and the leases that expired
(`vllm:nixl_num_kv_expired_reqs`: blocks nobody read, freed only by the 30 s lease).
Writes bench/results/doomed-vllm-*.json. Needs the lock on the shared machine (two engines,
~2 GB each): `flock /work/real-engine.lock make bench-vllm`.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import trio

from bench.harness.cpu import machine_busy
from bench.harness.output import ROOT, print_flush, table, write_result
from bench.harness.procs import HOST, PEERS, Proc, free_port, http_get, trio_pd_bin, wait_until
from trio_pd_testing.vllm import KV_LEASE_SECS, SERVED_MODEL_NAME, VllmPair
from trio_pd_testing.vllm.dead_decode import PassingThenDead
from trio_pd_testing.vllm.engine_metrics import idle, summed

NAME = "doomed-vllm"
ROUTERS = ("trio_pd", "vllm_router")
SCENARIOS = ("ok", "client_leaves", "dead_decode", "prefill_400", "n2")
COLUMNS = ("router", "scenario", "client", "prefills", "reads", "decode_tokens",
           "peak_prefill_blocks",
           "peak_decode_blocks", "held_after_s", "block_s_after", "leases_expired",
           "late_notifications")  # fmt: skip
FREED_WITHIN_SECS = KV_LEASE_SECS + 30.0
SAMPLE_SECS = 0.05
SETTLED_SECS = 1.0
LONG_PROMPT = "word " * 300  # over the prefill's 512 tokens, under the decode's 2048
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
LATE = "vllm:nixl_num_notifications_after_expiry_total"


async def metrics(client: httpx2.AsyncClient, url: str) -> dict[str, float]:
    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return summed(r.text)


def blocks(m: dict[str, float]) -> float:
    return m.get("vllm:kv_cache_usage_perc", 0.0) * m.get("num_gpu_blocks", 0.0)


Act = Callable[[httpx2.AsyncClient], Awaitable[str]]


async def measure(pair: VllmPair, router_url: str, act: Act) -> dict[str, Any]:
    """Run `act` (one client request, answering what the client got) while sampling both
    engines; then sample until both hold nothing."""
    samples: list[tuple[float, float, float]] = []  # (t, prefill blocks, decode blocks)
    answered: list[float] = []
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(120.0)) as engines:
        p0, d0 = await metrics(engines, pair.prefill_url), await metrics(engines, pair.decode_url)
        t0 = time.monotonic()
        done = trio.Event()

        async def sample() -> None:
            deadline = free_since = None
            while True:
                p = await metrics(engines, pair.prefill_url)
                d = await metrics(engines, pair.decode_url)
                now = time.monotonic() - t0
                samples.append((now, blocks(p), blocks(d)))
                if done.is_set():
                    deadline = deadline or now + FREED_WITHIN_SECS
                    # The engines publish their figures a moment after answering: free for a
                    # second in a row, not one sample, ends it.
                    free_since = (free_since or now) if idle(p) and idle(d) else None
                    if (free_since is not None and now - free_since >= SETTLED_SECS) or (
                        now > deadline
                    ):
                        return
                await trio.sleep(SAMPLE_SECS)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            async with httpx2.AsyncClient(base_url=router_url, timeout=120.0) as client:
                outcome = await act(client)
            answered.append(time.monotonic() - t0)
            done.set()
        p1, d1 = await metrics(engines, pair.prefill_url), await metrics(engines, pair.decode_url)
    t_answer = answered[0]
    after = [s for s in samples if s[0] >= t_answer]
    held = [s for s in after if s[1] > 0 or s[2] > 0]
    # Block-seconds after the answer: each sample's blocks until the next sample.
    block_s = sum((b[0] - a[0]) * (a[1] + a[2]) for a, b in itertools.pairwise(after))
    return {
        "client": outcome,
        "answer_s": round(t_answer, 2),
        "prefills": round(p1.get("vllm:request_success_total", 0) - p0.get(
            "vllm:request_success_total", 0)),
        "reads": round(d1.get("vllm:nixl_xfer_time_seconds_count", 0) - d0.get(
            "vllm:nixl_xfer_time_seconds_count", 0)),
        "peak_prefill_blocks": round(max((s[1] for s in samples), default=0)),
        "peak_decode_blocks": round(max((s[2] for s in samples), default=0)),
        "held_after_s": round(held[-1][0] - t_answer, 2) if held else 0.0,
        "block_s_after": round(block_s, 1),
        "decode_tokens": round(d1.get("vllm:generation_tokens_total", 0) - d0.get(
            "vllm:generation_tokens_total", 0)),
        "leases_expired": round(p1.get(EXPIRED, 0) - p0.get(EXPIRED, 0)),
        "late_notifications": round(p1.get(LATE, 0) - p0.get(LATE, 0)),
        "freed": idle(p1) and idle(d1),
    }  # fmt: skip


# About 200 tokens: 13 blocks of 16 on the prefill, so what a doomed request holds shows.
PROMPT = "the tiny model says " * 50


def body(**kw: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **kw}


async def plain(client: httpx2.AsyncClient, **kw: Any) -> str:
    r = await client.post("/v1/completions", json=body(**kw))
    kind = "json" if r.headers.get("content-type", "").startswith("application/json") else "text"
    return f"{r.status_code} {kind}"


async def leave_after_first_event(client: httpx2.AsyncClient) -> str:
    b = body(max_tokens=1500, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=b) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                return f"{r.status_code}, left after the first event"
    return f"{r.status_code}, no event"


ACTS: dict[str, Act] = {
    "ok": plain,
    "client_leaves": leave_after_first_event,
    "dead_decode": plain,
    "prefill_400": lambda client: plain(client, prompt=LONG_PROMPT),
    "n2": lambda client: plain(client, n=2),
}


def start_router(kind: str, logdir: Path, prefill: str, decode: str, dead: bool) -> Proc:
    port = free_port()
    workers = ["--prefill", prefill, "--decode", decode, "--host", HOST, "--port", str(port)]
    if kind == "vllm_router":
        # Its health checks would take the dead decode out; an hour apart they never run.
        checks = ["--health-check-interval-secs", "3600"] if dead else []
        argv = [str(PEERS / "bin" / "vllm-router"), "--vllm-pd-disaggregation", *workers,
                "--policy", "round_robin", *checks]  # fmt: skip
        ready = "/health"
    else:
        argv = [trio_pd_bin(), "serve", "--vllm-pd-disaggregation", *workers,
                "--policy", "round_robin", "--log-level", "warning", "--admin-port", "0",
                "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                *(["--disable-health-check"] if dead else [])]  # fmt: skip
        ready = "/readiness"
    proc = Proc(f"router-{kind}{'-dead' if dead else ''}", argv, logdir)
    proc.port = port  # type: ignore[attr-defined]
    wait_until(lambda: http_get(port, ready) == 200, 60, f"router {kind}", proc)
    return proc


def run_router(kind: str, pair: VllmPair, logdir: Path, scenarios: list[str]) -> list[dict]:
    rows = []
    for scenario in scenarios:
        dead = PassingThenDead() if scenario == "dead_decode" else None
        decode = dead.url if dead else pair.decode_url
        try:
            router = start_router(kind, logdir, pair.prefill_url, decode, dead is not None)
        finally:
            if dead is not None:
                dead.die()
        try:
            url = f"http://{HOST}:{router.port}"  # type: ignore[attr-defined]
            row = {"router": kind, "scenario": scenario,
                   **trio.run(measure, pair, url, ACTS[scenario])}  # fmt: skip
        finally:
            router.stop()
        print_flush(f"  doomed-vllm {kind} {scenario}: {row}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="accepted; the run is one size")
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args(argv)
    installed = (PEERS / "bin" / "vllm-router").exists()
    routers = [r for r in args.routers if r != "vllm_router" or installed]
    if len(routers) < len(args.routers):
        print_flush("vllm-router is not installed (make bench-peers): trio_pd alone")
    logdir = ROOT / ".cache" / "vllm-logs" / time.strftime("bench-%Y%m%d-%H%M%S")
    logdir.mkdir(parents=True, exist_ok=True)
    busy = machine_busy()
    pair = VllmPair.start(log_dir=logdir, name="doomed")
    print_flush(f"vLLM pair: {pair.describe()}")
    try:
        rows = [row for kind in routers for row in run_router(kind, pair, logdir, args.scenarios)]
    finally:
        pair.stop()
    print_flush(table(rows, COLUMNS, "== doomed-vllm: KV held by doomed requests =="))
    path = write_result(NAME, {"settings": {"lease_secs": KV_LEASE_SECS,
                                                   "busy_before": busy}, "rows": rows})  # fmt: skip
    print_flush("wrote", path)


if __name__ == "__main__":
    main()
