"""One benchmark run, the same way for every scenario: the targets alternate inside each
repetition (forward, then reversed: ABBA for any two), each measurement starts its own processes,
every figure is also taken against the baseline measured in the same repetition, the machine's
load is watched throughout, and the result is one table, one JSON under bench/results/ and, when
asked, one small summary under bench/published/ that docs/benchmarks.md and the README are
written from (`python -m bench.publish`).

A scenario module declares what differs: its load (text), its settings, its phases (which
targets, how one target is measured), the baseline, the metrics it publishes and its verdicts.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from bench import stats
from bench.harness import output
from bench.harness.output import print_flush

Flat = dict[str, Any]  # one target's metrics in one repetition


@attrs.frozen
class Phase:
    """One kind of measurement: `measure(target, settings)` starts the target's processes,
    measures, reaps them and returns `{"metrics": {...}, ...raw}`."""

    name: str
    targets: Callable[[Sequence[str]], list[str]]  # the routers asked for -> this phase's order
    measure: Callable[[str, Any], dict[str, Any]]


@attrs.frozen
class Verdict:
    """A goal on the medians: `metric` of `target` as a ratio to (or difference from)
    `reference`'s, or its plain value (`reference` None)."""

    what: str
    metric: str
    target: str
    reference: str | None
    # "ratio", "diff", "value": <= limit; "at_least": value >= limit; "band": |ratio - 1| <= limit
    kind: str
    limit: float
    goal: str

    def judge(self, medians: dict[str, Flat]) -> dict[str, Any]:
        value = medians.get(self.target, {}).get(self.metric)
        ref = medians.get(self.reference, {}).get(self.metric) if self.reference else None
        if self.kind in ("ratio", "band") and self.reference is not None:
            measure = ratio(value, ref)
        elif self.kind == "diff":
            measure = None if value is None or ref is None else round(value - ref, 1)
        else:
            measure = value
        if measure is None:
            verdict = "n/a"
        elif self.kind == "band":
            verdict = "PASS" if abs(measure - 1.0) <= self.limit else "MISS"
        elif self.kind == "at_least":
            verdict = "PASS" if measure >= self.limit else "MISS"
        else:
            verdict = "PASS" if measure <= self.limit else "MISS"
        return {"target": self.what, "value": value, "reference": ref, "measure": measure,
                "kind": self.kind, "goal": self.goal, "verdict": verdict}  # fmt: skip


@attrs.frozen
class Scenario:
    name: str
    load: str  # the load shape, printed with every run and published with every figure
    settings: Callable[[bool], Any]  # quick -> settings (a dict or an attrs instance)
    phases: tuple[Phase, ...]
    baseline: str  # the same-run target every ratio is against ("": the first target)
    metrics: dict[str, str]  # published metric -> label, in table order ({}: every metric)
    verdicts: tuple[Verdict, ...] = ()
    # per repetition, across targets (e.g. latency added over the engine alone): adds metrics
    derive: Callable[[dict[str, Flat]], None] | None = None


def adapted(name: str, load: str, runner: Callable[[str, bool], dict[str, Any]],
            summary: Callable[[dict[str, Any]], Flat]) -> Scenario:  # fmt: skip
    """A scenario measured router by router with `runner(router, quick)` (its own `rows`) and
    `summary(result)` (its flat metrics), on this harness as it is; the first router is the
    baseline."""

    def measure(router: str, settings: dict[str, Any]) -> dict[str, Any]:
        result = runner(router, settings["quick"])
        return {**result, "metrics": summary(result)}

    return Scenario(name=name, load=load, settings=lambda quick: {"quick": quick},
                    phases=(Phase(name, list, measure),), baseline="", metrics={})  # fmt: skip


def ratio(a: Any, b: Any) -> float | None:
    numbers = isinstance(a, int | float) and isinstance(b, int | float)
    return round(a / b, 3) if numbers and b else None


