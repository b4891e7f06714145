"""Profile a router under the router-bound load with py-spy, and say where its CPU goes.

Starts the router with instant engines (as `router-bound` does), drives wrk at one concurrency,
records the router process with `py-spy record --native --format raw` for `--duration` seconds
while wrk runs, and prints:

- the top functions by own time: the innermost *Python* frame of each sample (native code below
  it, e.g. httptools' parser or a socket syscall, counts for the Python function that called it),
  and the top native leaves (syscalls and C functions) separately;
- where the CPU goes, each sample attributed to its owner, walking from the leaf towards the root to
  the first frame of: `trio_pd/upstream/http11.py` or `connect.py` (the upstream HTTP/1.1 client),
  `hypercorn/` or `h11/` (the server side), the rest of `trio_pd/` (our code); a stack with none
  of them is trio's run loop itself (scheduler, epoll, timers). Within each owner, the leaf's
  layer: the owner's own code, trio (cancel scopes, checkpoints, sockets), stdlib/other Python,
  native.

py-spy is not in the bench extra: `.venv/bin/python -m pip install py-spy`. It pauses the process
for each sample, so throughput drops while it records; the shares are what counts.

    .venv/bin/python -m bench.profile [--router trio_pd] [--concurrency 32] [--duration 10]
        [--svg]                         # also a flame graph (a second recording)
    .venv/bin/python -m bench.profile --summarize bench/results/profile-....raw
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import bound, router_bound
from bench.harness import output, procs
from bench.harness import wrk as wrk_load
from bench.harness.output import print_flush

PY_FRAME = re.compile(r"^(?P<func>.+) \((?P<file>[^()]*\.py|<[^>]*>):(?P<line>\d+)\)$")
OWNERS = (
    ("http11 client", ("trio_pd/upstream/http11.py", "trio_pd/upstream/connect.py")),
    ("hypercorn + h11 (server)", ("hypercorn/", "h11/")),
    ("trio_pd (our code)", ("trio_pd/",)),
)


def parse(path: Path) -> list[tuple[list[str], int]]:
    samples = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples.append((stack.split(";"), int(count)))
    return samples


def owner_of(frames: list[str]) -> str:
    if any(f.startswith("gc_collect") for f in frames):
        return "cyclic GC (gc_collect_main)"
    # Only the task's frames count: above trio's run loop sit `trio-pd serve`'s own entry points.
    loop = max((i for i, f in enumerate(frames) if f.startswith("unrolled_run ")), default=-1)
    task = frames[loop + 1 :]
    for frame in reversed(task):
        m = PY_FRAME.match(frame)
        if not m:
            continue
        file = m["file"]
        for name, prefixes in OWNERS:
            if any(file.startswith(p) or f"/{p}" in file for p in prefixes):
                return name
    if loop >= 0:
        return "trio run loop (scheduler, epoll, timers)"
    return "other (threads, startup)"


STDLIB_DIRS = {"collections", "asyncio", "json", "logging", "email", "http", "urllib",
               "concurrent", "importlib", "multiprocessing", "re", "encodings",
               "wsgiref"}  # fmt: skip
TRIO_FAMILY = {"trio", "outcome", "sniffio"}


def package_of(file: str) -> str:
    """trio, hypercorn, h11, trio_pd, ... or 'stdlib' (attrs-generated methods by their class)."""
    if file.startswith("<attrs generated methods "):
        top = file[len("<attrs generated methods ") :].split(".")[0]
        return "trio" if top in TRIO_FAMILY else top
    if "/" not in file:
        return "stdlib"
    top = file.split("/")[0]
    if top in STDLIB_DIRS:
        return "stdlib"
    return "trio" if top in TRIO_FAMILY else top


def layer_of(frames: list[str], owner: str) -> str:
    """What the leaf is: native code, or the package of the innermost non-stdlib Python frame
    (stdlib helpers such as contextlib count for the package that called them)."""
    if not PY_FRAME.match(frames[-1]):
        return "native"
    prefixes = next((p for name, p in OWNERS if name == owner), ())
    own_packages = {p.split("/")[0] for p in prefixes}
    for frame in reversed(frames):
        m = PY_FRAME.match(frame)
        if not m:
            continue
        package = package_of(m["file"])
        if package in own_packages:
            return "own Python"
        if package != "stdlib":
            return package
    return "stdlib"


def innermost_python(frames: list[str]) -> str:
    for frame in reversed(frames):
        m = PY_FRAME.match(frame)
        if m:
            return f"{m['func']} ({m['file']})"
    return frames[-1]


def summarize(path: Path, top: int = 15) -> str:
    samples = parse(path)
    total = sum(n for _, n in samples) or 1
    own: collections.Counter[str] = collections.Counter()
    native: collections.Counter[str] = collections.Counter()
    owners: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[tuple[str, str]] = collections.Counter()
    by_owner: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for frames, n in samples:
        own[innermost_python(frames)] += n
        if not PY_FRAME.match(frames[-1]):
            native[re.sub(r"^0x[0-9a-f]+ ", "", frames[-1])] += n
        o = owner_of(frames)
        owners[o] += n
        layers[(o, layer_of(frames, o))] += n
        by_owner[o][innermost_python(frames)] += n

    def pct(n: int) -> str:
        return f"{100.0 * n / total:5.1f}%"

    lines = [f"{path}: {total} samples", "", f"top {top} by own time (innermost Python frame):"]
    lines += [f"  {pct(n)}  {name}" for name, n in own.most_common(top)]
    lines += ["", "top native leaves (C code and syscalls):"]
    lines += [f"  {pct(n)}  {name}" for name, n in native.most_common(8)]
    lines += [
        "",
        "where the CPU goes (owner: the first of http11 / hypercorn / trio_pd from the leaf):",
    ]
    for o, n in owners.most_common():
        parts = ", ".join(
            f"{layer} {100.0 * m / n:.0f}%"
            for (oo, layer), m in sorted(layers.items(), key=lambda kv: -kv[1])
            if oo == o
        )
        lines.append(f"  {pct(n)}  {o}  [{parts}]")
    overall: collections.Counter[str] = collections.Counter()
    for (_, layer), m in layers.items():
        overall[layer] += m
    lines.append(
        "  all owners by layer: "
        + ", ".join(f"{layer} {100.0 * m / total:.0f}%" for layer, m in overall.most_common())
    )
    lines += ["", "top own-time functions of each owner:"]
    for o, _ in owners.most_common():
        lines.append(f"  {o}:")
        lines += [f"    {pct(n)}  {name}" for name, n in by_owner[o].most_common(6)]
    return "\n".join(lines)


def record(args: argparse.Namespace) -> int:
    spy = shutil.which("py-spy") or str(procs.VENV_BIN / "py-spy")
    if not Path(spy).exists():
        print_flush("py-spy missing: .venv/bin/python -m pip install py-spy")
        return 1
    output.RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = output.RESULTS / f"profile-{args.router}-c{args.concurrency}-{stamp}"
    formats = ["raw", "flamegraph"] if args.svg else ["raw"]
    settings = router_bound.settings(quick=True)
    with bound.started(args.router, settings) as target:
        seconds = int(len(formats) * (args.duration + 1) + 3)
        wrk = wrk_load.start(target.port, args.concurrency, seconds)
        time.sleep(2)  # past wrk's start
        pid = target.workers()[0]
        for fmt in formats:
            out = base.with_suffix(".raw" if fmt == "raw" else ".svg")
            argv = [spy, "record", "--native", "--format", fmt, "--rate", str(args.rate),
                    "--duration", str(args.duration), "--pid", str(pid),
                    "-o", str(out)]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                print_flush(f"py-spy failed ({done.returncode}):\n{done.stderr[-2000:]}")
                wrk.kill()
                return 1
            print_flush(f"wrote {out}")
        printed, _ = wrk.communicate(timeout=seconds + 60)
        print_flush(f"wrk while recording: {wrk_load.summary(printed)}")
    print_flush(summarize(base.with_suffix(".raw"), args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("--router", default="trio_pd", choices=procs.ROUTERS)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--svg", action="store_true", help="also record a flame graph (SVG)")
    p.add_argument("--summarize", metavar="RAW", help="only summarize a recorded raw file")
    args = p.parse_args(argv)
    if args.summarize:
        print_flush(summarize(Path(args.summarize), args.top))
        return 0
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
