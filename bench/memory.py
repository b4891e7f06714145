"""Scenario `memory`: the router's RSS per byte of request body, before and after the memory
bounds of issue 19, in the same run.

For each body shape and size a fresh router process takes one `/generate` request, after a
warm-up that starts its parse worker. Its process tree's peak RSS (the router and its trio-parallel
parse workers; each process's VmHWM, reset through /proc/<pid>/clear_refs just before the request,
so no sampling can miss a peak) less the tree's RSS before, divided by the body's size, is the
amplification. Routers, alternating per case:

- `before`: the router of commit `--baseline` (default d07b3a9, the last without these bounds),
  extracted with `git archive` (bench/baseline.py);
- `after`: this checkout, defaults (`--max-buffered-bytes` 2 GiB);
- `after-nobudget`: this checkout with `--max-buffered-bytes 0`: the copies it no longer makes,
  with every parse allowed whatever it costs.

Shapes: `flat` (one long string), `input_ids` (token ids, ~6 bytes each), `empties`
(`[{},{},...]`, the issue's 1.8 GB case at 50 MB), `deep` (lists nested 500 deep, repeated).
Then the issue's admission case: three 100 MB bodies at once with `--max-concurrent-requests 1
--queue-size 0` (3.1 GB for three 200 MB bodies on 7462f5a).

The engines are bench/instant_engine.py: they answer at once without parsing, so only the router
is measured. Prints the tables, writes bench/results/memory-*.json.

    .venv/bin/python -m bench.memory [--quick] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio

from bench import baseline
from bench.harness import cpu, procs
from bench.harness.output import print_flush, table, write_result
from bench.harness.procs import HOST, Proc, free_port, wait_until

MB = 1 << 20
SIZES = (8 * MB, 32 * MB)
QUICK_SIZES = (8 * MB,)
SHAPES = ("flat", "input_ids", "empties", "deep")
ROUTERS = ("before", "after", "after-nobudget")
COLUMNS = (
    "shape", "body_mb", "router", "status", "peak_mb", "per_byte", "router_mb", "parser_mb",
    "secs",
)  # fmt: skip
ADMISSION_COLUMNS = ("router", "bodies", "statuses", "peak_mb", "per_body_byte", "secs")


def body_of(shape: str, size: int) -> bytes:
    """A /generate body of about `size` bytes of the given shape."""
    if shape == "flat":
        return b'{"text":"' + b"a" * (size - 11) + b'"}'
    if shape == "input_ids":
        ids = b",".join(str(10_000 + i % 90_000).encode() for i in range(size // 6))
        return b'{"input_ids":[' + ids + b"]}"
    if shape == "empties":
        return b'{"text":"x","a":[' + b"{}," * (size // 3) + b"{}]}"
    if shape == "deep":
        block = b"[" * 500 + b"]" * 500
        return b'{"text":"x","a":[' + b",".join([block] * (size // 1001)) + b"]}"
    raise ValueError(shape)


# ---- measuring a process tree -----------------------------------------------------------------
def tree_pids(pid: int) -> list[int]:
    return [p.pid for p in cpu.tree_procs(pid)]


def status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peaks(pids: Sequence[int]) -> bool:
    """Reset each process's VmHWM to its current RSS (Linux 4.0+: write 5 to clear_refs)."""
    ok = True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


# ---- one request, raw sockets ----------------------------------------------------------------
async def _post(port: int, body: bytes) -> int:
    """POST `body`, sending and reading at once (a router may answer before reading it all)."""
    stream = await trio.open_tcp_stream(HOST, port)
    answer = b""
    head = (
        "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()

    async def send() -> None:
        view = memoryview(body)
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head)
            for at in range(0, len(body), 1 << 20):
                await stream.send_all(view[at : at + (1 << 20)])

    try:
        async with trio.open_nursery() as both:
            both.start_soon(send)
            while b"\r\n\r\n" not in answer:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not data:
                    break
                answer += data
            both.cancel_scope.cancel()
    finally:
        await stream.aclose()
    return int(answer.split(b" ", 2)[1]) if answer else 0


def post_all(port: int, bodies: Sequence[bytes]) -> list[int]:
    async def main() -> list[int]:
        statuses = [0] * len(bodies)

        async def one(i: int) -> None:
            statuses[i] = await _post(port, bodies[i])

        with trio.fail_after(300):
            async with trio.open_nursery() as n:
                for i in range(len(bodies)):
                    n.start_soon(one, i)
        return statuses

    return trio.run(main)


# ---- engines and routers ---------------------------------------------------------------------
def start_router(
    kind: str, engines: tuple[procs.Engine, procs.Engine], logdir: Path, tree: Path,
    extra: Sequence[str] = (),
) -> tuple[Proc, int]:  # fmt: skip
    prefill, decode = engines
    port = free_port()
    flags = [
        "serve", "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
        "--host", HOST, "--port", str(port), "--log-level", "warning",
        "--prometheus-host", HOST, "--prometheus-port", str(free_port()), *extra,
    ]  # fmt: skip
    if kind == "before":
        proc = Proc(f"router-{kind}", [*baseline.baseline_command(), *flags], logdir,
                    env=baseline.baseline_env(tree), cwd=tree)  # fmt: skip
    else:
        if kind == "after-nobudget":
            flags += ["--max-buffered-bytes", "0"]
        proc = Proc(f"router-{kind}", [procs.trio_pd_bin(), *flags], logdir)
    wait_until(lambda: procs.http_get(port, "/health") == 200, 60, f"router {kind}", proc)
    # Warm-up: one ordinary request, and one body large enough to start the parse worker.
    wait_until(
        lambda: procs.http_post(port, "/generate", procs.probe_body()) == 200, 60,
        f"router {kind} first request", proc,
    )  # fmt: skip
    post_all(port, [body_of("flat", 256 * 1024)])
    time.sleep(0.3)
    return proc, port