def middle(values: Sequence[Any]) -> Any:
    """The median of numbers; for text (e.g. the storm's `freed_by`), the distinct values."""
    vals = [v for v in values if v is not None]
    if any(isinstance(v, str) for v in vals):
        return " / ".join(dict.fromkeys(str(v) for v in vals)) or None
    return stats.median(vals)


def run(
    scenario: Scenario, routers: Sequence[str], repeat: int, quick: bool, show: bool = True
) -> dict[str, Any]:
    """Every phase, every target, `repeat` times; medians, ratios to the same-run baseline and
    verdicts. One broken target fails alone (listed in `failures`)."""
    settings = scenario.settings(quick)
    shown = attrs.asdict(settings) if attrs.has(type(settings)) else settings
    meta = output.meta()
    print_flush(f"== {scenario.name} == load: {scenario.load}")
    print_flush(f"   {meta['nproc']} x {meta['cpu_model']}, commit {meta['commit'][:12]}, "
                f"load average {meta['loadavg'][0]:.2f}, settings {shown}")  # fmt: skip
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    targets: list[str] = []
    with output.LoadWatch() as load:
        for phase in scenario.phases:
            order = phase.targets(routers)
            targets += [t for t in order if t not in targets]
            for rep in range(1, repeat + 1):
                for target in order if rep % 2 else list(reversed(order)):
                    print_flush(f"[{scenario.name} {phase.name} rep {rep}/{repeat}] {target} ...")
                    t0 = time.monotonic()
                    try:
                        result = phase.measure(target, settings)
                    except Exception as exc:  # one target that fails must not sink the others
                        traceback.print_exc()
                        failures.append(f"{phase.name}/{target} rep {rep}: {exc!r}"[:2000])
                        continue
                    result.update(phase=phase.name, target=target, repetition=rep,
                                  elapsed_s=round(time.monotonic() - t0, 1))  # fmt: skip
                    runs.append(result)
    result = {
        "scenario": scenario.name,
        "load_shape": scenario.load,
        "quick": quick,
        "repeat": repeat,
        "settings": shown,
        "date": meta["date"],
        "commit": meta["commit"],
        "machine": {"nproc": meta["nproc"], "cpu_model": meta["cpu_model"]},
        "load_average": load.summary(),
        "baseline": scenario.baseline or (targets or [""])[0],
        "targets": targets,
        "runs": runs,
        "failures": failures,
    }
    finish(scenario, result)
    result["results_file"] = output.write_result(scenario.name, result).name
    if show:
        print_flush("")
        print_flush(render(scenario, result))
        print_flush("results:", output.RESULTS / result["results_file"])
    return result


def finish(scenario: Scenario, result: dict[str, Any]) -> None:
    """Per-repetition metrics, medians, ratios and verdicts from the raw runs."""
    per_rep: list[dict[str, Flat]] = [{} for _ in range(result["repeat"])]
    for r in result["runs"]:
        per_rep[r["repetition"] - 1].setdefault(r["target"], {}).update(r["metrics"])
    for flat in per_rep:
        if scenario.derive is not None:
            scenario.derive(flat)
    base = scenario.baseline or (result["targets"] or [""])[0]
    medians: dict[str, Flat] = {}
    ratios: dict[str, Flat] = {}
    for target in result["targets"]:
        reps = [flat[target] for flat in per_rep if target in flat]
        keys = list(dict.fromkeys(k for rep in reps for k in rep))
        medians[target] = {k: middle([rep.get(k) for rep in reps]) for k in keys}
        if target != base:
            ratios[target] = {
                k: stats.median(ratio(flat[target].get(k), flat[base].get(k))
                                for flat in per_rep if target in flat and base in flat)
                for k in keys
            }  # fmt: skip
    result["per_repetition"] = per_rep
    result["medians"] = medians
    result["ratios"] = {t: {k: v for k, v in m.items() if v is not None} for t, m in ratios.items()}
    result["verdicts"] = [v.judge(medians) for v in scenario.verdicts]


