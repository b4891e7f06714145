"""The real pair against the recording `tests/data/vllm_0.32.0_observables.json` (written
instead with `TRIO_PD_VLLM_RECORD=1`): the simulator's differential test
(`tests/engine/test_vllm_differential.py`) holds the simulator to the same file."""

from __future__ import annotations

import json
import os

from tests.vllm import engines as E
from tests.vllm import scenarios


async def test_the_real_pair_matches_the_recording(pair, engines):
    target = scenarios.Target(pair.prefill_url, pair.decode_url, E.MODEL, E.LONG_PROMPT)
    live = await scenarios.run_all(target, engines)
    if os.environ.get("TRIO_PD_VLLM_RECORD"):
        scenarios.RECORDING.write_text(json.dumps(live, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(scenarios.RECORDING.read_text())
    assert scenarios.differences(recorded, live) == []
    await E.wait_kv_free(engines, pair.prefill_url)
