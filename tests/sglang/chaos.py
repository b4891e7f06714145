"""`make chaos-sglang`: minutes of mixed traffic with random faults through a router in front
of a real SGLang pair, then a quiet period (issue 25). `make chaos-sglang-smg` runs the same
harness with SMG 1.13 (`smg launch`) in front of the same pair, for the side-by-side.

Traffic comes in **episodes**: `--concurrency` clients at once, every shape of `faults.SHAPES`,
half of them normal requests (each answer must equal an unfaulted reference of its prompt: no
crossed outputs) and half doomed by one fault kind drawn for the episode (seeded):
- `prefill 400`: a prompt over the prefill's context length (the decode waits for KV);
- `client reset`: a TCP RST at a random offset (0-0.8 s: prefill running, decode waiting, KV
  in flight or decoding);
- `client reset mid-stream`: a stream reset after 1-30 SSE events.
When every client of an episode is done (answered, or gone), only the doomed requests can still
be held in the engines, whose own `/v1/loads` are polled every 3 ms (`probe.Probe`). Per
episode the harness records the **release time** (from the last client's end until both engines
report nothing held; capped at `EPISODE_CAP_SECS`, a release not seen by then counts as not
released) and the **slot-seconds** the engines held in that time (requests held, summed over
both engines, integrated over time): what doomed requests cost after their clients were gone.

Pass (trio_pd): after the quiet period both engines hold no request and no KV token, `/health`
answers, zero crossed outputs, and the router never restarted (its pid unchanged, its log free of
supervisor restarts). Prints the release table by fault kind and a JSON summary, written to
`.cache/chaos/`. A peer router (`--router smg`) is measured, never judged.

    python -m tests.sglang.chaos --secs 120                 # starts the tier's main pair
    python -m tests.sglang.chaos --router both --secs 120   # trio_pd, then SMG 1.13, same pair
    python -m tests.sglang.chaos --prefill URL --bootstrap-port N --decode URL   # a running pair
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import trio

from tests.sglang import faults, pairs
from tests.sglang.conftest import ROUTER_FLAGS, RouterProcess
from tests.sglang.faults import SHAPES, Ledger, Result
from tests.sglang.probe import Probe
from trio_pd_testing.sglang.launcher import SERVED_MODEL_NAME, free_port

KINDS = ("prefill 400", "client reset", "client reset mid-stream")
EPISODE_CAP_SECS = 8.0  # past SGLang's 4 s disconnect poll: what a peer router leaves to it
ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / ".cache" / "chaos"
SMG_CANDIDATES = (ROOT / "bench" / ".peers" / "bin" / "smg", Path("/work/ref/smg-venv/bin/smg"))


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)  # by fate
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # fate -> status -> n
    releases: dict[str, list[float | None]] = field(default_factory=dict)  # kind -> secs
    slot_secs: dict[str, float] = field(default_factory=dict)  # kind -> slot-seconds

    def status(self, fate: str, status: str) -> None:
        by = self.statuses.setdefault(fate, {})
        by[status] = by.get(status, 0) + 1

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for kind in KINDS:
            values = self.releases.get(kind, [])
            seen = sorted(v * 1000 for v in values if v is not None)
            row: dict[str, Any] = {
                "fault": kind,
                "episodes": len(values),
                "doomed": self.requests.get(kind, 0),
                "not_released": sum(1 for v in values if v is None),
                "slot_secs": round(self.slot_secs.get(kind, 0.0), 2),
            }
            if seen:
                row.update(
                    p50_ms=round(statistics.median(seen), 1),
                    p99_ms=round(seen[min(len(seen) - 1, int(0.99 * len(seen)))], 1),
                    max_ms=round(seen[-1], 1),
                )
            rows.append(row)
        return rows


class SmgProcess:
    """SMG 1.13's `smg launch --pd-disaggregation` in front of the pair (bench/.peers)."""

    def __init__(self, pair: Any, log_path: Path) -> None:
        binary = next((str(p) for p in SMG_CANDIDATES if os.access(p, os.X_OK)), None)
        binary = binary or shutil.which("smg")
        if binary is None:
            raise SystemExit("no smg binary: make chaos-sglang-smg installs smg==1.13.0")
        self.port = free_port()
        self.metrics_port = free_port()
        command = [
            binary, "launch", "--pd-disaggregation",
            "--prefill", pair.prefill_url, str(pair.bootstrap_port), "--decode", pair.decode_url,
            "--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin",
            "--disable-retries", "--log-level", "warn",
            "--prometheus-port", str(self.metrics_port),
        ]  # fmt: skip
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """SMG answers /health before it registered its workers (in the background)."""
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"smg exited early:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"smg not ready:\n{self.log()[-3000:]}")
            try:
                workers = httpx2.get(self.url + "/workers", timeout=2).json()
                if len(workers.get("workers") or []) >= 2 and self._generates():
                    return
            except (httpx2.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.5)

    def _generates(self) -> bool:
        payload = faults.body("/generate", False, faults.prompt(1), 2)
        return httpx2.post(self.url + "/generate", json=payload, timeout=60).status_code == 200

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def body(route: str, stream: bool, text: str, n: int) -> dict[str, Any]:
    """`faults.body`, naming the model on the OpenAI routes (SMG refuses them without: 422)."""
    out = faults.body(route, stream, text, n)
    if route != "/generate":
        out["model"] = SERVED_MODEL_NAME
    return out