def render(scenario: Scenario, result: dict[str, Any]) -> str:
    """The text of a run: medians (with the ratio to the baseline), verdicts, load."""
    targets = result["targets"]
    base = result["baseline"]
    rows = []
    found = {k: k for m in result["medians"].values() for k in m}
    for key, label in (scenario.metrics or found).items():
        row: dict[str, Any] = {"metric": label}
        for t in targets:
            value = result["medians"].get(t, {}).get(key)
            r = result["ratios"].get(t, {}).get(key)
            row[t] = output.fmt(value) + (f" ({r:.2f}x)" if r is not None else "")
        rows.append(row)
    kind = "QUICK (short windows, noisy)" if result["quick"] else "full"
    load = result["load_average"]
    lines = [
        f"== {scenario.name} ({kind}; medians of {result['repeat']}; "
        f"{result['machine']['nproc']} x {result['machine']['cpu_model']}; "
        f"commit {result['commit'][:12]}; load average {load.get('min')}-{load.get('max')}) ==",
        f"(x): median over repetitions of the ratio to {base} in the same repetition",
        output.table(rows, ["metric", *targets]),
    ]
    if result["verdicts"]:
        checks = [{**v, "value": output.fmt(v["value"]), "reference": output.fmt(v["reference"]),
                   "measure": output.fmt(v["measure"], 2)} for v in result["verdicts"]]  # fmt: skip
        lines += ["", output.table(checks, ("target", "value", "reference", "measure", "goal",
                                            "verdict"))]  # fmt: skip
    lines += [f"FAILED: {f.splitlines()[0]}" for f in result["failures"]]
    return "\n".join(lines)


def publish(scenario: Scenario, result: dict[str, Any]) -> Path:
    """bench/published/<scenario>.json: what docs/benchmarks.md and the README are written from
    (`python -m bench.publish`). Only a full, complete run of a committed tree is published."""
    if result["quick"] or result["failures"] or result["commit"].endswith("-dirty"):
        raise SystemExit(
            f"{scenario.name}: not published (quick={result['quick']}, "
            f"{len(result['failures'])} failures, commit {result['commit']})"
        )
    keep = list(scenario.metrics)
    summary = {
        key: result[key]
        for key in ("scenario", "load_shape", "date", "commit", "machine", "load_average",
                    "repeat", "settings", "baseline", "targets", "verdicts", "results_file")
    }  # fmt: skip
    summary["medians"] = {
        t: {k: m[k] for k in keep if k in m} for t, m in result["medians"].items()
    }
    summary["ratios"] = {t: {k: m[k] for k in keep if k in m} for t, m in result["ratios"].items()}
    output.PUBLISHED.mkdir(parents=True, exist_ok=True)
    path = output.PUBLISHED / f"{scenario.name}.json"
    path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    return path


def main(scenario: Scenario, doc: str | None, argv: Sequence[str] | None, routers: str,
         repeat: int) -> int:  # fmt: skip
    """The command line of a scenario module: `[--quick] [--routers ...] [--repeat N]
    [--publish] [--from JSON]`."""
    from bench.harness import procs

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--routers", default=routers, help=f"comma list of {','.join(procs.ROUTERS)}"
    )
    parser.add_argument("--quick", action="store_true", help="short windows (noisy)")
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument(
        "--publish",
        action="store_true",
        help=f"write bench/published/{scenario.name}.json (a full run only)",
    )
    parser.add_argument(
        "--from",
        dest="saved",
        type=Path,
        metavar="JSON",
        help="run nothing: judge a saved bench/results/ file again (and publish)",
    )
    args = parser.parse_args(argv)
    if args.saved is not None:  # the measured commit stays the run's
        result = orjson.loads(args.saved.read_bytes())
        result["results_file"] = args.saved.name
        finish(scenario, result)
        print_flush(render(scenario, result))
    else:
        routers = procs.usable_routers(args.routers.split(","))
        result = run(scenario, routers, args.repeat, args.quick)
    if args.publish:
        print_flush("published:", publish(scenario, result))
    return 1 if result["failures"] else 0
