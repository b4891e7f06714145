"""The simulator's vLLM mode against a real vLLM 0.32 pair's recording
(`tests/data/vllm_0.32.0_observables.json`, written by the vLLM tier: docs/vllm-tier.md).

The same engine-direct scenarios (`tests/vllm/scenarios.py`) run against simulator engines in
vLLM mode. Statuses, id rules, the handoff's fields, what a stream carries must be the
recording's exactly; a body's shape must be a part of the real one (every key the simulator
writes is one vLLM 0.32 writes, with the same type; vLLM writes more, e.g.
`system_fingerprint`, `service_tier`), and the keys trio_pd reads must be there.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import trio

from tests.vllm import scenarios
from trio_pd.testing.engine.vllm import VllmEngineConfig, serve_vllm_engine

# The prefill's context as the tier's (512 tokens; the simulator's tokens are words).
PREFILL = VllmEngineConfig(max_model_len=512)
# What trio_pd reads of an answer (pd/engines/vllm.py, pd/frames.py): must be in the simulator's.
READ = {"id", "choices", "usage"}


def shape_part_of(real: Any, sim: Any, path: str) -> list[str]:
    """Where the simulator's shape is not part of the real one."""
    if real == sim or "null" in (real, sim):
        return []
    if isinstance(real, str) and isinstance(sim, str) and {real, sim} <= {"int", "float"}:
        return []
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [
            f"{path}.{k}: the simulator writes it, vLLM 0.32 does not" for k in sim if k not in real
        ]
        for k in real.keys() & sim.keys():
            out += shape_part_of(real[k], sim[k], f"{path}.{k}")
        return out
    if isinstance(real, list) and isinstance(sim, list):
        if ["list"] in (real, sim):
            return []
        return shape_part_of(real[0], sim[0], f"{path}[0]")
    return [f"{path}: vLLM 0.32 {real!r}, the simulator {sim!r}"]


def differences(real: Any, sim: Any, path: str = "$") -> list[str]:
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{path}.{k}: missing" for k in real if k not in sim]
        out += [f"{path}.{k}: unexpected" for k in sim if k not in real]
        for k in real.keys() & sim.keys():
            where = f"{path}.{k}"
            if k.endswith("shape"):
                out += shape_part_of(real[k], sim[k], where)
                if k in ("prefill_shape", "decode_shape"):
                    out += [f"{where}.{key}: missing" for key in READ - set(sim[k])]
            else:
                out += differences(real[k], sim[k], where)
        return out
    return [] if real == sim else [f"{path}: vLLM 0.32 {real!r}, the simulator {sim!r}"]


async def observe_simulator(nursery: trio.Nursery) -> dict[str, Any]:
    prefill = await nursery.start(serve_vllm_engine, PREFILL, "prefill")
    decode = await nursery.start(serve_vllm_engine, VllmEngineConfig(), "decode")
    target = scenarios.Target(prefill.url, decode.url, "sim-model", "word " * 600)
    async with httpx2.AsyncClient(timeout=20) as client:
        return await scenarios.run_all(target, client)


async def test_the_simulator_answers_as_the_real_pair_recorded(nursery: trio.Nursery) -> None:
    recorded = json.loads(scenarios.RECORDING.read_text())
    assert differences(recorded, await observe_simulator(nursery)) == []