async def reference(client, url, cache, route, stream, text, n) -> Result | None:
    """An unfaulted answer of the prompt, through the router under test; None if it failed."""
    key = (route, stream, text, n)
    if key not in cache:
        got = await faults.request(client, url, route, stream, body(route, stream, text, n))
        cache[key] = got if got.status == 200 and got.complete else None
    return cache[key]


async def one(client, url, rng: random.Random, fate: str, ledger: Ledger, tally: Tally, cache):
    """One client; returns the moment it was done (answered, or gone)."""
    route, stream = rng.choice(SHAPES)
    if fate == "client reset mid-stream":
        stream = True
    tally.requests[fate] = tally.requests.get(fate, 0) + 1
    seed = rng.randrange(40)  # few prompts: references are reused
    if fate == "normal":
        text = faults.prompt(seed)
        want = await reference(client, url, cache, route, stream, text, 8)
        got = await faults.request(client, url, route, stream, body(route, stream, text, 8))
        if want is None:
            tally.status("reference failed", str(got.status))
        else:
            ledger.compare(f"chaos {faults.shape_name(route, stream)} seed {seed}", got, want)
        tally.status(fate, str(got.status))
        return time.monotonic()
    if fate == "prefill 400":
        text = faults.prompt(seed, words=faults.OVER_CONTEXT_WORDS)
        got = await faults.request(client, url, route, stream, body(route, stream, text, 4))
        tally.status(fate, str(got.status))
        return time.monotonic()
    text = faults.prompt(seed, words=rng.choice((12, faults.LONG_WORDS)))
    kw: dict = {"reset_after": rng.uniform(0.0, 0.8)}
    if fate == "client reset mid-stream":
        kw = {"reset_after_events": rng.randint(1, 30)}
    raw = await faults.raw_post(url, route, body(route, stream, text, 200), **kw)
    tally.status(fate, "reset" if raw.reset_at else str(raw.status))
    return raw.reset_at or time.monotonic()


def slot_seconds(probe: Probe, start: float, end: float) -> float:
    """Requests held by both engines, integrated from `start` to `end` (their snapshots as
    steps; a poll that failed holds the last figure)."""
    total = 0.0
    for samples in probe.samples.values():
        held, at = 0, start
        for sample in samples:
            if sample.sent > end:
                break
            if sample.sent > start:
                total += held * (sample.sent - at)
                at = sample.sent
            if sample.held is not None:
                held = sample.held
        total += held * (end - at)
    return total


