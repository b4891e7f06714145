"""power_of_two polls the engines' loads (SGLang 0.5.23's `/v1/loads`; `/get_load` on older
engines) every `--worker-startup-check-interval` (what SMG
0.3.2 uses that flag for: its LoadMonitor), over real sockets; other policies poll nothing. The
timing itself is tested under MockClock in tests/fleet/test_loads.py."""

from __future__ import annotations

import trio

from tests.conftest import start_cluster
from tests.router.helpers import settle
from trio_pd.config import OverloadConfig, PolicyConfig

NO_PROTECTION = OverloadConfig(protection=False)  # overload protection polls every role

LOOSE = 5.0


def load_polls(engine, path: str = "/v1/loads") -> int:
    return len(engine.events.find("info_request", path=path))


async def test_power_of_two_polls_the_engines_loads(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        policy=PolicyConfig(prefill_policy="power_of_two", decode_policy="round_robin"),
        load_poll_interval_secs=0.2,
        overload=NO_PROTECTION,
    )
    await settle(lambda: load_polls(cluster.prefill) >= 3, LOOSE)
    assert load_polls(cluster.decode) == 0  # its policy does not use them
    prefill = cluster.router.fleet.workers("prefill")[0]
    assert prefill.reported_load == 0 and prefill.reported_at is not None
    assert prefill.engine_load is not None and prefill.engine_load.endpoint == "/v1/loads"
    assert load_polls(cluster.prefill, "/get_load") == 0
    await cluster.client.aclose()


async def test_an_older_engine_is_polled_at_get_load(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        prefill={"legacy_load_endpoint": True},
        policy=PolicyConfig(prefill_policy="power_of_two", decode_policy="round_robin"),
        load_poll_interval_secs=0.2,
    )
    await settle(lambda: load_polls(cluster.prefill, "/get_load") >= 3, LOOSE)
    assert load_polls(cluster.prefill) == 1  # one 404 taught the router
    assert cluster.router.fleet.workers("prefill")[0].legacy_load
    await cluster.client.aclose()


async def test_other_policies_poll_nothing(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, load_poll_interval_secs=0.2, overload=NO_PROTECTION)
    await trio.sleep(1.0)
    assert load_polls(cluster.prefill) == load_polls(cluster.decode) == 0
    assert cluster.prefill.events.find("info_request", path="/health")  # (it does log probes)
    await cluster.client.aclose()


async def test_overload_protection_polls_every_role(nursery: trio.Nursery) -> None:
    """On by default (SMG 1.13): the veto reads every worker's load, whatever the policy."""
    cluster = await start_cluster(nursery, load_poll_interval_secs=0.2)  # round_robin
    await settle(lambda: min(load_polls(cluster.prefill), load_polls(cluster.decode)) >= 3, LOOSE)
    for worker in cluster.router.fleet.workers():
        assert worker.engine_load is not None and worker.engine_load.endpoint == "/v1/loads"
    await cluster.client.aclose()
