"""The recorded observables (`tests/data/sglang_0.5.23_observables.json`, written by
`python -m tests.sglang.record`) re-run live: the real engine still behaves as recorded."""

from __future__ import annotations

import json

import pytest

from tests.sglang import fault_scenarios, pairs, scenarios
from tests.sglang.record import OUT

RECORDED = json.loads(OUT.read_text())


@pytest.fixture
async def client():
    async with scenarios.client() as c:
        yield c


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
async def test_live_matches_recording(name, main_pair, main_target, client):
    def run():
        return scenarios.SCENARIOS[name](main_target, client)

    shared_room = name in scenarios.SHARED_ROOM
    live = await (pairs.past_shared_room_crashes(main_pair, run) if shared_room else run())
    recorded = RECORDED["main"][name]
    diffs = scenarios.differences(
        scenarios.comparable(recorded),
        scenarios.comparable(json.loads(json.dumps(live))),
        rules=RECORDED["shape_rules"],
    )
    assert not diffs, diffs


# After the others (file order): `decode_killed` kills the main pair's decode and restarts it
# in place (same ports: routers in front keep their URLs).
@pytest.mark.parametrize("name", list(fault_scenarios.FAULT_SCENARIOS))
async def test_faults_live_match_recording(name, main_pair, main_target, client):
    live = await fault_scenarios.FAULT_SCENARIOS[name](
        main_target, pairs.signals(main_pair), client
    )
    diffs = scenarios.differences(
        scenarios.comparable(RECORDED["main"][name]),
        scenarios.comparable(json.loads(json.dumps(live))),
        rules=RECORDED["shape_rules"],
    )
    assert not diffs, diffs


async def test_admin_live_matches_recording(admin_target, client):
    live = await scenarios.admin_key_abort(admin_target, client)
    diffs = scenarios.differences(
        scenarios.comparable(RECORDED["admin"]["admin_key_abort"]),
        scenarios.comparable(live),
        rules=RECORDED["shape_rules"],
    )
    assert not diffs, diffs
