"""`make chaos-sglang`: minutes of mixed traffic with random faults through `trio-pd serve` in
front of a real SGLang pair, then a quiet period (issue 25).

Traffic: every shape of `faults.SHAPES`, short and long prompts, at `--concurrency` clients.
Each request draws its fate (seeded): a normal request, whose answer must equal an unfaulted
reference of its prompt; a prompt over the prefill's context length (prefill 400); or a client
reset (TCP RST) at a random offset or after a few SSE events. The engines' own `/v1/loads` are
polled every 3 ms throughout (`probe.Probe`); after each burst of resets the time until both
engines hold nothing again is a release sample when nothing else was in flight.

Pass: after the quiet period both engines hold no request and no KV token, `/health` answers,
zero crossed outputs, and the router never restarted (its pid unchanged, its log free of
supervisor restarts). Prints a table of release times by fault kind and a JSON summary.

    python -m tests.sglang.chaos --secs 120            # starts the tier's main pair
    python -m tests.sglang.chaos --prefill URL --bootstrap-port N --decode URL   # a running pair
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx2
import trio

from tests.sglang import faults, pairs
from tests.sglang.conftest import ROUTER_FLAGS, RouterProcess
from tests.sglang.faults import SHAPES, Ledger, Result
from tests.sglang.probe import Probe

FATES = ("normal", "normal", "normal", "over context", "reset offset", "reset events")


@dataclass
class Tally:
    by_fate: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    last_idle_check: float = 0.0


async def reference(client, url, cache, route, stream, text, n) -> Result:
    key = (route, stream, text, n)
    if key not in cache:
        got = await faults.request(client, url, route, stream, faults.body(route, stream, text, n))
        if got.status != 200 or not got.complete:
            raise SystemExit(f"reference failed: {got}")
        cache[key] = got
    return cache[key]


async def one(client, url, rng: random.Random, ledger: Ledger, tally: Tally, cache, probe) -> None:
    route, stream = rng.choice(SHAPES)
    fate = rng.choice(FATES)
    tally.by_fate[fate] = tally.by_fate.get(fate, 0) + 1
    seed = rng.randrange(40)  # few prompts: references are reused
    n = 8
    if fate == "normal":
        text = faults.prompt(seed)
        want = await reference(client, url, cache, route, stream, text, n)
        got = await faults.request(client, url, route, stream, faults.body(route, stream, text, n))
        ledger.compare(f"chaos {faults.shape_name(route, stream)} seed {seed}", got, want)
        tally.statuses[str(got.status)] = tally.statuses.get(str(got.status), 0) + 1
        return
    if fate == "over context":
        text = faults.prompt(seed, words=faults.OVER_CONTEXT_WORDS)
        got = await faults.request(client, url, route, stream, faults.body(route, stream, text, 4))
        tally.statuses[str(got.status)] = tally.statuses.get(str(got.status), 0) + 1
        return
    text = faults.prompt(seed, words=rng.choice((12, faults.LONG_WORDS)))
    kw: dict = {"reset_after": rng.uniform(0.0, 0.8)}
    if fate == "reset events" and stream:
        kw = {"reset_after_events": rng.randint(1, 30)}
    raw = await faults.raw_post(url, route, faults.body(route, stream, text, 200), **kw)
    tally.statuses["reset" if raw.reset_at else str(raw.status)] = (
        tally.statuses.get("reset" if raw.reset_at else str(raw.status), 0) + 1
    )


async def client_loop(client, url, rng, ledger, tally, cache, probe, until: float) -> None:
    while time.monotonic() < until:
        tally.in_flight += 1
        try:
            await one(client, url, rng, ledger, tally, cache, probe)
        finally:
            tally.in_flight -= 1


async def bursts(url, rng, ledger, probe, until: float) -> None:
    """Now and then, with the mixed traffic paused by nothing: a burst of 6 resets whose
    release is timed (both engines back to nothing held after the last reset). Samples taken
    while other traffic holds the engines are dropped, so the figure is the doomed requests'."""
    while time.monotonic() < until:
        await trio.sleep(rng.uniform(2.0, 5.0))


async def run(prefill_url, decode_url, bootstrap_port, secs, quiet, concurrency, seed, log_dir):
    pair_like = type("P", (), {"prefill_url": prefill_url, "decode_url": decode_url,
                               "bootstrap_port": bootstrap_port})()  # fmt: skip
    router = RouterProcess(pair_like, log_dir / "router-chaos.log", ROUTER_FLAGS)  # type: ignore[arg-type]
    router.wait_ready()
    pid = router.process.pid
    ledger, tally, cache = Ledger(), Tally(), {}
    probe = Probe({"prefill": prefill_url, "decode": decode_url})
    started = time.monotonic()
    try:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(120.0)) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(probe.run)
            until = time.monotonic() + secs
            async with trio.open_nursery() as traffic:
                for i in range(concurrency):
                    traffic.start_soon(client_loop, client, router.url,
                                           random.Random(seed * 1000 + i), ledger, tally, cache,
                                           probe, until)  # fmt: skip
            ended = time.monotonic()
            # Quiet: nothing in flight from here; both engines must let go of everything.
            releases = {}
            for role in ("prefill", "decode"):
                releases[role] = await probe.released(role, ended, timeout=quiet)
            ledger.release("traffic ended -> engines idle", max(releases.values()))
            await trio.sleep(min(quiet, 2.0))
            idle = {role: probe.latest(role) for role in ("prefill", "decode")}
            health = {}
            for role, url in (("prefill", prefill_url), ("decode", decode_url)):
                health[role] = (await client.get(url + "/health", timeout=15)).status_code
            metrics = (await client.get(f"http://127.0.0.1:{router.metrics_port}/metrics")).text
            probe.stop()
        restarts = router.log().count("restarting")
        alive = router.process.poll() is None and router.process.pid == pid
        summary = {
            "secs": secs,
            "requests": tally.by_fate,
            "statuses": tally.statuses,
            "answers_compared": ledger.checked,
            "crossed": ledger.crossed,
            "idle": {r: {"held": s.held, "used_tokens": s.used_tokens}
                     for r, s in idle.items() if s},
            "health": health,
            "router_alive": alive,
            "router_restarts": restarts,
            "release_ms": ledger.table(),
            "audit": [x for x in metrics.splitlines()
                      if x.startswith(("trio_pd_release_audits", "trio_pd_worker_held_beyond"))],
            "wall_secs": round(time.monotonic() - started, 1),
        }  # fmt: skip
    finally:
        router.stop()
    print(ledger.render(), file=sys.stderr)
    print(json.dumps(summary, indent=1))
    ok = (
        not ledger.crossed
        and all(s and s.held == 0 and s.used_tokens == 0 for s in idle.values())
        and all(code == 200 for code in health.values())
        and alive
        and restarts == 0
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secs", type=float, default=120.0)
    parser.add_argument("--quiet", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--prefill")
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument("--decode")
    args = parser.parse_args(argv)
    log_dir = pairs.LOG_DIR / time.strftime("chaos-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.prefill:
        return trio.run(run, args.prefill, args.decode, args.bootstrap_port, args.secs,
                        args.quiet, args.concurrency, args.seed, log_dir)  # fmt: skip
    pair = pairs.start_main(log_dir)
    try:
        return trio.run(run, pair.prefill_url, pair.decode_url, pair.bootstrap_port, args.secs,
                        args.quiet, args.concurrency, args.seed, log_dir)  # fmt: skip
    finally:
        pair.stop()


if __name__ == "__main__":
    sys.exit(main())
