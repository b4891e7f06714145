"""bench/harness/run.py, the spine every benchmark runs on, with measurements that start no
process: the targets alternate (ABBA), each ratio is taken against the baseline of the same
repetition, one failing target fails alone, the verdicts judge the medians, and only a full,
complete run of a committed tree is published, with its date, commit, machine and load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.harness import output, run
from bench.harness.run import Phase, Scenario, Verdict

# per repetition, the baseline's CPU drifts (a shared machine); the router always costs 2x it
CPU = {1: 100.0, 2: 200.0, 3: 400.0}


def scenario(calls: list[tuple[str, int]], fail: str | None = None) -> Scenario:
    def measure(target: str, settings: dict[str, Any]) -> dict[str, Any]:
        rep = 1 + sum(1 for t, _ in calls if t == target)  # this target's repetition
        calls.append((target, rep))
        if target == fail:
            raise RuntimeError(f"{target} would not start")
        factor = {"floor": 1.0, "router": 2.0, "other": 3.0}[target]
        return {"metrics": {"cpu_us": CPU[rep] * factor, "kind": target}, "raw": settings}

    return Scenario(
        name="fake",
        load="none",
        settings=lambda quick: {"quick": quick},
        phases=(Phase("only", lambda routers: ["floor", *routers], measure),),
        baseline="floor",
        metrics={"cpu_us": "CPU per request (µs)"},
        verdicts=(
            Verdict("router / floor", "cpu_us", "router", "floor", "ratio", 2.5, "<= 2.5x"),
            Verdict("other / floor", "cpu_us", "other", "floor", "ratio", 2.5, "<= 2.5x"),
            Verdict("router alone", "cpu_us", "router", None, "at_least", 1000.0, ">= 1000"),
        ),
    )


@pytest.fixture(autouse=True)
def results_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(output, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(output, "PUBLISHED", tmp_path / "published")


def test_targets_alternate_and_ratios_are_taken_in_the_same_repetition() -> None:
    calls: list[tuple[str, int]] = []
    result = run.run(scenario(calls), ["router", "other"], repeat=3, quick=False, show=False)
    order = [target for target, _ in calls]
    assert order == ["floor", "router", "other", "other", "router", "floor",
                     "floor", "router", "other"]  # fmt: skip
    # the baseline's median is 200 and the router's 400; the ratio is 2.0 in every repetition
    assert result["medians"]["floor"]["cpu_us"] == 200.0
    assert result["ratios"]["router"]["cpu_us"] == 2.0
    assert result["ratios"]["other"]["cpu_us"] == 3.0
    assert result["medians"]["router"]["kind"] == "router"  # text is kept, not averaged
    verdicts = {v["target"]: v["verdict"] for v in result["verdicts"]}
    assert verdicts == {"router / floor": "PASS", "other / floor": "MISS", "router alone": "MISS"}
    assert result["load_average"]["samples"] >= 1
    saved = orjson.loads((output.RESULTS / result["results_file"]).read_bytes())
    assert saved["medians"] == result["medians"]


def test_a_failing_target_fails_alone_and_is_never_published() -> None:
    calls: list[tuple[str, int]] = []
    fake = scenario(calls, fail="other")
    result = run.run(fake, ["router", "other"], repeat=2, quick=False, show=False)
    assert len(result["failures"]) == 2 and all("other" in f for f in result["failures"])
    assert result["ratios"]["router"]["cpu_us"] == 2.0
    assert {v["target"]: v["verdict"] for v in result["verdicts"]}["other / floor"] == "n/a"
    with pytest.raises(SystemExit, match="not published"):
        run.publish(fake, result)


def test_only_a_full_run_of_a_committed_tree_is_published() -> None:
    fake = scenario([])
    result = run.run(fake, ["router"], repeat=1, quick=True, show=False)
    with pytest.raises(SystemExit, match="not published"):
        run.publish(fake, result)
    result["quick"] = False
    result["commit"] = "0" * 40 + "-dirty"
    with pytest.raises(SystemExit, match="not published"):
        run.publish(fake, result)
    result["commit"] = "0" * 40
    path = run.publish(fake, result)
    summary = orjson.loads(path.read_bytes())
    assert path == output.PUBLISHED / "fake.json"
    assert summary["commit"] == "0" * 40 and summary["date"] and summary["machine"]["nproc"]
    assert summary["load_average"]["samples"] >= 1
    assert summary["medians"]["router"] == {"cpu_us": 200.0}  # only the published metrics
    assert summary["ratios"]["router"] == {"cpu_us": 2.0}


def test_a_band_on_a_ratio_already_taken_judges_the_value() -> None:
    """`--workers 2`'s CPU per request over one worker's is derived per repetition: the verdict
    reads it as it is (no reference) and holds it within the band."""
    band = Verdict("w2 / w1", "cpu_vs_w1", "w2", None, "band", 0.1, "1.0x +/- 10%")
    assert band.judge({"w2": {"cpu_vs_w1": 1.32}})["verdict"] == "MISS"
    assert band.judge({"w2": {"cpu_vs_w1": 1.05}})["verdict"] == "PASS"
    assert band.judge({})["verdict"] == "n/a"