def measure(proc: Proc, port: int, bodies: Sequence[bytes]) -> dict[str, Any]:
    pids = tree_pids(proc.pid)
    before = {pid: status_kb(pid, "VmRSS") for pid in pids}
    reset = reset_peaks(pids)
    started = time.monotonic()
    statuses = post_all(port, bodies)
    secs = time.monotonic() - started
    peaks = {pid: status_kb(pid, "VmHWM") for pid in tree_pids(proc.pid)}
    grown = {pid: peaks[pid] - before.get(pid, 0) for pid in peaks}
    growth = sum(grown.values())
    return {
        "statuses": statuses,
        "peak_mb": round(growth / MB, 1),
        "router_mb": round(grown.get(proc.pid, 0) / MB, 1),
        "parser_mb": round((growth - grown.get(proc.pid, 0)) / MB, 1),
        "secs": round(secs, 2),
        "hwm_reset": reset,
    }


def run(quick: bool, rev: str) -> dict[str, Any]:
    sizes = QUICK_SIZES if quick else SIZES
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-bench-memory-"))
    rows: list[dict[str, Any]] = []
    admission: list[dict[str, Any]] = []
    prefill = procs.start_instant("prefill", logdir)
    decode = procs.start_instant("decode", logdir)
    engines = (prefill, decode)
    try:
        with baseline.baseline_tree(rev) as tree:
            for shape in SHAPES:
                for size in sizes:
                    body = body_of(shape, size)
                    for kind in ROUTERS:
                        proc, port = start_router(kind, engines, logdir, tree)
                        try:
                            m = measure(proc, port, [body])
                        finally:
                            proc.stop()
                        row = {
                            "shape": shape, "body_mb": round(len(body) / MB, 1), "router": kind,
                            "status": m["statuses"][0], "per_byte": m["peak_mb"] * MB / len(body),
                            **{k: m[k] for k in ("peak_mb", "router_mb", "parser_mb", "secs")},
                        }  # fmt: skip
                        rows.append(row)
                        print_flush(table([row], COLUMNS))
            big = body_of("flat", 100 * MB)
            for kind in ("before", "after"):
                proc, port = start_router(
                    kind, engines, logdir, tree,
                    ("--max-concurrent-requests", "1", "--queue-size", "0"),
                )  # fmt: skip
                try:
                    m = measure(proc, port, [big] * 3)
                finally:
                    proc.stop()
                admission.append({
                    "router": kind, "bodies": "3 x 100 MB",
                    "statuses": ",".join(map(str, sorted(m["statuses"]))),
                    "peak_mb": m["peak_mb"], "per_body_byte": m["peak_mb"] * MB / len(big),
                    "secs": m["secs"],
                })  # fmt: skip
    finally:
        for engine in engines:
            engine.proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    return {"rows": rows, "admission": admission, "baseline": rev, "quick": quick,
            "memory_total_gb": round(psutil.virtual_memory().total / 2**30, 1)}  # fmt: skip


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and size: before's peak over after's (and over after without a budget)."""
    out = []
    keyed = {(r["shape"], r["body_mb"], r["router"]): r for r in rows}
    for shape, size, router in keyed:
        if router != "before":
            continue
        before = keyed[(shape, size, "before")]
        after = keyed.get((shape, size, "after"))
        free = keyed.get((shape, size, "after-nobudget"))
        out.append({
            "shape": shape, "body_mb": size,
            "before_per_byte": before["per_byte"],
            "after_per_byte": after["per_byte"] if after else None,
            "nobudget_per_byte": free["per_byte"] if free else None,
            "after_status": after["status"] if after else None,
            "before/after": before["peak_mb"] / max(after["peak_mb"], 0.1) if after else None,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 MB bodies only")
    parser.add_argument("--baseline", default=baseline.BEFORE_BOUNDS, help="the 'before' commit")
    args = parser.parse_args()
    result = run(args.quick, args.baseline)
    print_flush()
    print_flush(table(result["rows"], COLUMNS, "RSS growth per request (peak of the tree)"))
    print_flush()
    summary = ratios(result["rows"])
    result["summary"] = summary
    columns = ("shape", "body_mb", "before_per_byte", "after_per_byte", "nobudget_per_byte",
               "after_status", "before/after")  # fmt: skip
    print_flush(table(summary, columns, "RSS per byte of body: before vs after"))
    print_flush()
    print_flush(table(result["admission"], ADMISSION_COLUMNS, "Admission before the body"))
    print_flush("wrote", write_result("memory", result))


if __name__ == "__main__":
    main()
