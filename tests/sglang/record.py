"""Record the engine's observables: `python -m tests.sglang.record` (under `.venv`).

Starts the tier's two pairs (main, then admin-keyed), runs every scenario of
`tests.sglang.scenarios` against them and writes `tests/data/sglang_0.5.23_observables.json`
with its provenance and `shape_rules` (which fields may be null, which lists follow the
tokenizer's length: `scenarios.SHAPE_RULES`). `--main URL,URL,PORT` uses a running pair
instead, `--only a,b` runs only those scenarios and merges them into the existing recording (the
others stay as recorded). The fault scenarios (`tests.sglang.fault_scenarios`) run last on the
main pair: one of them kills and restarts an engine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import trio

from tests.sglang import fault_scenarios, pairs, scenarios
from trio_pd_testing.sglang import SGLANG_VERSION, SGLangPair, launcher

OUT = Path(__file__).resolve().parents[1] / "data" / f"sglang_{SGLANG_VERSION}_observables.json"


async def run_all(
    target: scenarios.Target,
    table: dict,
    faults: dict | None = None,
    signals: fault_scenarios.Signals | None = None,
    pair: SGLangPair | None = None,
) -> dict:
    out = {}
    async with scenarios.client() as client:
        for name, scenario in table.items():
            t0 = time.monotonic()

            def run(scenario=scenario):
                return scenario(target, client)

            if pair is not None and name in scenarios.SHARED_ROOM:
                out[name] = await pairs.past_shared_room_crashes(pair, run)
            else:
                out[name] = await run()
            print(f"{name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for name, fault_scenario in (faults or {}).items():
            assert signals is not None
            t0 = time.monotonic()
            out[name] = await fault_scenario(target, signals, client)
            print(f"{name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return out


def provenance() -> dict:
    return {
        "sglang_version": SGLANG_VERSION,
        "recorded": datetime.date.today().isoformat(),
        "model": "tiny random-weight Llama (testing/trio_pd_testing/sglang/make_model.py), "
        "--load-format dummy",
        "engine_env": launcher.ENGINE_ENV,
        "common_args": list(launcher.COMMON_ARGS),
        "decode_args": list(launcher.DECODE_ARGS),
        "main_pair": pairs.main_flags(),
        "admin_pair": ["--api-key <key>", "--admin-api-key <key>"],
        "recorded_by": "python -m tests.sglang.record",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang.record")
    parser.add_argument("--main", help="prefill_url,decode_url,bootstrap_port of a running pair")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--only", help="comma-separated scenario names, merged into --out")
    args = parser.parse_args(argv)
    table = scenarios.SCENARIOS
    faults = fault_scenarios.FAULT_SCENARIOS
    if args.only:
        names = args.only.split(",")
        table = {name: table[name] for name in names if name in table}
        faults = {name: faults[name] for name in names if name in faults}
        record = json.loads(Path(args.out).read_text())
        record["provenance"].setdefault("merged", []).append(
            {"scenarios": names, "recorded": datetime.date.today().isoformat()}
        )
        with pairs.start_main() as pair:
            record["main"].update(
                trio.run(run_all, pairs.target(pair), table, faults, pairs.signals(pair), pair)
            )
    elif args.main:
        record = {"provenance": provenance(), "shape_rules": scenarios.SHAPE_RULES}
        p, d, b = args.main.split(",")
        record["main"] = trio.run(run_all, scenarios.Target(p, d, int(b)), table)
    else:
        record = {"provenance": provenance(), "shape_rules": scenarios.SHAPE_RULES}
        with pairs.start_main() as pair:
            record["main"] = trio.run(
                run_all, pairs.target(pair), table, faults, pairs.signals(pair), pair
            )
        with pairs.start_admin() as pair:
            record["admin"] = trio.run(run_all, pairs.target(pair), scenarios.ADMIN_SCENARIOS)
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
