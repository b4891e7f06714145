"""The published figures, written from their committed summaries: `python -m bench.publish`
rewrites every `<!-- bench: ... -->` section of docs/benchmarks.md and the README from
bench/published/<scenario>.json (which `--publish` on a full run writes);
tests/test_bench_published.py fails while a section is not what this prints. Never edit a
marked section by hand: re-run the scenario with `--publish`, commit its summary, run this.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench import router_bound, storm
from bench.harness.output import PUBLISHED, ROOT
from bench.harness.run import Scenario

BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
END = "<!-- end -->"
LABELS = {**router_bound.LABELS, "trio_pd": "trio_pd"}


def prose(text: str, indent: str = "") -> str:
    """Wrapped at 100 columns, as the pages are."""
    return textwrap.fill(text, width=100, subsequent_indent=indent, break_on_hyphens=False)


def marker(name: str) -> str:
    return f"<!-- bench: {name} (python -m bench.publish) -->"


def summary(name: str) -> dict[str, Any]:
    return orjson.loads((PUBLISHED / f"{name}.json").read_bytes())


def num(value: Any) -> str:
    """Three significant figures or so: 1,158 / 225 / 11.1 / 0.31 / 32; text as it is."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if float(value).is_integer():
        return f"{int(value):,}"
    size = abs(value)
    digits = 0 if size >= 100 else 1 if size >= 10 else 2
    return f"{value:,.{digits}f}"


def cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def times(value: float | None) -> str:
    if value is None:
        return ""
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    return f" ({value:,.{digits}f}x)"


def stamp(s: dict[str, Any], baseline: str) -> str:
    m, load = s["machine"], s["load_average"]
    return prose(
        f"Measured {s['date'][:16].replace('T', ' ')} UTC at commit `{s['commit'][:12]}` on "
        f"{m['nproc']} x {m['cpu_model']}, medians of {s['repeat']} repetitions with the targets "
        f"alternating (`bench/published/{s['scenario']}.json`; raw: `bench/results/"
        f"{s['results_file']}`, not committed). The machine is shared with other sessions: the "
        f"1-minute load average during the run was {load['min']:.1f} to {load['max']:.1f} "
        f"(median {load['median']:.1f}) on {m['nproc']} cores, so the absolute figures are "
        f"pessimistic and noisy; (x) is the median over repetitions of the ratio to "
        f"{LABELS.get(baseline, baseline)} in the same repetition, the figure to quote."
    )


