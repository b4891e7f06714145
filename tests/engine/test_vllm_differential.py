"""The simulator's vLLM mode against a real vLLM 0.32 pair's recording
(`tests/data/vllm_0.32.0_observables.json`, written by the vLLM tier: docs/vllm-tier.md).

The same engine-direct scenarios (`tests/vllm/scenarios.py`) run against simulator engines in
vLLM mode. Statuses, id rules, the handoff's fields and shape, what a stream carries must be
the recording's exactly; a body's shape (every depth) must be a part of the real one (every key
the simulator writes is one vLLM 0.32 writes, with the same type; vLLM writes more, e.g.
`system_fingerprint`, `service_tier`), and at every path trio_pd reads (`READ_PATHS`) the
simulator's shape must be the real one's exactly.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import trio

from tests.vllm import scenarios
from trio_pd_testing.engine.vllm import VllmEngineConfig, serve_vllm_engine

# The prefill's context as the tier's (512 tokens; the simulator's tokens are words).
PREFILL = VllmEngineConfig(max_model_len=512)
# What trio_pd reads of an answer, a stream chunk or an error (pd/engines/vllm.py,
# vllm_handoff.py, frames.py, samples.py, answers.py): at these paths the simulator's shape must
# be the recording's exactly (`scenarios.SHAPE_RULES`: a `null` only where vLLM wrote `null`,
# token lists of any length). `[]`: every element of a list.
READ_PATHS = (
    "id",
    "choices[].index",
    "choices[].text",
    "choices[].message.role",
    "choices[].message.content",
    "choices[].delta.content",
    "choices[].finish_reason",
    "choices[].logprobs",
    "choices[].prompt_logprobs",
    "usage.prompt_tokens",
    "usage.completion_tokens",
    "usage.total_tokens",
    "usage.prompt_tokens_details.cached_tokens",
    "kv_transfer_params",
    "error.message",
    "error.type",
    "error.code",
)
ABSENT = "absent"


def project(shape: Any, parts: list[str]) -> Any:
    """The part of a shape at one read path (`ABSENT` where the answer has no such key)."""
    if not parts:
        return shape
    head, rest = parts[0], parts[1:]
    key = head.removesuffix("[]")
    if not isinstance(shape, dict) or key not in shape:
        return ABSENT
    value = shape[key]
    if head.endswith("[]") and isinstance(value, list):
        return [project(item, rest) for item in value]
    return project(value, rest)


def read_differences(real: Any, sim: Any, path: str) -> list[str]:
    """Where the simulator's shape differs from vLLM's at a path trio_pd reads."""
    out = []
    for read in READ_PATHS:
        parts = read.split(".")
        out += scenarios.shape_differences(
            project(real, parts), project(sim, parts), f"{path}:{read}", scenarios.SHAPE_RULES
        )
    return out


def shape_part_of(real: Any, sim: Any, path: str) -> list[str]:
    """Where the simulator's shape is not part of the real one (a key vLLM does not write, or
    a type it does not use there); vLLM writes more (`system_fingerprint`, `service_tier`)."""
    if real == sim:
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
        if not real or not sim:
            return [] if not real and not sim else [f"{path}: one list is empty, one is not"]
        return [
            d
            for i, item in enumerate(sim)
            for d in shape_part_of(real[min(i, len(real) - 1)], item, f"{path}[{i}]")
        ]
    return [f"{path}: vLLM 0.32 {real!r}, the simulator {sim!r}"]


def differences(real: Any, sim: Any, path: str = "$") -> list[str]:
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{path}.{k}: missing" for k in real if k not in sim]
        out += [f"{path}.{k}: unexpected" for k in sim if k not in real]
        for k in real.keys() & sim.keys():
            where = f"{path}.{k}"
            if k == "handoff_shape":  # read whole (`pd/vllm_handoff.py`): strict throughout
                out += scenarios.shape_differences(real[k], sim[k], where, scenarios.SHAPE_RULES)
            elif k.endswith("shape"):
                out += shape_part_of(real[k], sim[k], where)
                out += read_differences(real[k], sim[k], where)
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
