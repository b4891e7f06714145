"""Scenario `teardown`: how fast a router lets go of the decode leg when the request is doomed.

For each prefill failure (status 500, status 400, in-band SSE error, closed connection, connection
refused), streaming and not, and for a client that disconnects during prefill or mid-stream, the
engines' event logs give, per request (matched by bootstrap_room, so no router has to forward
x-request-id):

- `closed_ms`: from the failure to the decode engine seeing its connection closed
  (`connection_closed`): the router side of the teardown;
- `freed_ms`: from the failure to the decode slot being freed (`slot_freed`, whatever freed it);
- `freed_by`: what freed it: `abort` (the router's `POST /abort_request` reached the decode engine:
  reason `aborted_request`, milliseconds), `poll` (the engine's disconnect poll noticed the closed
  connection: `aborted_disconnect`; every 4 s like SGLang, so up to 4 s after `closed_ms`),
  `timeout` (the KV never came: `kv_wait_timeout`, the waiting timeout, 20 s here), `never` (still
  held when the phase gave up waiting), `no slot` (the request ended before it took a slot);
  requests the decode engine never received are left out (`decode_saw` counts the others);
  mixed outcomes read `abort 2, poll 1`;
- the client's status and how long the client waited.

The failure instant is the prefill engine's `fault` event; for "refused" (nothing listens on the
prefill port) it is the decode's `request_start` (the router sends both legs at once and the refusal
is immediate); for client disconnects it is when the client closed its socket.

Faults are engine-wide (`--fault prefill:KIND`, the prefill engine restarted on the same ports for
each kind), not the request's `sim_fault` field: SMG drops unknown request fields.

Connection refused, for every router: the prefill engine runs normally while the router starts
(SMG refuses to start with an unreachable worker), then it is stopped and restarted on the same
bootstrap port with `--fault refuse` (its bootstrap server listens; nothing listens on the HTTP
port the router knows). Routers' health checks (60 s interval, 3 failures) do not notice within
the phase.
Retries and circuit breakers are disabled on every router (one attempt per request).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import trio

from bench import stats
from bench.harness import output, procs
from bench.harness.output import print_flush
from bench.httpc import Connection, Reply, one_request
from bench.stats import pct

NAME = "teardown"
KINDS = ("500", "400", "sse_error", "close")
COLUMNS = (
    "router", "case", "stream", "n", "decode_saw", "client_status", "client_wait_p50_ms",
    "closed_p50_ms", "closed_max_ms", "freed_p50_ms", "freed_max_ms", "freed_by", "abort_early",
    "not_closed",
)  # fmt: skip
# slot_freed reason -> what freed the slot (the `freed_by` column)
FREED_BY = {
    "aborted_request": "abort",
    "aborted_disconnect": "poll",
    "kv_wait_timeout": "timeout",
    "finished": "finished",
}
POLL_SECS = 4.0


def settings(quick: bool) -> dict[str, Any]:
    return {"n": 3 if quick else 5, "waiting_timeout": 20.0, "stagger": 0.1}


def body(stream: bool, fault: str | None = None, tokens: int = 16) -> dict[str, Any]:
    b: dict[str, Any] = {
        "text": "teardown probe",
        "sampling_params": {"max_new_tokens": tokens},
        "stream": stream,
    }
    if fault:
        b["sim_fault"] = fault
    return b


# ---- client side ----------------------------------------------------------------------------
async def fire_all(port: int, jobs: list[dict[str, Any]], stagger: float, timeout: float):  # noqa: ASYNC109
    """Send every job's body at once (staggered), each on its own connection."""
    replies: list[Reply | None] = [None] * len(jobs)

    async def one(i: int) -> None:
        await trio.sleep(i * stagger)
        job = jobs[i]
        replies[i] = await one_request(
            procs.HOST, port, "POST", "/generate", orjson.dumps(job["body"]), timeout=timeout
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(one, i)
    return replies


async def disconnect_one(port: int, b: dict[str, Any], after_s: float, after_events: int):
    """Send, then close the socket after `after_s` or after `after_events` SSE events."""
    conn = Connection(procs.HOST, port)
    await conn.connect()
    assert conn.stream is not None
    raw = orjson.dumps(b)
    head = (
        f"POST /generate HTTP/1.1\r\nhost: {procs.HOST}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode()
    t_send = time.monotonic()
    await conn.stream.send_all(head + raw)
    events = 0
    with trio.move_on_after(after_s if after_events == 0 else 30.0):
        buf = b""
        while after_events == 0 or events < after_events:
            data = await conn.stream.receive_some(65536)
            if not data:
                break
            buf += data
            events = buf.count(b"data:")
    t_close = time.monotonic()
    await conn.aclose()
    return {"t_send": t_send, "t_close": t_close, "events": events}


# ---- engine side ----------------------------------------------------------------------------
def index(events: list[dict[str, Any]]) -> dict[Any, dict[str, dict[str, Any]]]:
    """room -> event name -> first record. An `abort_request` that came before the engine had
    the request (`matched` false, no room: the engine dropped it) is filed under its rid's room
    as `abort_early` (the first one, with `count`)."""
    out: dict[Any, dict[str, dict[str, Any]]] = {}
    unmatched: dict[str, list[float]] = {}
    for e in events:
        room = e.get("room")
        if room is None:
            rid = e.get("sglang_rid")
            if e["event"] == "abort_request" and not e.get("matched") and isinstance(rid, str):
                unmatched.setdefault(rid, []).append(e["t"])
            continue
        out.setdefault(room, {}).setdefault(e["event"], e)
    for ev in out.values():
        start = ev.get("request_start")
        rid = start.get("sglang_rid") if start else None
        if not isinstance(rid, str):
            continue
        early = [t for t in unmatched.get(rid, []) if t < start["t"]]
        if early:
            ev["abort_early"] = {"event": "abort_early", "t": early[0], "count": len(early)}
    return out


def wait_freed(c: procs.Cluster, rooms: set[Any], deadline: float, unseen_s: float = 2.0):
    """Until the decode engine is done with every room (its slot freed, or the request ended
    without one), or the deadline; rooms the decode engine has not seen after `unseen_s` (the
    router gave up on the decode leg before the request got there) are not waited for."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        dec = index(c.decode.events())
        if time.monotonic() - t0 > unseen_s:
            rooms = {r for r in rooms if r in dec}
        if all("slot_freed" in dec.get(r, {}) or "request_end" in dec.get(r, {}) for r in rooms):
            return
        time.sleep(0.25)


def measure(room: Any, t_fail: float, dec: dict[Any, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    ev = dec.get(room, {})
    closed = ev.get("connection_closed")
    freed = ev.get("slot_freed")
    reason = freed.get("reason") if freed else "not freed"
    abort = ev.get("abort_request")  # the first abort that found the request (matched)
    if freed is None and "slot_acquired" not in ev:
        freed = ev.get("request_end")  # it never took a slot: done when the engine was
        reason = "no slot"
    return {
        "closed_s": closed["t"] - t_fail if closed else None,
        "freed_s": freed["t"] - t_fail if freed else None,
        "abort_s": abort["t"] - t_fail if abort else None,
        "abort_early": "abort_early" in ev,
        "freed_reason": reason,
        "freed_by": freed_by(ev),
        "decode_seen": bool(ev),
    }


def freed_by(ev: dict[str, dict[str, Any]]) -> str:
    """What freed a request's decode slot, from its decode events (event name -> first record).
    A request that ended before it took a slot (the abort came while it registered its room) is
    `abort (no slot)` (or `no slot` when something else ended it)."""
    if not ev:
        return "not seen"
    freed = ev.get("slot_freed")
    if freed is not None:
        reason = freed.get("reason") or "?"
        return FREED_BY.get(reason, reason)
    if "slot_acquired" in ev:
        return "never"
    return "abort (no slot)" if "abort_request" in ev else "no slot"


def tally(values: list[str]) -> str:
    """`abort` when all agree, else `abort 2, poll 1` (most frequent first); `-` for none."""
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), "-")
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def aggregate(
    router: str, case: str, stream: bool, items: list[dict[str, Any]], clients: list[Any]
) -> dict[str, Any]:
    closed = [i["closed_s"] for i in items if i["closed_s"] is not None]
    freed = [i["freed_s"] for i in items if i["freed_s"] is not None]
    aborts = [i["abort_s"] for i in items if i["abort_s"] is not None]
    reasons = sorted({i["freed_reason"] for i in items if i["decode_seen"]})
    statuses: dict[str, int] = {}
    waits = []
    for r in clients:
        if r is None:
            continue
        if isinstance(r, Reply):
            key = str(r.status) if r.error is None else f"{r.status or ''}{r.error}"
            waits.append(r.latency)
        else:
            key = "disconnected"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "router": router,
        "case": case,
        "stream": stream,
        "n": len(clients),
        "decode_saw": sum(1 for i in items if i["decode_seen"]),
        "client_status": " ".join(f"{k}x{v}" for k, v in sorted(statuses.items())),
        "client_wait_p50_ms": stats.ms(pct(waits, 50)),
        "closed_p50_ms": stats.ms(pct(closed, 50)),
        "closed_max_ms": stats.ms(max(closed)) if closed else None,
        "freed_p50_ms": stats.ms(pct(freed, 50)),
        "freed_max_ms": stats.ms(max(freed)) if freed else None,
        "freed_by": tally([i["freed_by"] for i in items if i["decode_seen"]]),
        "abort_p50_ms": stats.ms(pct(aborts, 50)),
        "abort_early": sum(1 for i in items if i["abort_early"]),
        "aborts_matched": len(aborts),
        "not_closed": sum(1 for i in items if i["decode_seen"] and i["closed_s"] is None),
        "not_freed": sum(1 for i in items if i["decode_seen"] and i["freed_s"] is None),
        "freed_reason": ",".join(reasons),
        "samples": items,
    }


# ---- phases ---------------------------------------------------------------------------------
def restart_prefill(c: procs.Cluster, args: list[str], name: str) -> float:
    """Restart the prefill engine on the same ports with engine-wide faults (SMG drops the
    request's unknown `sim_fault` field, so faults are set on the engine for every router).
    Returns the time after a throw-away probe (which lets routers drop stale pooled connections);
    only engine events after it count."""
    port, bport = c.prefill.port, c.prefill.bootstrap_port
    c.prefill.proc.stop()
    c.prefill = procs.start_engine(
        "prefill", c.logdir, port=port, bootstrap_port=bport, args=args, name=name
    )
    procs.http_post(c.router_port, "/generate", body(False), timeout=5.0)
    return time.monotonic()


def phase_faults(c: procs.Cluster, router: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    timeout = s["waiting_timeout"] + 15
    runs = []
    for kind in KINDS:
        t_ready = restart_prefill(c, ["--fault", f"prefill:{kind}"], f"prefill-{kind}")
        jobs = [{"stream": st, "body": body(st)} for st in (False, True) for _ in range(s["n"])]
        replies = trio.run(fire_all, c.router_port, jobs, s["stagger"], timeout)
        pre = [e for e in c.prefill.events() if e["t"] >= t_ready]
        runs.append((kind, jobs, replies, pre))
        # before the next restart: stopping this prefill would break the decode's bootstrap
        # registrations and free its slots (reason "error"), hiding what the router did
        rooms = {e["room"] for e in pre if e["event"] == "fault"}
        wait_freed(c, rooms, time.monotonic() + s["waiting_timeout"] + POLL_SECS + 3)
    dec = index(c.decode.events())
    rows = []
    for kind, jobs, replies, pre in runs:
        starts = {e["room"]: e for e in pre if e["event"] == "request_start"}
        for stream in (False, True):
            items = [
                {"room": f["room"], **measure(f["room"], f["t"], dec)}
                for f in pre
                if f["event"] == "fault" and starts.get(f["room"], {}).get("stream") == stream
            ]
            clients = [r for j, r in zip(jobs, replies, strict=True) if j["stream"] == stream]
            rows.append(aggregate(router, f"prefill {kind}", stream, items, clients))
    return rows


def phase_disconnect(c: procs.Cluster, router: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    cases = [
        ("client gone in prefill", False, body(False), 0.3, 0, ["--fault", "prefill:hang"]),
        ("client gone in prefill", True, body(True), 0.3, 0, ["--fault", "prefill:hang"]),
        ("client gone mid-stream", True, body(True, None, tokens=400), 0.0, 20, []),
    ]
    rows = []
    for n, (case, stream, b, after_s, after_events, args) in enumerate(cases):
        restart_prefill(c, args, f"prefill-disconnect-{n}")
        records = []
        for _ in range(s["n"]):
            records.append(trio.run(disconnect_one, c.router_port, b, after_s, after_events))
            time.sleep(0.05)
        pre = c.prefill.events()
        rooms = []
        for rec in records:
            match = [
                e
                for e in pre
                if e["event"] == "request_start" and rec["t_send"] <= e["t"] <= rec["t_close"]
            ]
            rooms.append(match[0]["room"] if match else None)
        wait_freed(c, {r for r in rooms if r is not None}, time.monotonic() + POLL_SECS + 3)
        dec = index(c.decode.events())
        pidx = index(c.prefill.events())
        items = []
        for rec, room in zip(records, rooms, strict=True):
            if room is None:
                continue
            item = {"room": room, **measure(room, rec["t_close"], dec)}
            pclosed = pidx.get(room, {}).get("connection_closed")
            item["prefill_closed_s"] = pclosed["t"] - rec["t_close"] if pclosed else None
            items.append(item)
        row = aggregate(router, case, stream, items, ["x"] * len(records))
        pc = [i["prefill_closed_s"] for i in items if i["prefill_closed_s"] is not None]
        row["prefill_closed_p50_ms"] = stats.ms(pct(pc, 50))
        rows.append(row)
    return rows


def phase_refuse(c: procs.Cluster, router: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    port, bport = c.prefill.port, c.prefill.bootstrap_port
    c.prefill.proc.stop()
    # The bootstrap server comes back on its port; the HTTP port stays closed (nothing listens,
    # so connects are refused). The engine's own `refuse` port is elsewhere: binding the old
    # HTTP port can fail while the router's closed connections to it sit in TIME_WAIT.
    c.prefill = procs.start_engine(
        "prefill", c.logdir, port=procs.free_port(), bootstrap_port=bport,
        args=["--fault", "refuse"], name="prefill-refuse",
    )  # fmt: skip
    c.prefill.port = port
    procs.wait_until(
        lambda: _tcp_open(bport) and not _tcp_open(port), 20, "refusing prefill", c.prefill.proc
    )
    t_phase = time.monotonic()
    jobs = [
        {"stream": stream, "body": body(stream)} for stream in (False, True) for _ in range(s["n"])
    ]
    replies = trio.run(fire_all, c.router_port, jobs, s["stagger"], s["waiting_timeout"] + 15)
    starts = [e for e in c.decode.events() if e["event"] == "request_start" and e["t"] >= t_phase]
    wait_freed(
        c, {e["room"] for e in starts}, time.monotonic() + s["waiting_timeout"] + POLL_SECS + 3
    )
    dec = index(c.decode.events())
    rows = []
    for stream in (False, True):
        items = [
            {"room": e["room"], **measure(e["room"], e["t"], dec)}
            for e in starts
            if e.get("stream") == stream
        ]
        clients = [r for j, r in zip(jobs, replies, strict=True) if j["stream"] == stream]
        rows.append(aggregate(router, "prefill refused", stream, items, clients))
    return rows


def _tcp_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((procs.HOST, port)) == 0


def run(router: str, quick: bool = False) -> dict[str, Any]:
    s = settings(quick)
    decode_args = [
        "--disconnect-poll-secs", str(POLL_SECS), "--waiting-timeout", str(s["waiting_timeout"]),
        "--inter-token-ms", "10", "--max-running", "256",
    ]  # fmt: skip
    rows = []
    with procs.cluster(
        router, decode_args=decode_args, router_args=procs.failure_router_args(router)
    ) as c:
        rows += phase_faults(c, router, s)
        rows += phase_disconnect(c, router, s)
        rows += phase_refuse(c, router, s)
    for row in rows:
        print_flush(
            f"  teardown {router} {row['case']} stream={row['stream']}: decode closed "
            f"{row['closed_p50_ms']} ms, slot freed {row['freed_p50_ms']} ms by {row['freed_by']}, "
            f"client {row['client_status']} after {row['client_wait_p50_ms']} ms"
        )
    return {
        "scenario": NAME,
        "router": router,
        "quick": quick,
        "settings": {**s, "disconnect_poll_secs": POLL_SECS},
        "rows": rows,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per case: ms from the failure to the decode slot being freed (0 when the decode engine never
    got the request), and the client's wait."""
    out: dict[str, Any] = {}
    for row in result["rows"]:
        tag = f"{row['case'].replace('prefill ', '')}{' st' if row['stream'] else ''}"
        freed = row["freed_p50_ms"] if row["decode_saw"] else 0.0
        out[f"teardown {tag} slot freed ms"] = freed
        if row["client_wait_p50_ms"] is not None:
            out[f"teardown {tag} client wait ms"] = row["client_wait_p50_ms"]
    return out


def compare(results: dict[str, list[dict[str, Any]]]) -> str:
    """The routers side by side, one line per case: closed_ms, freed_ms (medians over the
    repetitions of each repetition's p50) and freed_by (every repetition's, tallied)."""
    routers = [r for r, reps in results.items() if reps]
    keys: list[tuple[str, bool]] = []
    cells: dict[tuple[str, bool, str], list[dict[str, Any]]] = {}
    for router in routers:
        for result in results[router]:
            for row in result["rows"]:
                key = (row["case"], row["stream"])
                if key not in keys:
                    keys.append(key)
                cells.setdefault((*key, router), []).append(row)
    columns = ["case", "stream"]
    for router in routers:
        columns += [f"{router} closed_ms", f"{router} freed_ms", f"{router} freed_by"]
    lines = []
    for case, stream in keys:
        line: dict[str, Any] = {"case": case, "stream": stream}
        for router in routers:
            rows = cells.get((case, stream, router), [])
            line[f"{router} closed_ms"] = stats.median(r["closed_p50_ms"] for r in rows)
            line[f"{router} freed_ms"] = stats.median(r["freed_p50_ms"] for r in rows)
            by = [part for r in rows for part in _untally(r.get("freed_by", "-"))]
            line[f"{router} freed_by"] = tally(by)
        lines.append(line)
    reps = max(len(results[r]) for r in routers) if routers else 0
    title = (
        f"== teardown side by side (ms from the failure to the decode engine's connection_closed "
        f"and slot_freed; medians of {reps} repetition(s)) =="
    )
    return output.table(lines, columns, title)


def _untally(text: str) -> list[str]:
    """`abort 2, poll 1` -> ["abort", "abort", "poll"] (the inverse of tally)."""
    out: list[str] = []
    for part in text.split(", "):
        if part == "-":
            continue
        name, _, count = part.rpartition(" ")
        if name and count.isdigit():
            out += [name] * int(count)
        else:
            out.append(part)
    return out


def main(argv: list[str] | None = None) -> None:
    args = procs.scenario_parser(__doc__).parse_args(argv)
    result = run(args.router, args.quick)
    output.report(NAME, result, COLUMNS, "teardown (ms from the failure)")


if __name__ == "__main__":
    main()
