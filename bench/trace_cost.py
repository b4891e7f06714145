"""What `--enable-trace` costs per request, and that tracing off costs nothing.

The router-bound shape (`bench/router_bound.py`): wrk POSTs a small non-stream `/generate` to a
one-process trio_pd in front of instant engines; the router's CPU per request is read in a window
inside each wrk run. Three variants, alternating their order every repetition (ABC, CBA, ...),
each with fresh engines and router:

- `before`: the trio_pd sources at `--before` (a git revision without tracing: `git archive`d
  into a temporary directory and put first on PYTHONPATH);
- `off`: this tree, tracing off (the default);
- `on`: this tree with `--enable-trace`, exporting over OTLP/gRPC to a sink in this process (a
  grpcio TraceService that counts spans and drops them), so the router pays the full export.

    .venv/bin/python -m bench.trace_cost --before REV [--repeat N] [--levels 1,32]

Prints the medians per variant and level, with `off - before` and `on - off` in microseconds,
and writes `bench/results/trace-cost-<time>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

from bench.bound import Settings, Target, instant_args, wrk_level
from bench.harness import output, procs, wrk
from bench.harness.output import print_flush
from bench.harness.procs import HOST, start_instant

VARIANTS = ("before", "off", "on")
SETTINGS = Settings(lead=1.0, window=5.0, warmup=2.0, paced_warmup=0.0, paced_window=0.0)


class SpanSink:
    """An OTLP/gRPC TraceService that counts the spans it is sent and keeps none."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        sink = self
        self.spans = 0
        self._lock = threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += count
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"{HOST}:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


def sources_at(revision: str) -> Path:
    """The `trio_pd` package as of `revision`, in a temporary directory, checked to be the one
    a router started as `started` starts it imports."""
    where = Path(tempfile.mkdtemp(prefix="trio-pd-before-"))
    archive = subprocess.run(
        ["git", "-C", str(output.ROOT), "archive", revision, "trio_pd"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    imported = subprocess.run(
        [sys.executable, "-P", "-c", "import trio_pd; print(trio_pd.__file__)"],
        env={**os.environ, "PYTHONPATH": str(where)},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not imported.startswith(str(where)):
        raise SystemExit(f"--before {revision}: a router would import {imported}, not {where}")
    return where


@contextlib.contextmanager
def started(variant: str, before: Path, sink: SpanSink) -> Iterator[Target]:
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-tc-"))
    running: list[procs.Proc] = []
    try:
        decode = start_instant("decode", logdir, instant_args(SETTINGS))
        running.append(decode.proc)
        prefill = start_instant("prefill", logdir, instant_args(SETTINGS))
        running.append(prefill.proc)
        port = procs.free_port()
        # -P: the working directory (this tree) must not come before PYTHONPATH on sys.path,
        # or `before` would run this tree's code.
        argv = [sys.executable, "-P", "-m", "trio_pd", "serve", "--host", HOST, "--port", str(port),
                "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
                "--log-level", "warning", "--policy", "round_robin"]  # fmt: skip
        if variant == "on":
            argv += ["--enable-trace", "--otlp-traces-endpoint", f"{HOST}:{sink.port}"]
        saved = os.environ.get("PYTHONPATH")
        if variant == "before":
            os.environ["PYTHONPATH"] = str(before)
        try:
            router = procs.Proc(f"router-{variant}", argv, logdir)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        running.insert(0, router)
        procs.wait_until(lambda: procs.http_get(port, "/health") == 200, 60, variant, router)
        procs.wait_until(
            lambda: procs.http_post(port, "/generate", procs.probe_body()) == 200,
            60,
            f"{variant} first request",
            router,
        )
        yield Target(variant, port, router.pid, decode.port, "/generate",
                     [prefill.proc.pid, decode.proc.pid], router)  # fmt: skip
    finally:
        for proc in running:
            with contextlib.suppress(Exception):
                proc.stop()
        shutil.rmtree(logdir, ignore_errors=True)


def measure(variant: str, levels: list[int], before: Path, sink: SpanSink) -> list[dict]:
    with started(variant, before, sink) as target:
        warm = wrk.start(target.port, max(levels), max(1, round(SETTINGS.warmup)))
        wrk.summary(warm.communicate(timeout=SETTINGS.warmup + 60)[0])
        rows = []
        for conc in levels:
            spans_before = sink.spans
            row = wrk_level(target, conc, SETTINGS)
            row["spans"] = sink.spans - spans_before
            rows.append(row)
            print_flush(
                f"  {variant} c={conc}: {row['rps']} req/s, {row['cpu_us_per_req']} us CPU/req"
                + (f", {row['spans']} spans exported" if variant == "on" else "")
                + (f", {row['errors']} errors" if row["errors"] else "")
            )
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_cost", description=__doc__)
    parser.add_argument("--before", required=True, help="a git revision without tracing")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--levels", default="1,32")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]
    before_commit = subprocess.run(
        ["git", "-C", str(output.ROOT), "rev-parse", "--verify", f"{args.before}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    before = sources_at(before_commit)
    sink = SpanSink()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        for rep in range(args.repeat):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            print_flush(f"repetition {rep + 1}/{args.repeat}: {', '.join(order)}")
            for variant in order:
                runs[variant].extend(measure(variant, levels, before, sink))
    finally:
        sink.stop()
        shutil.rmtree(before, ignore_errors=True)
    medians = {
        (v, c): statistics.median(r["cpu_us_per_req"] for r in runs[v] if r["c"] == c)
        for v in VARIANTS
        for c in levels
    }
    print_flush("\nrouter CPU per non-stream request (us), medians of "
                f"{args.repeat} repetitions")  # fmt: skip
    print_flush("| c | before | off | on | off - before | on - off |")
    print_flush("|---|---:|---:|---:|---:|---:|")
    summary = []
    for c in levels:
        b, off, on = (medians[v, c] for v in VARIANTS)
        summary.append(
            {"c": c, "before": b, "off": off, "on": on,
             "off_minus_before": round(off - b, 1), "on_minus_off": round(on - off, 1)}
        )  # fmt: skip
        print_flush(f"| {c} | {b:.0f} | {off:.0f} | {on:.0f} | {off - b:+.0f} | {on - off:+.0f} |")
    path = output.write_result(
        "trace-cost",
        {"before": args.before, "before_commit": before_commit, "levels": levels, "runs": runs,
         "summary": summary},
    )  # fmt: skip
    print_flush(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