def metric_table(scenario: Scenario, s: dict[str, Any], targets: list[str]) -> str:
    head = "| | " + " | ".join(LABELS.get(t, t) for t in targets) + " |"
    lines = [head, "|---" + "|---:" * len(targets) + "|"]
    for key, label in scenario.metrics.items():
        cells = []
        for t in targets:
            value = s["medians"].get(t, {}).get(key)
            cells.append(num(value) + times(s["ratios"].get(t, {}).get(key)))
        if any(cell != "-" for cell in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_table(s: dict[str, Any]) -> str:
    lines = [
        "| target | value | reference | measure | goal | verdict |",
        "|---|---:|---:|---:|---|---|",
    ]
    for v in s["verdicts"]:
        measure = num(v["measure"])
        if v["kind"] in ("ratio", "band") and v["measure"] is not None:
            measure = f"{v['measure']:.2f}x"
        lines.append(f"| {v['target']} | {num(v['value'])} | {num(v['reference'])} | {measure} "
                     f"| {v['goal']} | {v['verdict']} |")  # fmt: skip
    return "\n".join(lines)


def router_bound_section() -> str:
    s = summary(router_bound.NAME)
    return "\n\n".join([
        stamp(s, s["baseline"]),
        prose(f"Load: {s['load_shape']}."),
        metric_table(router_bound.SCENARIO, s, s["targets"]),
        "Against the project's performance targets (medians of the same run):",
        verdict_table(s),
    ])  # fmt: skip


def capacity_section() -> str:
    s = summary(router_bound.NAME)
    lines = [
        prose(
            f"From the router-bound run above ({s['date'][:10]}, commit `{s['commit'][:12]}`): "
            "non-stream CPU at c=32, one streamed token = one SSE event of the paced streams."
        ),
        "",
        "| router | CPU µs / non-stream request | cores per 1,000 req/s | CPU µs / streamed token "
        "| cores per 100,000 tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in router_bound.capacity(s):
        cells = [r["router"], num(r["cpu_us_per_req"]), cores(r["cores_per_1k_rps"]),
                 num(r["cpu_us_per_event"]), cores(r["cores_per_100k_tokens"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def storm_section() -> str:
    s = summary(storm.NAME)
    return "\n\n".join([
        stamp(s, s["baseline"]),
        prose(f"Load: {s['load_shape']}."),
        metric_table(storm.SCENARIO, s, s["targets"]),
        verdict_table(s),
    ])  # fmt: skip


def load(s: dict[str, Any]) -> str:
    return (f"load average {s['load_average']['min']:.0f}-{s['load_average']['max']:.0f} on "
            f"{s['machine']['nproc']} cores")  # fmt: skip


def readme_section() -> str:
    st, rb = summary(storm.NAME), summary(router_bound.NAME)
    sm, rm, rr = st["medians"], rb["medians"], rb["ratios"]

    def g(name: str, key: str, src: dict[str, Any] = sm) -> str:
        return num(src.get(name, {}).get(key))

    def req(name: str) -> str:
        ratio = rr.get(name, {}).get("c32_cpu_us_per_req")
        return f"{g(name, 'c32_cpu_us_per_req', rm)} µs ({ratio:.2f}x the floor)" if ratio else "-"

    per_req = rm.get("trio_pd", {}).get("c32_cpu_us_per_req")
    return "\n".join(prose(line, "  ") for line in [
        f"- In a storm of failing prefills (20 req/s, one of two prefills always 500, a decode of "
        f"16 slots; {st['date'][:10]}, commit `{st['commit'][:12]}`, medians of {st['repeat']}, "
        f"{load(st)}): "
        f"trio_pd delivered {g('trio_pd', 'goodput')} req/s of the 10 there were, successes' p99 "
        f"{g('trio_pd', 'ok_p99_ms')} ms, and doomed requests held decode slots for "
        f"{g('trio_pd', 'wasted_slot_s')} slot-seconds ({g('trio_pd_noabort', 'wasted_slot_s')} "
        f"with `--no-abort-on-cancel`); SMG 1.13 {g('smg', 'goodput')} req/s (p99 "
        f"{g('smg', 'ok_p99_ms')} ms, {g('smg', 'wasted_slot_s')} slot-seconds), SGLang's "
        f"mini_lb {g('mini_lb', 'goodput')} req/s.",
        f"- Router CPU per non-stream request at 32 concurrent clients ({rb['date'][:10]}, commit "
        f"`{rb['commit'][:12]}`, medians of {rb['repeat']}, {load(rb)}; ratios to a bare ASGI "
        f"app on the same serving stack measured in the same run): trio_pd {req('trio_pd')}, SMG "
        f"1.13 (Rust) "
        f"{req('smg')}, SGLang's mini_lb (Python) {req('mini_lb')}; about "
        f"{cores(None if per_req is None else per_req / 1000)} cores per 1,000 requests a second; "
        "`--workers N` spreads it over N cores.",
    ])  # fmt: skip


SECTIONS: dict[str, tuple[Path, Callable[[], str]]] = {
    "router-bound": (BENCHMARKS, router_bound_section),
    "capacity": (BENCHMARKS, capacity_section),
    "storm": (BENCHMARKS, storm_section),
    "readme": (README, readme_section),
}


def page_section(text: str, name: str) -> str:
    start = marker(name)
    begin = text.index(start) + len(start)
    return text[begin : text.index(END, begin)].strip("\n")


def rewrite() -> list[Path]:
    changed = []
    for page in dict.fromkeys(path for path, _ in SECTIONS.values()):
        text = original = page.read_text()
        for name, (path, render) in SECTIONS.items():
            if path != page:
                continue
            begin = text.index(marker(name)) + len(marker(name))
            finish = text.index(END, begin)
            text = text[:begin] + "\n" + render() + "\n" + text[finish:]
        if text != original:
            page.write_text(text)
            changed.append(page)
    return changed


if __name__ == "__main__":
    for page in rewrite():
        sys.stdout.write(f"rewrote {page.relative_to(ROOT)}\n")
