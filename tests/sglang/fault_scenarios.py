"""Engine-direct scenarios of the fault matrix's rows (issue 25): what a router reads of an
engine that is frozen, killed, or moving a request's KV.

Like `tests.sglang.scenarios` (same `Target`, same recording), but these need the engines'
processes: a `Signals` hook sends real signals to an engine's whole process (the real pair's
process group; the simulator's own process) and brings a killed one back. They are recorded
with the rest into `tests/data/sglang_0.5.23_observables.json` (`python -m tests.sglang.record
--only ...` merges them in), re-checked live by `tests/sglang/test_observables.py`, and held
against the simulator's processes by `tests/engine/test_differential.py`.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
import orjson
import trio

from tests.sglang.scenarios import (
    GEN,
    Observables,
    Target,
    bootstrap,
    busy_count,
    event_kind,
    fresh_rid,
    headers,
    load_view,
    loads,
    wait_idle,
)

# A frozen engine is declared unanswering after this long (the router's health checks and
# loads reads time out well before; the engine would answer in milliseconds).
FROZEN_SECS = 2.0
# Long prompts for the transfer window: the tier's prefill moves ~700 tokens' KV per request
# (3 tokens a word), several at once, so the window shows in the prefill's /v1/loads.
TRANSFER_WORDS = 230
TRANSFER_WIDTH = 8


@dataclass
class Signals:
    """Real signals to a pair's engines: `send(role, signum)`; `restart(role)` after a kill
    (returns once the engine answers again)."""

    send: Callable[[str, int], None]
    restart: Callable[[str], Awaitable[None]]


FaultScenario = Callable[[Target, Signals, httpx2.AsyncClient], Awaitable[Observables]]


def url_of(t: Target, role: str) -> str:
    return t.prefill_url if role == "prefill" else t.decode_url


LOADED_SECS = 120.0  # hang guards of the signal scenarios, for a machine busy with other work


async def read_outcome(client: httpx2.AsyncClient, method: str, url: str, secs: float) -> str:
    """What a reader of `url` gets within `secs`: `answered <status>`, `connect refused`,
    `no answer` (connected, nothing came back), or the transport error's class."""
    try:
        with trio.fail_after(secs):
            response = await client.request(method, url)
    except trio.TooSlowError:
        return "no answer"
    except httpx2.ConnectError:
        return "connect refused"
    except httpx2.TransportError as exc:
        return type(exc).__name__
    return f"answered {response.status_code}"