async def episode(client, url, rng, kind, width, ledger, tally, cache, probe) -> None:
    ends: list[float] = []

    async def run(fate: str) -> None:
        ends.append(await one(client, url, rng, fate, ledger, tally, cache))

    async with trio.open_nursery() as nursery:
        for i in range(width):
            nursery.start_soon(run, "normal" if i < width // 2 else kind)
    last = max(ends)
    try:
        secs: float | None = max(
            [await probe.released(role, last, timeout=EPISODE_CAP_SECS) for role in probe.urls]
        )
    except trio.TooSlowError:
        secs = None
    tally.releases.setdefault(kind, []).append(secs)
    end = last + (secs if secs is not None else EPISODE_CAP_SECS)
    tally.slot_secs[kind] = tally.slot_secs.get(kind, 0.0) + slot_seconds(probe, last, end)


async def run(name, pair_like, secs, quiet, width, seed, log_dir) -> dict[str, Any]:
    if name == "smg":
        router: Any = SmgProcess(pair_like, log_dir / "router-chaos-smg.log")
    else:
        router = RouterProcess(pair_like, log_dir / "router-chaos.log", ROUTER_FLAGS)
    await trio.to_thread.run_sync(router.wait_ready)
    pid = router.process.pid
    ledger, tally, cache = Ledger(), Tally(), {}
    urls = {"prefill": pair_like.prefill_url, "decode": pair_like.decode_url}
    probe = Probe(urls)
    rng = random.Random(seed)
    started = time.monotonic()
    try:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(120.0)) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(probe.run)
            until = time.monotonic() + secs
            while time.monotonic() < until:
                kind = rng.choice(KINDS)
                await episode(client, router.url, rng, kind, width, ledger, tally, cache, probe)
            ended = time.monotonic()
            # Quiet: nothing in flight from here; both engines must let go of everything.
            try:
                releases = [await probe.released(role, ended, timeout=quiet) for role in urls]
                quiet_release: float | None = max(releases)
            except trio.TooSlowError:
                quiet_release = None
            await trio.sleep(min(quiet, 2.0))
            idle = {role: probe.latest(role) for role in urls}
            health = {}
            for role, url in urls.items():
                health[role] = (await client.get(url + "/health", timeout=15)).status_code
            metrics = ""
            if name != "smg":
                page = await client.get(f"http://127.0.0.1:{router.metrics_port}/metrics")
                metrics = page.text
            probe.stop()
        restarts = router.log().count("restarting") if name != "smg" else 0
        alive = router.process.poll() is None and router.process.pid == pid
    finally:
        router.stop()
    return {
        "router": name,
        "secs": secs,
        "concurrency": width,
        "requests": tally.requests,
        "statuses": tally.statuses,
        "answers_compared": ledger.checked,
        "crossed": ledger.crossed,
        "release_by_fault": tally.table(),
        "slot_secs_doomed": round(sum(tally.slot_secs.values()), 2),
        "quiet_release_ms": None if quiet_release is None else round(quiet_release * 1000, 1),
        "left_held": {r: {"held": s.held, "used_tokens": s.used_tokens}
                      for r, s in idle.items() if s},
        "health": health,
        "router_alive": alive,
        "router_restarts": restarts,
        "audit": [x for x in metrics.splitlines()
                  if x.startswith(("trio_pd_release_audits", "trio_pd_worker_held_beyond"))],
        "wall_secs": round(time.monotonic() - started, 1),
    }  # fmt: skip


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['router']}: {sum(summary['requests'].values())} requests in "
        f"{summary['secs']:g} s, {len(summary['crossed'])} crossed of "
        f"{summary['answers_compared']} compared, {summary['slot_secs_doomed']} slot-seconds "
        f"held after the clients were gone, left held {summary['left_held']}",
        "| fault | episodes | doomed | p50 ms | p99 ms | max ms | not released in "
        f"{EPISODE_CAP_SECS:g} s | slot-s | client statuses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["release_by_fault"]:
        statuses = summary["statuses"].get(row["fault"], {})
        lines.append(
            f"| {row['fault']} | {row['episodes']} | {row['doomed']} | {row.get('p50_ms', '-')} "
            f"| {row.get('p99_ms', '-')} | {row.get('max_ms', '-')} | {row['not_released']} "
            f"| {row['slot_secs']} | {statuses} |"
        )
    lines.append(f"normal: {summary['statuses'].get('normal', {})}; references failed: "
                 f"{summary['statuses'].get('reference failed', {})}")  # fmt: skip
    return "\n".join(lines)


def passed(summary: dict[str, Any]) -> bool:
    return (
        not summary["crossed"]
        and "reference failed" not in summary["statuses"]
        and all(s["held"] == 0 and s["used_tokens"] == 0 for s in summary["left_held"].values())
        and len(summary["left_held"]) == 2
        and all(code == 200 for code in summary["health"].values())
        and summary["router_alive"]
        and summary["router_restarts"] == 0
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secs", type=float, default=120.0)
    parser.add_argument("--quiet", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--router", choices=("trio_pd", "smg", "both"), default="trio_pd")
    parser.add_argument("--prefill")
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument("--decode")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = pairs.LOG_DIR / f"chaos-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ("trio_pd", "smg") if args.router == "both" else (args.router,)
    pair = None
    if args.prefill:
        pair_like: Any = type("P", (), {"prefill_url": args.prefill, "decode_url": args.decode,
                                        "bootstrap_port": args.bootstrap_port})()  # fmt: skip
    else:
        pair = pair_like = pairs.start_main(log_dir)
    summaries: list[dict[str, Any]] = []
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    out = OUT_DIR / f"{stamp}-{args.router}.json"
    try:
        for name in names:
            summary = trio.run(run, name, pair_like, args.secs, args.quiet, args.concurrency,
                               args.seed, log_dir)  # fmt: skip
            summaries.append(summary)
            print(render(summary), file=sys.stderr)
            out.write_text(json.dumps({"date": stamp, "commit": commit, "runs": summaries},
                                      indent=1))  # fmt: skip
    finally:
        if pair is not None:
            pair.stop()
    print(json.dumps(summaries, indent=1))
    print(f"written to {out}", file=sys.stderr)
    trio_pd_runs = [s for s in summaries if s["router"] == "trio_pd"]
    return 0 if all(passed(s) for s in trio_pd_runs) else 1


if __name__ == "__main__":
    sys.exit(main())
