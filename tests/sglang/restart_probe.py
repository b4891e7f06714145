"""What a real SGLang 0.5.23 decode does when its prefill is restarted on the same address.

`python -m tests.sglang.restart_probe [--rounds N] [--out FILE]` (under `flock
/work/real-engine.lock`): one pair, engine-direct (no router). Each round SIGKILLs the
prefill's process group and starts it again on its own ports, either at once (`quick`) or
only after the decode's log says it forgot the dead prefill (`noticed`: SGLang's "Lost
connection with prefill instance", after `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE` (2)
missed heartbeats `SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL` (5 s) apart,
`disaggregation/common/conn.py`). Then one PD request, given `TRY_SECS`: did it complete?

Why it matters (issue 25, docs/protocol.md §10): a decode registers its KV buffers with a
prefill once, when it first reaches that prefill's bootstrap address, and keeps them until a
heartbeat failure makes it forget the address. A restarted prefill's bootstrap server starts
in its tokenizer manager, before its scheduler has loaded the model
(`entrypoints/engine.py` `_launch_subprocesses`), so its `/health` answers again within
seconds: a decode that missed fewer than two heartbeats meanwhile never re-registers, and every
later PD request through that pair waits in both engines for a transfer that cannot happen.

The round prints, per round: the seconds from the kill until the new bootstrap server answered
`/health`, whether the decode had logged the loss before the request, and the request's fate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import httpx2
import trio

from tests.sglang import pairs
from tests.sglang.scenarios import GEN, bootstrap, busy_count, fresh_rid
from trio_pd_testing.real_pair import http_status
from trio_pd_testing.sglang import SGLangPair

LOST = "Lost connection with prefill instance"
TRY_SECS = 30.0
NOTICE_SECS = 60.0


async def pd_once(pair: SGLangPair, client: httpx2.AsyncClient) -> dict[str, Any]:
    """One PD request engine-direct; its fate within TRY_SECS, and what the engines held."""
    t = pairs.target(pair)
    rid = fresh_rid("restart")
    body = {**GEN, **bootstrap(t), "rid": rid}
    out: dict[str, Any] = {}
    t0 = time.monotonic()

    async def leg(name: str, url: str) -> None:
        r = await client.post(url + "/generate", json=body)
        out[name] = r.status_code

    with trio.move_on_after(TRY_SECS) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leg, "prefill", t.prefill_url)
            nursery.start_soon(leg, "decode", t.decode_url)
    out["secs"] = round(time.monotonic() - t0, 2)
    out["completed"] = not scope.cancelled_caught and out.get("decode") == 200
    if scope.cancelled_caught:
        out["held"] = {
            "prefill": await busy_count(client, t.prefill_url),
            "decode": await busy_count(client, t.decode_url),
        }
        for url in (t.prefill_url, t.decode_url):
            await client.post(url + "/abort_request", json={"rid": rid})
    return out


def bootstrap_up_after(pair: SGLangPair, killed: float, stop: list[bool]) -> float | None:
    """Seconds from the kill until the prefill's bootstrap server answers `/health`."""
    url = f"http://127.0.0.1:{pair.bootstrap_port}/health"
    while not stop:
        if http_status(url, timeout=0.5) == 200:
            return round(time.monotonic() - killed, 2)
        time.sleep(0.05)
    return None


async def one_round(pair: SGLangPair, client: httpx2.AsyncClient, how: str) -> dict[str, Any]:
    log = pair.decode.log_text
    lost_before = log().count(LOST)
    killed = time.monotonic()
    os.killpg(pair.prefill.pid, signal.SIGKILL)
    out: dict[str, Any] = {"how": how}
    if how == "noticed":
        with trio.fail_after(NOTICE_SECS):
            while log().count(LOST) == lost_before:
                await trio.sleep(0.1)
        out["noticed_after"] = round(time.monotonic() - killed, 2)
    stop: list[bool] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            out["bootstrap_up_after"] = await trio.to_thread.run_sync(
                bootstrap_up_after, pair, killed, stop
            )

        nursery.start_soon(watch)
        out["restart_secs"] = round(await trio.to_thread.run_sync(pair.restart, "prefill"), 1)
        stop.append(True)
    out["decode_logged_loss"] = log().count(LOST) > lost_before
    out["request"] = await pd_once(pair, client)
    return out


async def main_async(pair: SGLangPair, rounds: int) -> list[dict[str, Any]]:
    report = []
    async with httpx2.AsyncClient(timeout=60) as client:
        warm = await pd_once(pair, client)
        assert warm["completed"], warm
        for _ in range(rounds):
            for how in ("quick", "noticed"):
                result = await one_round(pair, client, how)
                print(json.dumps(result), file=sys.stderr, flush=True)
                report.append(result)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pair = SGLangPair.start(log_dir=pairs.LOG_DIR / "restart-probe", name="probe")
    try:
        report = trio.run(main_async, pair, args.rounds)
    finally:
        pair.stop()
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
