"""Scenario `rolling`: a rolling restart of every decode under steady load (issue 29, part 4).

One simulated prefill, three simulated decodes (`--inter-token-ms 10`), a router in front with
1 s health checks and its own defaults otherwise (retries on). Twelve clients in a closed loop
stream greedy `/generate` requests of 48 tokens. After a steady window, each decode in turn is
killed (SIGKILL: every connection dropped at once, as a crashed or killed SGLang server) once at
least two streams are mid-stream on it (its event log shows their first token and no freed slot:
killed by what happened, not by a clock), stays down `down_s`, is started again on its port,
and the next one is killed only once the restarted one has streamed a first token again (it is
back in rotation). A steady window after the last restart ends the run.

Every answer is checked against the simulator's deterministic tokens (`tok1 ... tok48`, the
counts in `meta_info`, one `[DONE]`): an error event, a transport error, a non-200 or a short or
wrong answer is a client-visible failure. Reported per router: failures (all of them fall in the
restart window), p50/p99 latency of the answers that started or ended in the restart window
against the steady window before it, the requests resumed and the prompt tokens prefilled again
for them (the prefills' `input_ids` requests: prompt plus the tokens already sent; the decode
work done before the kill is kept), and the tokens the failed answers had already streamed (a
client's retry decodes them again). Targets: trio_pd (migration on, `--migration-limit 2`, the
default), trio_pd_nomigrate (`--migration-limit 0`) and SMG 1.13 (`smg launch`), alternating.

    .venv/bin/python -m bench.rolling [--quick] [--routers trio_pd,trio_pd_nomigrate,smg]
        [--repeat N] [--plot PNG]
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio

from bench import stats, teardown
from bench.harness import procs, run
from bench.harness.output import print_flush
from bench.harness.run import Phase, Scenario, Verdict
from bench.httpc import one_request
from bench.stats import pct
from trio_pd_testing.engine.workload import output_text

NAME = "rolling"
LOAD = (
    "12 clients in a closed loop of greedy /generate streams of 48 tokens at 10 ms; one "
    "simulated prefill, three decodes, each SIGKILLed in turn once two streams are mid-stream "
    "on it and restarted on its port; 1 s health checks, retries on"
)


def settings(quick: bool) -> dict[str, Any]:
    return {
        "clients": 12,
        "tokens": 48,
        "inter_token_ms": 10.0,
        "decodes": 3,
        "kill_when_streams": 2,  # mid-stream on the decode about to be killed
        "down_s": 0.5 if quick else 1.0,
        "steady_s": 3.0 if quick else 6.0,
        "back_timeout_s": 20.0,
        "client_timeout_s": 30.0,
    }


@attrs.define
class EventTail:
    """A decode's event log read as it grows: the rooms mid-stream (a first token out, the slot
    not freed) and how many first tokens it has streamed."""

    path: Path
    offset: int = 0
    open_rooms: set[Any] = attrs.Factory(set)
    first_tokens: int = 0

    def ready(self, open_rooms: int, first_tokens: int = 0) -> bool:
        self.poll()
        return len(self.open_rooms) >= open_rooms and self.first_tokens >= first_tokens

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(line)
                if event["event"] == "first_token":
                    self.first_tokens += 1
                    self.open_rooms.add(event["room"])
                elif event["event"] == "slot_freed":
                    self.open_rooms.discard(event["room"])


@attrs.define
class Fleet:
    logdir: Path
    prefill: procs.Engine
    decodes: list[procs.Engine]
    router: procs.Proc
    port: int
    decode_args: list[str]
    retired: list[procs.Engine] = attrs.Factory(list)  # killed incarnations (their event logs)

    def stop(self) -> None:
        for proc in (self.router, self.prefill.proc, *(d.proc for d in self.decodes)):
            with contextlib.suppress(Exception):
                proc.stop()
        shutil.rmtree(self.logdir, ignore_errors=True)


def start_fleet(router: str, s: dict[str, Any]) -> Fleet:
    """Engines, then the router with every decode; SMG's worker probes can end a simulator
    engine (bench/harness/procs.py says why): then everything starts again."""
    for attempt in range(1, procs.START_ATTEMPTS + 1):
        fleet = start_once(router, s)
        if fleet is not None:
            return fleet
        print_flush(f"  start {attempt}: an engine exited while {router} started; again")
    raise RuntimeError(f"{router}: engines kept dying at start")


def start_once(router: str, s: dict[str, Any]) -> Fleet | None:
    decode_args = ["--inter-token-ms", str(s["inter_token_ms"])]
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-rolling-"))
    prefill = procs.start_engine("prefill", logdir)
    decodes = [
        procs.start_engine("decode", logdir, args=decode_args, name=f"decode{i}")
        for i in range(s["decodes"])
    ]
    port = procs.free_port()
    # 1 s health checks and a 2 s breaker cooldown (both routers' defaults are 60 s: a restarted
    # decode would stay out of rotation for a minute), the same flags on every router
    extra = ["--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "2"]
    for d in decodes[1:]:
        extra += ["--decode", d.url]
    argv = procs.router_argv(router, [prefill], decodes[0], port, extra)
    fleet = Fleet(logdir, prefill, decodes, procs.Proc(f"router-{router}", argv, logdir), port,
                  decode_args)  # fmt: skip
    engines = [prefill, *decodes]
    try:
        procs.wait_until(lambda: procs.http_get(port, "/health") == 200, 60, router, fleet.router)
        if router == "smg":
            procs.wait_until(lambda: procs.smg_workers_registered(port, len(engines)), 60,
                             "smg worker registration", fleet.router)  # fmt: skip
            time.sleep(0.5)
        for _ in range(2 * len(decodes)):  # every decode answers through the router
            procs.wait_until(
                lambda: procs.http_post(port, "/generate", procs.probe_body()) == 200
                or not all(e.proc.alive() for e in engines),
                60, f"{router} first request", fleet.router,
            )  # fmt: skip
        if all(e.proc.alive() for e in engines):
            return fleet
    except BaseException:
        fleet.stop()
        raise
    fleet.stop()
    return None


def check(reply: Any, tokens: int) -> tuple[bool, str, int]:
    """(ok, why not, tokens the client got) of one streamed answer."""
    events = []
    for block in reply.body.split(b"\n\n"):
        block = block.strip()
        if block.startswith(b"data:") and block[5:].strip() != b"[DONE]":
            with contextlib.suppress(orjson.JSONDecodeError):
                events.append(orjson.loads(block[5:]))
    last = events[-1] if events else {}
    text = last.get("text") or ""
    got = max((len((e.get("text") or "").split()) for e in events), default=0)
    if reply.error is not None:
        return False, f"transport {reply.error}", got
    if reply.status != 200:
        return False, f"status {reply.status}", got
    if reply.stream_error or any("error" in e for e in events):
        return False, "error event", got
    meta = last.get("meta_info") or {}
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        return False, "abort event", got
    if not reply.done or reply.body.count(b"data: [DONE]") != 1:
        return False, "no single [DONE]", got
    if text != output_text(tokens) or meta.get("completion_tokens") != tokens:
        return False, "short or wrong answer", got
    return True, "", got


async def client(port: int, s: dict[str, Any], n: int, t0: float, records: list) -> None:
    i = 0
    while True:
        body = {"text": f"rolling restart client {n} request {i}", "stream": True,
                "sampling_params": {"max_new_tokens": s["tokens"], "temperature": 0}}  # fmt: skip
        t_send = time.monotonic() - t0
        reply = await one_request(procs.HOST, port, "POST", "/generate", orjson.dumps(body),
                                  {"content-type": "application/json"},
                                  timeout=s["client_timeout_s"])  # fmt: skip
        ok, why, got = check(reply, s["tokens"])
        records.append({"t_send": t_send, "t_end": reply.t_end - t0, "ok": ok, "why": why,
                        "got": got})  # fmt: skip
        i += 1


async def roll(fleet: Fleet, s: dict[str, Any], t0: float, marks: dict[str, Any]) -> None:
    """Each decode in turn: killed once streams run on it, restarted on its port, back in
    rotation (a first token streamed) before the next."""
    await trio.sleep(s["steady_s"])
    marks["restart_from"] = time.monotonic() - t0
    for i, old in enumerate(list(fleet.decodes)):
        tail = EventTail(old.events_path)
        with trio.move_on_after(s["back_timeout_s"]):
            # another process writes the log: polled, no event to wait on
            while not tail.ready(s["kill_when_streams"]):  # noqa: ASYNC110
                await trio.sleep(0.005)
        streams = len(tail.open_rooms)
        old.proc.popen.kill()
        await trio.to_thread.run_sync(old.proc.popen.wait)
        t_kill = time.monotonic() - t0
        old.proc.stop()
        fleet.retired.append(old)
        await trio.sleep(s["down_s"])
        new = await trio.to_thread.run_sync(
            lambda old=old, i=i: procs.start_engine(
                "decode", fleet.logdir, port=old.port, args=fleet.decode_args,
                name=f"decode{i}-restarted",
            )
        )  # fmt: skip
        fleet.decodes[i] = new
        back = EventTail(new.events_path)
        with trio.move_on_after(s["back_timeout_s"]):
            while not back.ready(0, first_tokens=1):  # noqa: ASYNC110
                await trio.sleep(0.01)
        t_back = time.monotonic() - t0
        marks["kills"].append({"decode": i, "t_kill": round(t_kill, 3), "streams": streams,
                               "t_back": round(t_back, 3),
                               "back": back.first_tokens > 0})  # fmt: skip
    marks["restart_to"] = time.monotonic() - t0
    await trio.sleep(s["steady_s"])


async def drive(fleet: Fleet, s: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    records: list[dict[str, Any]] = []
    marks: dict[str, Any] = {"kills": []}
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for n in range(s["clients"]):
            nursery.start_soon(client, fleet.port, s, n, t0, records)
        await roll(fleet, s, t0, marks)
        nursery.cancel_scope.cancel()  # answers in flight at the end are not counted
    return records, marks


def prefill_resumes(fleet: Fleet) -> tuple[int, int]:
    """(resumed requests, tokens prefilled again): the prefill's requests with `input_ids`
    (the clients send text; a resume sends the prompt's ids plus the ids already streamed)."""
    resumed = tokens = 0
    for event in fleet.prefill.events():
        body = event.get("body") if event.get("event") == "request_start" else None
        if isinstance(body, dict) and isinstance(body.get("input_ids"), list):
            resumed += 1
            tokens += len(body["input_ids"])
    return resumed, tokens


def measure(router: str, s: dict[str, Any]) -> dict[str, Any]:
    fleet = start_fleet(router, s)
    try:
        records, marks = trio.run(drive, fleet, s)
        resumed, reprefilled = prefill_resumes(fleet)
    finally:
        fleet.stop()
    a, b = marks["restart_from"], marks["restart_to"]
    steady = [r for r in records if r["t_end"] < a]
    restart = [r for r in records if r["t_send"] < b and r["t_end"] >= a]
    after = [r for r in records if r["t_send"] >= b]
    failed = [r for r in records if not r["ok"]]

    def p(rows: list[dict[str, Any]], q: float) -> float | None:
        return stats.ms(pct([r["t_end"] - r["t_send"] for r in rows if r["ok"]], q))

    metrics = {
        "answers": len(records),
        "failed": len(failed),
        "failed_in_restart": sum(1 for r in restart if not r["ok"]),
        "failed_why": teardown.tally([r["why"] for r in failed]) if failed else "-",
        "steady_p50_ms": p(steady, 50),
        "steady_p99_ms": p(steady, 99),
        "restart_p50_ms": p(restart, 50),
        "restart_p99_ms": p(restart, 99),
        "after_p99_ms": p(after, 99),
        "restart_window_s": round(b - a, 1),
        "kills": len(marks["kills"]),
        "streams_at_kills": sum(k["streams"] for k in marks["kills"]),
        "resumed": resumed,
        "reprefill_tokens": reprefilled,
        "lost_tokens": sum(r["got"] for r in failed),
    }
    m = metrics
    print_flush(
        f"  rolling {router}: {m['failed']} failed of {m['answers']} ({m['failed_why']}), "
        f"p99 steady/restart {m['steady_p99_ms']}/{m['restart_p99_ms']} ms, {m['kills']} kills "
        f"with {m['streams_at_kills']} streams on them, {m['resumed']} resumed"
    )
    if m["kills"] != s["decodes"] or not all(k["back"] for k in marks["kills"]):
        raise RuntimeError(f"{router}: the rolling restart did not complete: {marks['kills']}")
    return {"metrics": metrics, "marks": marks, "records": records}


SCENARIO = Scenario(
    name=NAME,
    load=LOAD,
    settings=settings,
    phases=(Phase("rolling", list, measure),),
    baseline="trio_pd",
    metrics={
        "answers": "answers checked",
        "failed": "client-visible failures",
        "failed_why": "what the failed clients saw",
        "steady_p50_ms": "steady p50 (ms)",
        "steady_p99_ms": "steady p99 (ms)",
        "restart_p50_ms": "restart-window p50 (ms)",
        "restart_p99_ms": "restart-window p99 (ms)",
        "restart_window_s": "restart window (s)",
        "streams_at_kills": "streams on the decodes when killed",
        "resumed": "requests resumed (migration)",
        "reprefill_tokens": "tokens prefilled again (resumes)",
        "lost_tokens": "tokens streamed in failed answers (a retry decodes again)",
    },
    verdicts=(
        Verdict("client-visible failures: trio_pd (migration on)", "failed", "trio_pd", None,
                "value", 0, "0"),
    ),
)  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> Path:
    """Each answer's latency against its send time, a router a row; failures as red crosses,
    the kills as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["repetition"] == 1]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True,
                             squeeze=False)  # fmt: skip
    for ax, r in zip(axes[:, 0], runs, strict=True):
        ok = [(x["t_send"], 1000 * (x["t_end"] - x["t_send"])) for x in r["records"] if x["ok"]]
        bad = [(x["t_send"], 1000 * (x["t_end"] - x["t_send"])) for x in r["records"]
               if not x["ok"]]  # fmt: skip
        if ok:
            ax.scatter(*zip(*ok, strict=True), s=4, color="C0", label="ok")
        if bad:
            ax.scatter(*zip(*bad, strict=True), s=18, marker="x", color="red", label="failed")
        for k in r["marks"]["kills"]:
            ax.axvline(k["t_kill"], color="black", lw=0.8)
        m = r["metrics"]
        ax.set_title(f"{r['target']}: {m['failed']} failed of {m['answers']}, p99 steady "
                     f"{m['steady_p99_ms']:.0f} / restart {m['restart_p99_ms']:.0f} ms",
                     fontsize=9)  # fmt: skip
        ax.set_ylabel("latency, ms")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("send time, s (vertical lines: a decode SIGKILLed)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    png = None
    if "--plot" in argv:
        at = argv.index("--plot")
        png = Path(argv[at + 1])
        del argv[at : at + 2]
    code = run.main(SCENARIO, __doc__, argv, routers="trio_pd,trio_pd_nomigrate,smg", repeat=1)
    if png is not None:
        from bench.harness import output

        latest = max(output.RESULTS.glob(f"{NAME}-*.json"), key=lambda f: f.stat().st_mtime)
        print_flush("plot:", plot(orjson.loads(latest.read_bytes()), png))
    return code


if __name__ == "__main__":
    sys.exit(main())
