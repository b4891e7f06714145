"""What a run says about itself and where it goes: the machine and commit it ran on, the load
other programs put on the machine while it ran, its text tables, its JSON under bench/results/
(git-ignored) and the small published summary under bench/published/ (committed)."""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
PUBLISHED = BENCH / "published"


def print_flush(*args: Any) -> None:
    print(*args, flush=True)


# ---- machine / run metadata -----------------------------------------------------------------
def git_commit() -> str:
    """HEAD, with `-dirty` when tracked files differ from it (a published run must not be)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def meta() -> dict[str, Any]:
    return {
        "date": now_utc(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "loadavg": os.getloadavg(),
    }


class LoadWatch:
    """The 1-minute load average every few seconds while a run lasts (a context manager): the
    machine is shared, so a figure is only as good as the quiet it was measured in."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples)
        if not s:
            return {}
        return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "samples": len(s)}


# ---- text and files -------------------------------------------------------------------------
def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"{name}-{stamp}.json"
    data = {"meta": meta(), **payload}
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(rows: list[dict[str, Any]], columns: Sequence[str], title: str = "") -> str:
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def report(name: str, result: dict[str, Any], columns: Sequence[str], title: str) -> None:
    """Print a scenario's table and write its JSON under bench/results/."""
    print_flush(table(result["rows"], columns, title))
    print_flush("wrote", write_result(name, result))
