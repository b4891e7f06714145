"""The simulator against the real engine: the differential test (issue 18).

Every engine-direct scenario of the real-engine tier (`tests/sglang/scenarios.py`) runs here
against simulator engines, in `make test`, and its observables (statuses, whole body shapes per
route, rid rules, prefix aborts and `n`, the disconnect timing class, abort answers, and what the
router reads: `/v1/loads` of a decode waiting for KV, the aborted `finish_reason` object, the
abort latch, the `/server_info` fields it acts on, streams' finish and usage chunks, batches,
input logprobs, an unreachable bootstrap server; and the fault matrix's rows, from
`tests/sglang/fault_scenarios.py`: a frozen engine, a decode killed mid-stream and while legs
wait for KV, the prefill's loads in the KV-transfer window) must be those recorded from a real
SGLang 0.5.23 pair
(`tests/data/sglang_0.5.23_observables.json`, re-checked live by `make test-sglang`). The
simulator is configured as the tier's pair is: the prefill's context shorter than the decode's,
`/health` a generation that takes a second, disconnects polled every 4 s, 32 running requests.
Shapes are compared strictly (`scenarios.shape_differences`: a `null` only matches a `null`
unless the recording's `shape_rules` mark the field optional; lists element by element).
Where it must differ, the difference is listed in `EXPECTED` with its reason and asserted to be
exactly that: a simulator that drifts from the engine in a new way fails here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import start_engine
from tests.router.test_fault_matrix_sim import engine_process
from tests.sglang import fault_scenarios, scenarios
from tests.sglang.record import OUT

RECORDED = json.loads(OUT.read_text())

# The tier's pair: a prompt of LONG_PROMPT_WORDS words is 1500 tokens of the tiny real
# tokenizer (3 a word), over its prefill's 1024 and within its decode's 4096; the simulator
# counts a word as one token, so its prefill's context is set to refuse the same prompt.
SIM_PREFILL = {"context_length": scenarios.LONG_PROMPT_WORDS - 100, "health_generate_secs": 1.0}
# The decode retries an unreachable bootstrap server as SGLang does (15 attempts), 10 ms apart
# instead of 1 s: the differential compares the failure, not its 15 s.
SIM_DECODE = {"context_length": 4096, "health_generate_secs": 1.0, "bootstrap_retry_interval": 0.01}
COMMON = {"disconnect_poll_secs": 4.0, "waiting_timeout": 300.0, "max_running": 32}

# Where the simulator differs from the real engine on purpose: {scenario: {path: why}}.
EXPECTED: dict[str, dict[str, str]] = {}


@pytest.fixture
async def target(nursery: trio.Nursery) -> scenarios.Target:
    prefill = await start_engine(nursery, "prefill", **COMMON, **SIM_PREFILL)
    decode = await start_engine(nursery, "decode", **COMMON, **SIM_DECODE)
    return scenarios.Target(prefill.url, decode.url, prefill.bootstrap_port)


def difference_paths(recorded: Any, live: Any) -> dict[str, str]:
    found = scenarios.differences(
        scenarios.comparable(recorded), scenarios.comparable(live), rules=RECORDED["shape_rules"]
    )
    return {line.split(":", 1)[0]: line for line in found}


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
async def test_the_simulator_behaves_as_the_real_engine_recorded(
    name: str, target: scenarios.Target
) -> None:
    async with scenarios.client() as client:
        live = await scenarios.SCENARIOS[name](target, client)
    found = difference_paths(RECORDED["main"][name], json.loads(json.dumps(live)))
    expected = EXPECTED.get(name, {})
    assert set(found) == set(expected), "\n".join(found.values())


# The fault scenarios signal the engines' processes, so the simulator runs here as processes
# of its own (`python -m trio_pd_testing.engine`): SIGSTOP, SIGCONT and SIGKILL are real. The
# prefill's KV takes 1 s to move (`--kv-transfer-ms`: the real engine's window, longer so a
# few-ms poll sees it), the decode 20 ms a token (so a stream is still decoding when killed).
FAULT_PREFILL = ("--kv-transfer-ms", "1000")
FAULT_DECODE = ("--inter-token-ms", "20")


@pytest.mark.parametrize("name", sorted(fault_scenarios.FAULT_SCENARIOS))
async def test_the_simulator_meets_the_faults_as_the_real_engine_recorded(
    name: str, tmp_path: Path
) -> None:
    async with (
        engine_process(tmp_path, "prefill", *FAULT_PREFILL) as prefill,
        engine_process(tmp_path, "decode", *FAULT_DECODE) as decode,
        scenarios.client() as client,
    ):
        engines = {"prefill": prefill, "decode": decode}
        target = scenarios.Target(prefill.url, decode.url, prefill.bootstrap_port or 0)

        def send(role: str, signum: int) -> None:
            os.kill(engines[role].process.pid, signum)

        async def restart(role: str) -> None:
            """Nothing runs on the engine after its scenario: the test ends with it."""

        live = await fault_scenarios.FAULT_SCENARIOS[name](
            target, fault_scenarios.Signals(send, restart), client
        )
    found = difference_paths(RECORDED["main"][name], json.loads(json.dumps(live)))
    expected = EXPECTED.get(name, {})
    assert set(found) == set(expected), "\n".join(found.values())


# The comparison itself: strict where the old one was lenient (issue 28).
RULES = {"optional": ["cached_tokens_details"], "any_length": ["output_ids"]}


def shape_diffs(recorded: Any, live: Any) -> list[str]:
    return scenarios.shape_differences(
        scenarios.shape(recorded), scenarios.shape(live), rules=RULES
    )


def test_a_null_matches_only_a_null_unless_the_recording_marks_the_field_optional() -> None:
    assert shape_diffs({"dp_rank": None}, {"dp_rank": 0}) == [
        "$.dp_rank: recorded 'null', live 'int'"
    ]
    assert shape_diffs({"dp_rank": 0}, {"dp_rank": None}) != []
    assert shape_diffs({"cached_tokens_details": None}, {"cached_tokens_details": {"a": 1}}) == []


def test_lists_are_compared_element_by_element_at_any_depth() -> None:
    deep = {"a": {"b": {"c": {"d": [[1, None], [2, None]]}}}}
    later = {"a": {"b": {"c": {"d": [[1, None], [2, "x"]]}}}}
    assert shape_diffs(deep, later) == ["$.a.b.c.d[1][1]: recorded 'null', live 'str'"]
    assert shape_diffs([1, 2], [1]) == ["$: recorded 2 items, live 1"]
    assert shape_diffs([], [1]) != [] and shape_diffs([1], []) != []


def test_a_length_free_list_is_checked_element_by_element_too() -> None:
    assert shape_diffs({"output_ids": [1, 2, 3]}, {"output_ids": [4, 5]}) == []
    assert shape_diffs({"output_ids": [1, 2]}, {"output_ids": [4, 5, 6]}) == []
    assert shape_diffs({"output_ids": [1, 2]}, {"output_ids": [4, "x", 6]}) == [
        "$.output_ids[1]: recorded 'int', live 'str'"
    ]
    assert shape_diffs({"output_ids": [1]}, {"output_ids": []}) != []
