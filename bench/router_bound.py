"""Scenario `router-bound`: the router's own cost, with engines that answer instantly.

wrk (C, one thread, keep-alive, closed loop) POSTs a small non-stream `/generate` to a router
whose prefill and decode are bench/instant_engine.py, so the router is the only busy program;
then 128 paced SSE streams (64 events, one 20 ms decode step per event). Measurements:
bench/bound.py (CPU of the target's process tree in a window inside the load, per request the
server completed or event the client received). Targets: the floor (a bare ASGI app on the same
serving stack: the same-run baseline of every ratio), the instant engine alone (`direct`, no
paced phase) and the routers. Not the `overhead` shape (simulator engines, Python load generator).

    .venv/bin/python -m bench.router_bound [--quick] [--routers trio_pd,smg,...] [--repeat N]
        [--publish]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from bench import bound
from bench.harness import run, wrk
from bench.harness.run import Phase, Scenario, Verdict

NAME = "router-bound"
LOAD = (
    "wrk (1 thread, keep-alive, closed loop) POSTing a small non-stream /generate at 1, 32 and "
    "256 connections, and 128 paced SSE streams (64 events, one 20 ms decode step per event) "
    "from a uvloop client, through the router to instant uvloop+httptools engines "
    "(bench/instant_engine.py); 'direct' = wrk straight at the instant decode engine"
)
LABELS = {
    "trio_pd": "trio_pd",
    "trio_pd_w2": "trio_pd `--workers 2`",
    "trio_pd_noabort": "trio_pd `--no-abort-on-cancel`",
    "smg": "SMG 1.13 (Rust)",
    "mini_lb": "mini_lb (Python)",
    "floor": "floor (bare ASGI app, same stack)",
    "direct": "instant engine alone",
}


def settings(quick: bool) -> bound.Settings:
    cycle = 64 * 0.020  # one stream's life: the window spans whole cycles
    if quick:
        return bound.Settings(lead=0.5, window=2.0, warmup=1.0, paced_warmup=1.5,
                              paced_window=2 * cycle)  # fmt: skip
    return bound.Settings(lead=1.0, window=5.0, warmup=2.0, paced_warmup=2.0,
                          paced_window=6 * cycle)  # fmt: skip


def derive(flat: dict[str, dict[str, Any]]) -> None:
    """Across the targets of one repetition: the c=1 latency a target adds over the engine
    alone, and `--workers 2`'s CPU per request over one worker's."""
    direct = flat.get("direct", {}).get("c1_p50_ms")
    for name, m in flat.items():
        if name != "direct" and direct is not None and m.get("c1_p50_ms") is not None:
            m["c1_added_p50_ms"] = round(m["c1_p50_ms"] - direct, 3)
    one, two = flat.get("trio_pd"), flat.get("trio_pd_w2")
    if one and two:
        for c in (32, 256):
            two[f"c{c}_cpu_vs_w1"] = run.ratio(two.get(f"c{c}_cpu_us_per_req"),
                                               one.get(f"c{c}_cpu_us_per_req"))  # fmt: skip


SCENARIO = Scenario(
    name=NAME,
    load=LOAD,
    settings=settings,
    phases=(
        Phase("nonstream", lambda routers: ["floor", "direct", *routers], bound.nonstream),
        Phase("paced", lambda routers: ["floor", *routers], bound.paced),
    ),
    baseline="floor",
    metrics={
        "c1_cpu_us_per_req": "CPU per non-stream request, c=1 (µs)",
        "c32_cpu_us_per_req": "CPU per non-stream request, c=32 (µs)",
        "c256_cpu_us_per_req": "CPU per non-stream request, c=256 (µs)",
        "c32_rps": "requests/s, c=32",
        "c256_p99_ms": "p99 latency at c=256 (ms)",
        "c1_added_p50_ms": "added p50 at c=1 over the engine alone (ms)",
        "paced_cpu_us_per_event": "CPU per relayed event, paced streams (µs)",
        "peak_rss_mb": "peak RSS (MB)",
        "c32_split": "busiest / idlest worker CPU, c=32",
        "c32_machine_busy": "machine busy cores during c=32",
    },
    verdicts=(
        *(Verdict(f"CPU/req c={c}: trio_pd / mini_lb", f"c{c}_cpu_us_per_req", "trio_pd",
                  "mini_lb", "ratio", 0.9, "<= 0.9x") for c in (32, 256)),
        Verdict("CPU/req c=32: trio_pd - floor (µs)", "c32_cpu_us_per_req", "trio_pd", "floor",
                "diff", 250.0, "<= +250 µs"),
        Verdict("CPU/event paced: trio_pd / mini_lb", "paced_cpu_us_per_event", "trio_pd",
                "mini_lb", "ratio", 1.5, "<= 1.5x"),
        Verdict("CPU/event paced: trio_pd - floor (µs)", "paced_cpu_us_per_event", "trio_pd",
                "floor", "diff", 25.0, "<= +25 µs"),
        Verdict("p99 c=256: trio_pd / mini_lb", "c256_p99_ms", "trio_pd", "mini_lb", "ratio",
                1.0, "<= 1.0x"),
        Verdict("added p50 c=1: trio_pd / SMG", "c1_added_p50_ms", "trio_pd", "smg", "ratio",
                2.0, "<= 2x"),
        Verdict("--workers 2: busiest/idlest worker CPU c=32", "c32_split", "trio_pd_w2", None,
                "value", 1.25, "<= 1.25"),
        Verdict("--workers 2: CPU/req c=32 / 1 worker", "c32_cpu_vs_w1", "trio_pd_w2", None,
                "band", 0.1, "1.0x +/- 10%"),
    ),
    derive=derive,
)  # fmt: skip


def capacity(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Router cores for 1,000 non-stream requests/s (CPU/req at c=32) and for 100,000 streamed
    tokens/s (CPU/event of the paced streams, one token per event)."""
    rows = []
    for name in summary["targets"]:
        if name == "direct":
            continue
        m = summary["medians"].get(name, {})
        req, evt = m.get("c32_cpu_us_per_req"), m.get("paced_cpu_us_per_event")
        rows.append({
            "router": LABELS.get(name, name),
            "cpu_us_per_req": req,
            "cores_per_1k_rps": None if req is None else req * 1000 / 1e6,
            "cpu_us_per_event": evt,
            "cores_per_100k_tokens": None if evt is None else evt * 100_000 / 1e6,
        })  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    if not wrk.installed():
        raise SystemExit("router-bound needs wrk (apt-get install wrk; make bench installs it)")
    return run.main(SCENARIO, __doc__, argv, routers="trio_pd,trio_pd_w2,smg,mini_lb", repeat=3)


if __name__ == "__main__":
    sys.exit(main())
