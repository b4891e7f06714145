"""Side-by-side table of several routers (medians over repetitions, ratios to trio_pd) and the
storm plot."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from bench.harness import output
from bench.harness.run import middle

# For each metric: is a higher value better? (used only to word the ratio column)
HIGHER_IS_BETTER = ("req/s", "tokens/s", "goodput", "vs direct")


def side_by_side(
    summaries: dict[str, list[dict[str, Any]]], reference: str = "trio_pd", title: str = ""
) -> tuple[str, list[dict[str, Any]]]:
    """summaries: router -> one flat summary per repetition. Returns (text, rows)."""
    routers = list(summaries)
    metrics: list[str] = []
    for reps in summaries.values():
        for rep in reps:
            for key in rep:
                if key not in metrics:
                    metrics.append(key)
    rows = []
    for metric in metrics:
        row: dict[str, Any] = {"metric": metric}
        for router in routers:
            row[router] = middle(rep.get(metric) for rep in summaries[router])
        ref = row.get(reference)
        for router in routers:
            if router == reference:
                continue
            value = row.get(router)
            numbers = isinstance(value, int | float) and isinstance(ref, int | float)
            row[f"{router}/{reference}"] = round(value / ref, 2) if numbers and ref else None
        rows.append(row)
    columns = ["metric", *routers] + [f"{r}/{reference}" for r in routers if r != reference]
    reps = max((len(v) for v in summaries.values()), default=0)
    title = (title + "\n" if title else "") + (
        f"medians of {reps} repetition(s); ratio columns: router / {reference}"
    )
    return output.table(rows, columns, title), rows


def plot_storm(
    results: dict[str, dict[str, Any]], settings: dict[str, Any], path: Path | None = None
) -> Path | None:
    """Storm goodput, p50/p99 latency and wasted decode slots over time, one line per router
    (`results`: router -> one storm measurement, bench/storm.py's `measure`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the bench extra
        return None
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for n, (router, result) in enumerate(results.items()):
        s = result["series"]
        t = [row["t"] for row in s]
        color = f"C{n}"  # one colour per router on every panel
        total = result["metrics"]
        label = (
            f"{router}: p99 {output.fmt(total.get('ok_p99_ms'), 0)} ms, "
            f"wasted {output.fmt(total.get('wasted_slot_s'))} slot-s"
        )
        axes[0].plot(t, [row["ok"] for row in s], color=color, label=label)
        axes[1].plot(t, [row["p50_ms"] for row in s], color=color, label=f"{router} p50")
        axes[1].plot(
            t, [row["p99_ms"] for row in s], color=color, linestyle="--", label=f"{router} p99"
        )
        axes[2].plot(t, [row["wasted_slots"] for row in s], color=color, label=router)
    axes[0].set_ylabel("successful req/s")
    axes[0].set_title(
        f"storm: {settings.get('rate')} req/s open loop, {int(100 * settings.get('fail_ratio', 0))}"
        f"% prefill 500s, decode {settings.get('max_running')} slots, "
        f"waiting timeout {settings.get('waiting_timeout')} s, "
        f"disconnect poll {settings.get('disconnect_poll_secs', 4.0)} s"
    )
    axes[1].set_ylabel("latency of successes (ms)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("decode slots held by doomed requests")
    axes[2].set_xlabel("seconds since start (by completion; slots by occupancy)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is None:
        output.RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = output.RESULTS / f"storm-{stamp}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
