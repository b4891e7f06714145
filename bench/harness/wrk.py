"""wrk (C, one thread, keep-alive, closed loop) POSTing a small non-stream `/generate`
(bench/wrk/generate.lua prints one JSON summary line): the load generator of every router-bound
shaped measurement, cheap enough that the router is what is measured."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from bench.harness.output import BENCH
from bench.harness.procs import HOST

SCRIPT = BENCH / "wrk" / "generate.lua"


def installed() -> bool:
    return shutil.which("wrk") is not None


def start(port: int, conc: int, seconds: int) -> subprocess.Popen[str]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk; make bench installs it)")
    argv = [wrk, "-t1", f"-c{conc}", f"-d{seconds}s", "--timeout", "30s", "-s", str(SCRIPT),
            f"http://{HOST}:{port}"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def summary(printed: str) -> dict[str, Any]:
    for line in printed.splitlines():
        if line.startswith("WRK_JSON "):
            data = json.loads(line[len("WRK_JSON ") :])
            secs = data["duration_us"] / 1e6
            errors = sum(data[k] for k in ("non2xx", "connect", "read", "write", "timeout"))
            return {
                "wrk_requests": data["requests"],
                "wrk_rps": round(data["requests"] / secs, 1) if secs else None,
                "p50_ms": round(data["p50_us"] / 1000, 3),
                "p99_ms": round(data["p99_us"] / 1000, 3),
                "errors": errors,
            }
    raise RuntimeError(f"wrk printed no summary:\n{printed[-2000:]}")
