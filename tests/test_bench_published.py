"""The published benchmark figures are generated: every `<!-- bench: ... -->` section of
docs/benchmarks.md and the README is what `python -m bench.publish` writes from the committed
summaries under bench/published/, and each summary says when, where, at which commit and under
which load it was measured (as the flag tables are held to tests/flag_surface.py)."""

from __future__ import annotations

import datetime
import re
import subprocess
from typing import Any

import orjson
import pytest

from bench import publish
from bench.harness.output import PUBLISHED, ROOT

SCENARIOS = ("router-bound", "storm")


def summary(name: str) -> dict[str, Any]:
    return orjson.loads((PUBLISHED / f"{name}.json").read_bytes())


@pytest.mark.parametrize("name", sorted(publish.SECTIONS))
def test_the_published_sections_are_current(name: str) -> None:
    page, render = publish.SECTIONS[name]
    expected = render()
    assert expected.count("\n") >= 1
    assert publish.page_section(page.read_text(), name) == expected, (
        f"{page.relative_to(ROOT)} section {name!r} out of date: run `python -m bench.publish`"
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_summary_carries_its_date_commit_machine_and_load(name: str) -> None:
    s = summary(name)
    assert s["scenario"] == name
    datetime.datetime.fromisoformat(s["date"])
    assert re.fullmatch(r"[0-9a-f]{40}", s["commit"]), s["commit"]  # never `-dirty`
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{s['commit']}^{{commit}}"])
    assert known.returncode == 0, f"{s['commit']} is not a commit of this repository"
    assert s["machine"]["nproc"] >= 1 and s["machine"]["cpu_model"]
    load = s["load_average"]
    assert load["samples"] >= 1 and load["min"] <= load["median"] <= load["max"]
    assert s["repeat"] >= 3
    assert s["baseline"] in s["targets"]
    assert {"trio_pd", "smg", "mini_lb"} <= set(s["targets"])
    for target in s["targets"]:
        assert s["medians"][target], f"{name}: no medians for {target}"
        if target != s["baseline"]:
            assert target in s["ratios"], f"{name}: no ratio to the baseline for {target}"
    assert all(v["verdict"] in ("PASS", "MISS", "n/a") for v in s["verdicts"])


def test_a_section_follows_its_summary(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The sections are read from the summaries, not typed: a changed median changes them."""
    for name in SCENARIOS:
        (tmp_path / f"{name}.json").write_bytes((PUBLISHED / f"{name}.json").read_bytes())
    before = publish.router_bound_section()
    s = summary("router-bound")
    s["medians"]["trio_pd"]["c32_cpu_us_per_req"] = 4321.0
    (tmp_path / "router-bound.json").write_bytes(orjson.dumps(s))
    monkeypatch.setattr(publish, "PUBLISHED", tmp_path)
    after = publish.router_bound_section()
    assert after != before and "4,321" in after
    assert "4,321 µs" in publish.readme_section()
