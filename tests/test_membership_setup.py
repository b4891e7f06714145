"""Which store and sources a router runs (`membership/setup.py`), and a source whose first run
crashes not holding startup (`ServiceGuard.supervised`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trio_pd.config import EtcdConfig, KubernetesConfig, RouterConfig
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.etcd import EtcdMembership
from trio_pd.membership.kubernetes import KubernetesDiscovery
from trio_pd.membership.memory import MemoryStore
from trio_pd.membership.setup import membership_for
from trio_pd.membership.shared_file import FileMembership
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.spec import WorkerSpec

KUBE = KubernetesConfig(decode_selector={"role": "decode"}, api_server="http://127.0.0.1:1")
ETCD = EtcdConfig(endpoints="http://127.0.0.1:2379")


def kinds(config: RouterConfig) -> tuple[type, list[type]]:
    fleet = Fleet(config, static=config.membership_file is None)
    membership = membership_for(config, fleet, RouterMetrics(multiprocess_dir=""))
    return type(membership.store), [type(s) for s in membership.sources]


@pytest.mark.parametrize(
    "options, store, sources",
    [
        ({}, MemoryStore, []),
        ({"kubernetes": KUBE}, MemoryStore, [KubernetesDiscovery]),
        ({"membership_file": "m.json"}, FileMembership, [FileMembership]),
        (
            {"membership_file": "m.json", "kubernetes": KUBE},
            FileMembership,
            [FileMembership, KubernetesDiscovery],
        ),
        ({"etcd": ETCD}, EtcdMembership, [EtcdMembership]),
        ({"etcd": ETCD, "kubernetes": KUBE}, EtcdMembership, [EtcdMembership, KubernetesDiscovery]),
    ],
)
def test_store_and_sources_follow_the_config(
    options: dict, store: type, sources: list[type], tmp_path: Path
) -> None:
    if "membership_file" in options:
        options = {**options, "membership_file": str(tmp_path / options["membership_file"])}
    assert kinds(RouterConfig(**options)) == (store, sources)


def test_etcd_and_a_membership_file_are_refused_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pick one"):
        kinds(RouterConfig(etcd=ETCD, membership_file=str(tmp_path / "m.json")))


def test_flags_workers_stay_static_beside_etcd() -> None:
    config = RouterConfig(decode=(WorkerSpec("http://10.0.0.1:1", "decode"),), etcd=ETCD)
    fleet = Fleet(config, static=config.membership_file is None)
    membership_for(config, fleet, RouterMetrics(multiprocess_dir=""))
    assert [(w.id, w.source) for w in fleet.workers()] == [("decode-1", "static")]


async def test_a_first_run_that_crashes_before_started_releases_startup() -> None:
    runs: list[bool] = []  # whether each run got a task status

    async def source(*, task_status: trio.TaskStatus[None] | None = None) -> None:
        runs.append(task_status is not None)
        if len(runs) == 1:
            raise RuntimeError("boom before started")
        await trio.sleep_forever()

    metrics = RouterMetrics(multiprocess_dir="")
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            guard = ServiceGuard(metrics, on_fatal=lambda why: None)
            await nursery.start(guard.supervised, "membership_test", source)
            while len(runs) < 2:  # restarted after the backoff, without a task status
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert runs == [True, False]
    assert metrics.background_restarts.labels("membership_test")._value.get() == 1
