"""Scenario `soak`: 10 minutes (--quick: 30 s) of mixed load with random faults, sampling the
router's RSS, open file descriptors and TCP connections (psutil, the router process and its
children) over time, then once more after an idle pause: growth that does not come back is a leak.

Mix per request: endpoint (/generate, /v1/completions, /v1/chat/completions), streaming or not,
about 25 % with a random prefill or decode fault, about 5 % of clients leaving after 50 ms.
Retries and circuit breakers are off (with them on, injected faults open the breakers and the
soak measures 503s).
"""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
import trio

from bench.harness import output, procs
from bench.harness.output import print_flush
from bench.httpc import one_request

NAME = "soak"
FAULTS = (
    "prefill:500", "prefill:400", "prefill:sse_error", "prefill:close", "prefill:abort",
    "decode:500", "decode:close", "prefill:slow:200",
)  # fmt: skip
COLUMNS = ("t", "rss_mb", "fds", "tcp", "requests", "ok")


def settings(quick: bool) -> dict[str, Any]:
    return {"seconds": 20.0 if quick else 600.0, "users": 8, "sample_every": 1.0 if quick else 5.0}


def make_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    stream = rng.random() < 0.5
    path = rng.choice(("/generate", "/v1/completions", "/v1/chat/completions"))
    if path == "/generate":
        b: dict[str, Any] = {"text": "soak test", "sampling_params": {"max_new_tokens": 16}}
    elif path == "/v1/completions":
        b = {"model": "sim-model", "prompt": "soak test", "max_tokens": 16}
    else:
        b = {"model": "sim-model", "messages": [{"role": "user", "content": "soak"}]}
        b["max_tokens"] = 16
    b["stream"] = stream
    if rng.random() < 0.25:
        b["sim_fault"] = rng.choice(FAULTS)
    return path, b


async def load(
    port: int, s: dict[str, Any], counts: dict[str, int], statuses: dict[str, int], deadline: float
) -> None:
    async def user(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            path, b = make_request(rng)
            timeout = 0.05 if rng.random() < 0.05 else 30.0  # some clients leave early
            reply = await one_request(
                procs.HOST, port, "POST", path, orjson.dumps(b), timeout=timeout
            )
            counts["requests"] += 1
            counts["ok"] += int(reply.ok)
            key = reply.error or str(reply.status)
            statuses[key] = statuses.get(key, 0) + 1
            if reply.error and reply.error != "timeout":
                await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for i in range(s["users"]):
            nursery.start_soon(user, 1000 + i)


def run(router: str, quick: bool = False) -> dict[str, Any]:
    s = settings(quick)
    samples = []
    counts = {"requests": 0, "ok": 0}
    statuses: dict[str, int] = {}
    decode_args = ["--inter-token-ms", "2", "--max-running", "256", "--waiting-timeout", "10"]
    with procs.cluster(
        router, decode_args=decode_args, router_args=procs.failure_router_args(router)
    ) as c:

        async def main() -> None:
            t0 = time.monotonic()
            deadline = t0 + s["seconds"]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load, c.router_port, s, counts, statuses, deadline)
                while time.monotonic() < deadline:
                    samples.append({"t": round(time.monotonic() - t0, 1), **procs.router_rss(c)})
                    samples[-1].update(counts)
                    await trio.sleep(s["sample_every"])
            await trio.sleep(5.0)  # idle: pooled connections expire, in-flight work ends
            samples.append(
                {"t": round(time.monotonic() - t0, 1), "idle": True, **procs.router_rss(c)}
            )
            samples[-1].update(counts)

        trio.run(main)
    first, loaded, idle = samples[0], samples[:-1], samples[-1]
    third = loaded[len(loaded) // 3 :] or loaded
    row = {
        "router": router,
        "seconds": s["seconds"],
        "requests": counts["requests"],
        "ok": counts["ok"],
        "rss_start_mb": first["rss_mb"],
        "rss_after_warmup_mb": third[0]["rss_mb"],
        "rss_end_mb": loaded[-1]["rss_mb"],
        "rss_max_mb": max(x["rss_mb"] for x in loaded),
        "rss_idle_mb": idle["rss_mb"],
        "fds_start": first["fds"],
        "fds_max": max(x["fds"] for x in loaded),
        "fds_idle": idle["fds"],
        "tcp_max": max(x["tcp"] for x in loaded),
        "tcp_idle": idle["tcp"],
        "statuses": dict(sorted(statuses.items())),
    }
    print_flush(
        f"  soak {router}: {row['requests']} requests, RSS {row['rss_start_mb']} -> "
        f"{row['rss_end_mb']} MB (idle {row['rss_idle_mb']}), fds {row['fds_start']} -> max "
        f"{row['fds_max']} -> idle {row['fds_idle']}, tcp max {row['tcp_max']} idle "
        f"{row['tcp_idle']}"
    )
    return {
        "scenario": NAME,
        "router": router,
        "quick": quick,
        "settings": s,
        "rows": [row],
        "series": samples,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    row = result["rows"][0]
    return {
        "soak RSS growth MB": round(row["rss_end_mb"] - row["rss_after_warmup_mb"], 2),
        "soak fds idle": row["fds_idle"],
        "soak tcp idle": row["tcp_idle"],
    }


def main(argv: list[str] | None = None) -> None:
    args = procs.scenario_parser(__doc__).parse_args(argv)
    result = run(args.router, args.quick)
    print_flush(output.table(result["series"], COLUMNS, "soak samples"))
    print_flush("client statuses:", result["rows"][0]["statuses"])
    keys = [k for k in result["rows"][0] if k != "statuses"]
    output.report(NAME, result, keys, "soak")


if __name__ == "__main__":
    main()