async def connect_outcome(url: str) -> str:
    """Whether a TCP connect to the engine's HTTP port is accepted (the kernel's backlog)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with trio.fail_after(FROZEN_SECS):
            stream = await trio.open_tcp_stream(host, int(port))
    except (OSError, trio.TooSlowError) as exc:
        return type(exc).__name__
    await stream.aclose()
    return "accepted"


async def frozen_engine(t: Target, sig: Signals, client: httpx2.AsyncClient) -> Observables:
    """The prefill SIGSTOPped whole (a frozen process): a connect is still accepted (the
    kernel's backlog), `/health` and `/v1/loads` answer nothing; SIGCONT, and both answer
    again, with nothing held (what the router's health checks and loads reads see of a freeze)."""
    out: Observables = {}
    sig.send("prefill", signal.SIGSTOP)
    try:
        out["connect"] = await connect_outcome(t.prefill_url)
        out["health"] = await read_outcome(client, "GET", t.prefill_url + "/health", FROZEN_SECS)
        out["v1_loads"] = await read_outcome(
            client, "GET", t.prefill_url + "/v1/loads", FROZEN_SECS
        )
    finally:
        sig.send("prefill", signal.SIGCONT)
    with trio.fail_after(30):
        out["v1_loads_after_resume"] = await read_outcome(
            client, "GET", t.prefill_url + "/v1/loads", 30
        )
        out["health_after_resume"] = await read_outcome(
            client, "GET", t.prefill_url + "/health", 30
        )
    out["held_after_resume"] = await busy_count(client, t.prefill_url)
    return out


async def _leg(client: httpx2.AsyncClient, url: str, body: dict, box: dict, started: Any) -> None:
    """One leg read by hand: its status once headers came, its events, how it ended."""
    box.update(status=None, events=[], ending=None)
    try:
        async with client.stream("POST", url, json=body) as response:
            box["status"] = response.status_code
            started.set()
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    box["events"].append(line[5:].strip())
                    started.set()
        box["ending"] = "complete"
    except httpx2.RemoteProtocolError as exc:
        text = str(exc)
        if "without sending" in text and "response" in text:
            box["ending"] = "closed before headers"
        elif "incomplete chunked read" in text or "peer closed" in text:
            box["ending"] = "body cut"
        else:
            box["ending"] = f"RemoteProtocolError: {text}"
    except httpx2.ReadError:
        box["ending"] = "reset"
    except httpx2.TransportError as exc:
        box["ending"] = type(exc).__name__
    finally:
        started.set()


def _leg_view(box: dict) -> Observables:
    data = [e for e in box["events"] if e != "[DONE]"]
    kinds = sorted({event_kind(orjson.loads(e)) for e in data})
    return {
        "status": box["status"],
        "any_event": bool(data),
        "event_kinds": kinds,
        "ended_with_done": bool(box["events"]) and box["events"][-1] == "[DONE]",
        "ending": box["ending"],
    }


async def decode_killed(t: Target, sig: Signals, client: httpx2.AsyncClient) -> Observables:
    """The decode SIGKILLed with a stream decoding (its prefill done) and two legs waiting for
    KV that never comes (a stream and a whole answer): what each leg sees (the stream's
    headers and first events came, then its body is cut; a waiting leg's connection closes
    before any headers, streamed or not), and that the prefill holds nothing after."""
    out: Observables = {}
    legs: dict[str, dict] = {name: {} for name in ("decoding", "waiting_stream", "waiting_plain")}
    # As long as the prefill's context (1024) lets it: still decoding when the kill comes.
    long_gen = {"text": "go on", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    # The two waiters first: they wait for a KV that never comes (no prefill leg), so they stay
    # held as long as it takes; then the decoding stream, killed at its third event. (The other
    # order raced: the 1000-token stream ends ~2.7 s after its KV came, and on a loaded machine
    # the waiters were not yet shown held by then: this scenario's live flake, reproduced
    # 2026-12-05 under CPU load.)
    async with trio.open_nursery() as nursery:
        started = {name: trio.Event() for name in legs}
        for name, stream in (("waiting_stream", True), ("waiting_plain", False)):
            waiting = {**GEN, **bootstrap(t), "rid": fresh_rid("kwait"), "stream": stream}
            nursery.start_soon(
                _leg, client, t.decode_url + "/generate", waiting, legs[name], started[name]
            )
        with trio.fail_after(LOADED_SECS):  # hang guards, for a machine busy with other work
            while (await loads(client, t.decode_url))["loads"][0]["num_waiting_reqs"] < 2:
                await trio.sleep(0.005)
            # and the waiting stream's headers came (both engines send them before its KV):
            # a kill before them would be another row
            await started["waiting_stream"].wait()
        body = {**long_gen, **bootstrap(t), "rid": fresh_rid("kdec"), "stream": True}
        nursery.start_soon(
            _leg, client, t.decode_url + "/generate", body, legs["decoding"], started["decoding"]
        )

        async def prefill_leg() -> None:
            out["prefill_status"] = (
                await client.post(t.prefill_url + "/generate", json=body)
            ).status_code

        nursery.start_soon(prefill_leg)
        with trio.fail_after(LOADED_SECS):
            await started["decoding"].wait()
            while len(legs["decoding"]["events"]) < 3:  # tokens came: it decodes
                assert legs["decoding"]["ending"] is None, legs["decoding"]
                await trio.sleep(0.005)
        sig.send("decode", signal.SIGKILL)
    for name, box in legs.items():
        out[name] = _leg_view(box)
    # The next read, once the killed process's sockets are gone (its teardown takes a moment).
    with trio.move_on_after(LOADED_SECS):
        while (after := await read_outcome(client, "GET", t.decode_url + "/v1/loads", 1.0)) in (
            "no answer",
            "ReadError",
            "RemoteProtocolError",
        ):
            await trio.sleep(0.05)
    out["decode_after"] = after
    await wait_idle(client, t.prefill_url)
    out["prefill_held_after"] = await busy_count(client, t.prefill_url)
    await sig.restart("decode")
    return out


async def loads_in_kv_transfer(t: Target, sig: Signals, client: httpx2.AsyncClient) -> Observables:
    """The prefill's `/v1/loads` with requests in the transfer stage (their KV computed and on
    its way to the decode: `prefill_inflight_queue_reqs`), several long prompts at once so the
    window shows (load_inquirer.py): the transfer is counted in neither `num_running_reqs` nor
    `num_waiting_reqs` (those are the bootstrap and compute queues), so the router's `queued`
    leaves it out; and the window closes (nothing held once the answers are in)."""
    del sig
    key = t.admin_api_key or t.api_key
    from tests.sglang.faults import prompt

    snapshot: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def one(i: int) -> None:
            text = prompt(7000 + i, words=TRANSFER_WORDS)
            body = {
                "text": text,
                "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                "rid": fresh_rid("xfer"),
                **bootstrap(t),
            }
            async with trio.open_nursery() as legs:
                for url in (t.prefill_url, t.decode_url):
                    legs.start_soon(
                        lambda u=url: client.post(u + "/generate", json=body, headers=headers(key))
                    )

        for i in range(TRANSFER_WIDTH):
            nursery.start_soon(one, i)
        with trio.fail_after(60):
            while True:
                answer = await loads(client, t.prefill_url, key=key)
                disagg = answer["loads"][0].get("disaggregation") or {}
                if disagg.get("prefill_inflight_queue_reqs", 0) > 0:
                    snapshot = answer
                    break
                await trio.sleep(0.002)
    from trio_pd.control.engine_info import parse_v1_loads

    rank = parse_v1_loads(orjson.dumps(snapshot)).ranks[0]
    load = snapshot["loads"][0]
    disagg = load["disaggregation"]
    queued_for_compute = (load.get("queues") or {}).get("waiting", 0)
    print(f"loads_in_kv_transfer snapshot: {load_view(snapshot)}", file=sys.stderr)
    await wait_idle(client, t.prefill_url)
    await wait_idle(client, t.decode_url)
    return {
        "inflight_seen": disagg["prefill_inflight_queue_reqs"] > 0,
        "disaggregation_keys": sorted(k for k in disagg if k.endswith("_reqs")),
        # 0: num_waiting_reqs is the bootstrap queue plus the compute queue, not the transfers
        "waiting_minus_bootstrap_and_queue": load["num_waiting_reqs"]
        - disagg["prefill_bootstrap_queue_reqs"]
        - queued_for_compute,
        "router_sending_is_the_inflight_queue": rank.sending
        == disagg["prefill_inflight_queue_reqs"],
        "router_queued_is_the_compute_queue": rank.queued == queued_for_compute,
        "router_waiting_for_kv": rank.waiting_for_kv,
        "held_after": await busy_count(client, t.prefill_url),
    }


# Scenarios that signal the main pair's engines (run after the others: one restarts an engine).
FAULT_SCENARIOS: dict[str, FaultScenario] = {
    "frozen_engine": frozen_engine,
    "loads_in_kv_transfer": loads_in_kv_transfer,
    "decode_killed": decode_killed,
}
