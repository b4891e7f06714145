"""Kubernetes discovery against the fake API server, over real sockets.

Each test first checks that the fake really did the provoked thing (the request it saw, the
stream it cut), then what discovery made of it, through a recording registry.
"""

from __future__ import annotations

import functools
import itertools
import math
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme

from tests.k8s.fake_apiserver import FakeApiServer, RequestRecord, serve_fake_apiserver
from trio_pd.cli.main import build_parser
from trio_pd.cli.parser import serve_config
from trio_pd.config import KubernetesConfig
from trio_pd.membership.kubernetes import (
    KubernetesDiscovery,
    PodView,
    records_for_pod,
)
from trio_pd.spec import WorkerRecord

PREFILL = {"app": "sglang", "role": "prefill"}
DECODE = {"app": "sglang", "role": "decode"}
FAST: dict[str, Any] = {
    "prefill_selector": PREFILL,
    "decode_selector": DECODE,
    "namespace": "default",
    "port": 8000,
    "stall_timeout_secs": 5.0,
    "watch_timeout_secs": 60,
    "resync_secs": 60.0,
    "request_timeout_secs": 5.0,
    "backoff_initial_secs": 0.05,
    "backoff_max_secs": 0.5,
}


class RecordingRegistry:
    """The Registry protocol in memory: every reconcile and status call, and the current set."""

    def __init__(self) -> None:
        self.current: dict[str, WorkerRecord] = {}
        self.calls: list[dict[str, WorkerRecord]] = []
        self.statuses: list[tuple[bool, str]] = []

    def reconcile(self, source: str, desired: Iterable[WorkerRecord]) -> None:
        assert source == "kubernetes"
        records = list(desired)
        assert all(r.source == "kubernetes" for r in records)
        self.current = {r.id: r for r in records}
        assert len(self.current) == len(records), "duplicate ids in one desired set"
        self.calls.append(dict(self.current))

    def source_status(self, source: str, ok: bool, detail: str = "") -> None:
        assert source == "kubernetes"
        self.statuses.append((ok, detail))

    @property
    def ok(self) -> bool | None:
        return self.statuses[-1][0] if self.statuses else None

    def urls(self) -> dict[str, str]:
        return {wid: r.spec.url for wid, r in self.current.items()}


async def eventually(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


@attrs.define
class Setup:
    fake: FakeApiServer
    discovery: KubernetesDiscovery
    registry: RecordingRegistry
    token_file: Path

    async def synced(self) -> None:
        """Discovery has seen every change the fake made so far."""
        await eventually(lambda: self.discovery.resource_version == str(self.fake.rv))

    def watches(self) -> list[RequestRecord]:
        return self.fake.requests_of("watch")

    def lists(self) -> list[RequestRecord]:
        return self.fake.requests_of("list")


async def start(
    nursery: trio.Nursery,
    tmp_path: Path,
    *,
    fake: FakeApiServer | None = None,
    fake_options: dict[str, Any] | None = None,
    **config: Any,
) -> Setup:
    if fake is None:
        options = {"bookmark_interval": 0.3, **(fake_options or {})}
        fake = await nursery.start(functools.partial(serve_fake_apiserver, **options))
    token_file = tmp_path / "token"
    token_file.write_text(fake.token + "\n")
    cfg = KubernetesConfig(
        **{**FAST, "api_server": fake.url, "token_file": str(token_file), **config}
    )
    discovery = KubernetesDiscovery(cfg)
    registry = RecordingRegistry()
    await nursery.start(discovery.run, registry)
    return Setup(fake, discovery, registry, token_file)


# -- joining and leaving -------------------------------------------------------------------------


async def test_pod_joins_when_running_ready_with_ip(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    assert s.registry.ok is True and s.registry.calls == [{}]  # listed: nothing yet
    s.fake.create_pod("p0", labels=PREFILL, annotations={"sglang.ai/bootstrap-port": "8998"})
    await s.synced()
    assert s.registry.current == {}  # Pending, no IP
    s.fake.run_pod("p0", ip="10.0.0.7", ready=False)
    await s.synced()
    assert s.registry.current == {}  # Running but not Ready
    s.fake.set_ready("p0", True)
    s.fake.add_ready_pod("d0", labels=DECODE, ip="10.0.0.8")
    await s.synced()
    p0, d0 = s.registry.current["prefill-p0"], s.registry.current["decode-d0"]
    assert (p0.spec.url, p0.spec.role, p0.spec.bootstrap_port) == (
        "http://10.0.0.7:8000",
        "prefill",
        8998,
    )
    assert (d0.spec.url, d0.spec.role, d0.spec.bootstrap_port) == (
        "http://10.0.0.8:8000",
        "decode",
        None,
    )
    uid = s.fake.pod("p0")["metadata"]["uid"]
    assert p0.meta == {"pod": "p0", "namespace": "default", "uid": uid, "ip": "10.0.0.7"}
    assert len(s.lists()) == 1 and len(s.watches()) == 1  # all of it over one watch


async def test_initial_list_finds_running_pods(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    fake.add_ready_pod("p0", labels=PREFILL, ip="10.0.0.1")
    fake.add_ready_pod("d0", labels=DECODE, ip="10.0.0.2")
    fake.add_ready_pod("other", labels={"app": "nginx"}, ip="10.0.0.3")
    s = await start(nursery, tmp_path, fake=fake)
    # started() came after the first list: the workers are there already.
    assert s.registry.urls() == {
        "prefill-p0": "http://10.0.0.1:8000",
        "decode-d0": "http://10.0.0.2:8000",
    }
    await eventually(s.watches)
    list_req, watch_req = s.lists()[0], s.watches()[0]
    assert list_req.params["labelSelector"] == "app=sglang"  # what both role selectors share
    assert watch_req.params == {
        "labelSelector": "app=sglang",
        "watch": "true",
        "resourceVersion": str(fake.rv),
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "60",
    }


async def test_ready_false_leaves_and_ready_true_rejoins(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    assert "prefill-p0" in s.registry.current
    s.fake.set_ready("p0", False)
    await s.synced()
    assert s.registry.current == {}
    s.fake.set_ready("p0", True)
    await s.synced()
    assert "prefill-p0" in s.registry.current


async def test_graceful_delete_leaves_at_deletion_timestamp(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    s.fake.delete_pod("p0", grace_period=30)
    await s.synced()
    assert "deletionTimestamp" in s.fake.pod("p0")["metadata"]  # still there, terminating
    assert list(s.registry.current) == ["decode-d0"]  # out of rotation already
    s.fake.finish_delete("p0")
    await s.synced()
    assert list(s.registry.current) == ["decode-d0"]


async def test_force_delete_leaves_at_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    calls = len(s.registry.calls)
    s.fake.force_delete_pod("p0")  # DELETED with no MODIFIED before it
    await s.synced()
    assert s.registry.current == {}
    assert len(s.registry.calls) == calls + 1


async def test_eviction_clearing_pod_ip_leaves(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    s.fake.evict_pod("p0")
    await s.synced()
    assert "podIP" not in s.fake.pod("p0")["status"]
    assert s.registry.current == {}


async def test_label_drift_leaves_rechecked_locally(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The server filters on app=sglang only, so role=canary still reaches us as MODIFIED: the
    local re-check must drop it. Losing app=sglang reaches us as the watch cache's DELETED."""
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    events_before = s.discovery.stats.events
    s.fake.set_labels("p0", {"app": "sglang", "role": "canary"})
    await s.synced()
    assert s.discovery.stats.events == events_before + 1  # it did arrive, as a MODIFIED
    assert list(s.registry.current) == ["decode-d0"]
    s.fake.set_labels("d0", {"app": "other", "role": "decode"})
    await s.synced()
    assert s.registry.current == {}
    s.fake.set_labels("p0", PREFILL)  # back in: ADDED for the watch, a worker again
    await s.synced()
    assert list(s.registry.current) == ["prefill-p0"]


async def test_pod_matching_both_selectors_is_prefill(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(
        nursery, tmp_path, prefill_selector={"tier": "pd"}, decode_selector={"tier": "pd"}
    )
    s.fake.add_ready_pod("both", labels={"tier": "pd"})
    await s.synced()
    assert [r.spec.role for r in s.registry.current.values()] == ["prefill"]


# -- a new pod on an old address ------------------------------------------------------------------


async def test_new_pod_on_same_ip_replaces_zombie(nursery: trio.Nursery, tmp_path: Path) -> None:
    """p-old's DELETE has not arrived, and p-new got its IP: the newer pod holds the URL."""
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p-old", labels=PREFILL, ip="10.0.0.9")
    await s.synced()
    s.fake.add_ready_pod("p-new", labels=PREFILL, ip="10.0.0.9")
    await s.synced()
    assert s.registry.urls() == {"prefill-p-new": "http://10.0.0.9:8000"}
    s.fake.finish_delete("p-old")  # the late DELETE must not take the new worker away
    await s.synced()
    assert s.registry.urls() == {"prefill-p-new": "http://10.0.0.9:8000"}


async def test_same_name_new_uid_renews_worker(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A StatefulSet pod recreated during an outage (same name and IP, new uid), seen only by
    the relist: the old worker is removed before the new one is added."""
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("sts-0", labels=PREFILL, ip="10.0.0.5")
    await s.synced()
    old_uid = s.registry.current["prefill-sts-0"].meta["uid"]
    s.fake.set_unavailable(True)
    s.fake.force_delete_pod("sts-0")
    s.fake.add_ready_pod("sts-0", labels=PREFILL, ip="10.0.0.5")
    s.fake.compact()
    calls = len(s.registry.calls)
    s.fake.set_unavailable(False)
    await eventually(lambda: len(s.lists()) == 2)
    await s.synced()
    assert any(w.note == "gone" for w in s.watches())  # the relist came from a 410
    new_uid = s.fake.pod("sts-0")["metadata"]["uid"]
    assert new_uid != old_uid
    after = s.registry.calls[calls:]
    assert after[0] == {}  # the old pod's worker out first
    assert after[1]["prefill-sts-0"].meta["uid"] == new_uid
    assert s.registry.current["prefill-sts-0"].meta["uid"] == new_uid


# -- watch failures -------------------------------------------------------------------------------


async def test_severed_stream_resumes_from_last_rv(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    seen = s.discovery.resource_version
    assert s.fake.sever_watches() == 1
    # Changes while the client is away: the resumed watch must replay them.
    s.fake.set_ready("d0", False)
    s.fake.add_ready_pod("p1", labels=PREFILL)
    await eventually(lambda: len(s.watches()) == 2)
    assert s.watches()[0].note == "severed"
    assert s.watches()[1].params["resourceVersion"] == seen  # resumed, not relisted
    await s.synced()
    assert sorted(s.registry.current) == ["prefill-p0", "prefill-p1"]
    assert len(s.lists()) == 1
    assert s.discovery.errors["severed"] == 1
    assert all(ok for ok, _ in s.registry.statuses)  # a cut stream is not an outage


async def test_watch_timeout_rewatches_from_last_rv(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path, watch_timeout_secs=1)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await eventually(lambda: len(s.watches()) >= 2)
    assert s.watches()[0].note == "timeout"
    assert s.watches()[1].params["resourceVersion"] == str(s.fake.rv)
    assert len(s.lists()) == 1 and sum(s.discovery.errors.values()) == 0
    assert list(s.registry.current) == ["prefill-p0"]


async def test_stalled_watch_restarted_by_watchdog(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path, stall_timeout_secs=1.0)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    seen = s.discovery.resource_version
    assert s.fake.stall_watches() == 1
    s.fake.add_ready_pod("d0", labels=DECODE)  # queued behind the stall: never sent on it
    await trio.sleep(0.5)
    assert "decode-d0" not in s.registry.current and len(s.watches()) == 1
    await eventually(lambda: len(s.watches()) == 2, timeout=5)
    assert s.watches()[0].note == "stalled"
    assert s.watches()[1].params["resourceVersion"] == seen
    await s.synced()
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0"]
    assert s.discovery.stats.stalls == 1 and s.discovery.errors["stalled"] == 1
    assert len(s.lists()) == 1


async def test_stall_before_first_byte_detected(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(functools.partial(serve_fake_apiserver, bookmark_interval=0.3))
    fake.stall_next_watches(1)
    s = await start(nursery, tmp_path, fake=fake, stall_timeout_secs=1.0)
    fake.add_ready_pod("p0", labels=PREFILL)
    await eventually(lambda: len(s.watches()) == 2, timeout=5)
    assert s.watches()[0].note == "stalled"
    await s.synced()
    assert list(s.registry.current) == ["prefill-p0"]


async def test_bookmarks_keep_a_quiet_watch_alive(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path, stall_timeout_secs=1.0)
    await trio.sleep(2.5)  # no pod changes at all; bookmarks every 0.3 s
    assert s.discovery.stats.bookmarks >= 3
    assert len(s.watches()) == 1 and s.discovery.stats.stalls == 0


async def test_expired_watch_relists(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    assert s.fake.expire_watches() == 1  # ERROR event, code 410, mid-stream
    await eventually(lambda: len(s.lists()) == 2)
    assert s.watches()[0].note == "expired"
    await eventually(lambda: len(s.watches()) == 2)
    assert s.watches()[1].params["resourceVersion"] == str(s.fake.rv)
    assert s.discovery.stats.expired == 1
    assert list(s.registry.current) == ["prefill-p0"]


async def test_persistent_410_relists_with_growing_backoff(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(nursery, tmp_path, backoff_initial_secs=0.1, backoff_max_secs=0.8)
    s.fake.gone_next_watches(math.inf)
    s.fake.sever_watches()  # the current watch ends; every later one answers ERROR 410
    await trio.sleep(3.0)
    watches = s.watches()[1:]
    assert watches and all(w.note == "gone" for w in watches)
    lists = s.lists()
    # A hot loop would relist hundreds of times in 3 s; backoff 0.1, 0.2, 0.4, 0.8, 0.8...
    assert 3 <= len(lists) <= 8, len(lists)
    gaps = [b.at - a.at for a, b in itertools.pairwise(lists[1:])]
    assert all(g >= 0.1 * 0.8 for g in gaps), gaps
    assert gaps[-1] > gaps[0], gaps
    s.fake.gone_next_watches(0)
    count = len(s.lists())
    await eventually(lambda: s.watches()[-1].note == "" and s.watches()[-1].status == 200)
    await trio.sleep(1.0)
    assert len(s.lists()) <= count + 1  # settled on a healthy watch


async def test_delete_missed_during_outage_removed_by_relist(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(nursery, tmp_path)
    for name in ("p0", "p1"):
        s.fake.add_ready_pod(name, labels=PREFILL)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    s.fake.set_unavailable(True)  # cuts the watch; every request now dropped
    await eventually(lambda: s.registry.ok is False)
    assert s.discovery.errors["unreachable"] >= 1
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0", "prefill-p1"]  # kept
    s.fake.force_delete_pod("p1")  # its DELETED is lost to the client...
    s.fake.compact()  # ...and so is the history a resumed watch would replay
    s.fake.set_unavailable(False)
    await eventually(lambda: len(s.lists()) == 2)
    gone = [w for w in s.watches() if w.note == "gone"]
    assert gone and gone[0].at < s.lists()[1].at  # the relist followed a 410
    await eventually(lambda: s.discovery.stats.lists == 2)  # the relist's answer was read
    assert s.registry.ok is True
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0"]


async def test_outage_resumed_watch_replays_missed_delete(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Without compaction, the resumed watch itself delivers the DELETE: no relist needed."""
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    s.fake.add_ready_pod("p1", labels=PREFILL)
    await s.synced()
    s.fake.set_unavailable(True)
    await eventually(lambda: s.registry.ok is False)
    s.fake.force_delete_pod("p1")
    s.fake.set_unavailable(False)
    await s.synced()
    assert list(s.registry.current) == ["prefill-p0"]
    assert len(s.lists()) == 1


async def test_watch_cache_window_410(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A watch cache of 3 events: an outage longer than that window must end in a relist."""
    s = await start(nursery, tmp_path, fake_options={"max_events": 3})
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    s.fake.set_unavailable(True)
    await eventually(lambda: s.registry.ok is False)
    for name in ("a", "b", "c"):
        s.fake.add_ready_pod(name, labels=DECODE)
    s.fake.force_delete_pod("p0")
    s.fake.set_unavailable(False)
    await eventually(lambda: len(s.lists()) == 2)
    await s.synced()
    assert sorted(s.registry.current) == ["decode-a", "decode-b", "decode-c"]


# -- auth, paging, scope --------------------------------------------------------------------------


async def test_token_rotation_is_reread(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await s.synced()
    old = s.fake.token
    new = s.fake.rotate_token()  # the API server stops accepting the old token...
    s.fake.sever_watches()  # ...and the connection drops
    await eventually(lambda: any(r.status == 401 for r in s.watches()))
    await eventually(lambda: s.registry.ok is False)
    assert s.discovery.errors["unauthorized"] >= 1
    assert list(s.registry.current) == ["prefill-p0"]  # workers kept through the outage
    s.token_file.write_text(new)  # the kubelet writes the rotated token
    await eventually(lambda: s.watches()[-1].status == 200 and s.watches()[-1].token == new)
    assert {r.token for r in s.watches()} == {old, new}
    await eventually(lambda: s.registry.ok is True)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0"]


async def test_no_token_401(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    registry = RecordingRegistry()
    cfg = KubernetesConfig(**{**FAST, "api_server": fake.url})  # no token at all
    discovery = KubernetesDiscovery(cfg)
    await nursery.start(discovery.run, registry)  # started: the first attempt ended
    assert fake.requests_of("list")[0].status == 401 and fake.requests_of("list")[0].token is None
    assert registry.statuses[0][0] is False and "401" in registry.statuses[0][1]
    assert registry.calls == []


async def test_paged_list(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    for i in range(5):
        fake.add_ready_pod(f"p{i}", labels=PREFILL)
    s = await start(nursery, tmp_path, fake=fake, page_size=2)
    await eventually(s.watches)
    lists = s.lists()
    assert [r.params.get("limit") for r in lists] == ["2", "2", "2"]
    assert "continue" not in lists[0].params
    assert (
        lists[1].params["continue"] and lists[2].params["continue"] != lists[1].params["continue"]
    )
    assert sorted(s.registry.current) == [f"prefill-p{i}" for i in range(5)]
    assert s.watches()[0].params["resourceVersion"] == str(fake.rv)


async def test_paged_list_consistent_snapshot(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A pod added between pages is not in this list (it is a snapshot) but comes by watch."""
    fake = await nursery.start(serve_fake_apiserver)
    for i in range(4):
        fake.add_ready_pod(f"p{i}", labels=PREFILL)

    def between_pages(record: RequestRecord) -> None:
        if (
            record.kind == "list"
            and "continue" in record.params
            and ("default", "late") not in fake.pods
        ):
            fake.add_ready_pod("late", labels=DECODE)

    fake.before_request = between_pages
    s = await start(nursery, tmp_path, fake=fake, page_size=3)
    assert len(s.lists()) == 2
    assert "prefill-p3" in s.registry.calls[0] and "decode-late" not in s.registry.calls[0]
    await s.synced()
    assert sorted(s.registry.current) == ["decode-late", *[f"prefill-p{i}" for i in range(4)]]


async def test_expired_continue_token_restarts_list(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    for i in range(4):
        fake.add_ready_pod(f"p{i}", labels=PREFILL)
    expired = []

    def compact_once(record: RequestRecord) -> None:
        if record.kind == "list" and "continue" in record.params and not expired:
            expired.append(record)
            fake.force_delete_pod("p3")
            fake.compact()

    fake.before_request = compact_once
    s = await start(nursery, tmp_path, fake=fake, page_size=3)
    assert expired and expired[0].status == 410
    await eventually(lambda: s.registry.calls)
    lists = s.lists()
    # Started over from the first page (three pods left now: one page).
    assert len(lists) == 3 and "continue" not in lists[2].params and lists[2].status == 200
    assert sorted(s.registry.current) == ["prefill-p0", "prefill-p1", "prefill-p2"]


async def test_namespace_scope(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    fake.add_ready_pod("p0", labels=PREFILL, namespace="team-a", ip="10.0.1.1")
    fake.add_ready_pod("p0", labels=PREFILL, namespace="team-b", ip="10.0.2.1")
    s = await start(nursery, tmp_path, fake=fake, namespace="team-a")
    assert {r.path for r in fake.requests} == {"/api/v1/namespaces/team-a/pods"}
    assert s.registry.urls() == {"prefill-p0": "http://10.0.1.1:8000"}
    fake.add_ready_pod("d0", labels=DECODE, namespace="team-b")
    fake.add_ready_pod("d0", labels=DECODE, namespace="team-a", ip="10.0.1.2")
    await s.synced()
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0"]
    assert s.registry.current["decode-d0"].meta["namespace"] == "team-a"


async def test_cluster_scope(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    fake.add_ready_pod("p0", labels=PREFILL, namespace="team-a", ip="10.0.1.1")
    fake.add_ready_pod("p0", labels=PREFILL, namespace="team-b", ip="10.0.2.1")
    s = await start(nursery, tmp_path, fake=fake, namespace=None)
    assert {r.path for r in fake.requests} == {"/api/v1/pods"}
    assert s.registry.urls() == {
        "prefill-team-a.p0": "http://10.0.1.1:8000",
        "prefill-team-b.p0": "http://10.0.2.1:8000",
    }


async def test_cluster_scope_forbidden(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await nursery.start(functools.partial(serve_fake_apiserver, forbid_cluster_scope=True))
    s = await start(nursery, tmp_path, fake=fake, namespace=None)
    assert s.lists()[0].status == 403
    assert s.registry.ok is False and "forbidden" in s.registry.statuses[-1][1]
    await eventually(lambda: s.discovery.errors["forbidden"] >= 3)  # retried, with backoff
    assert len(s.lists()) >= 3 and all(r.status in (403, None) for r in s.lists())


# -- level-triggered ------------------------------------------------------------------------------


async def test_resync_restores_the_full_set(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path, resync_secs=0.3)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    s.fake.add_ready_pod("d0", labels=DECODE)
    await s.synced()
    s.registry.current.pop("decode-d0")  # the registry lost a worker somehow
    calls = len(s.registry.calls)
    await eventually(lambda: len(s.registry.calls) >= calls + 2)
    assert sorted(s.registry.current) == ["decode-d0", "prefill-p0"]
    assert len(s.watches()) == 1  # from the cache: no API call needed


async def test_periodic_relist(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path, relist_secs=0.5, watch_timeout_secs=1)
    s.fake.add_ready_pod("p0", labels=PREFILL)
    await eventually(lambda: len(s.lists()) == 2, timeout=5)
    assert s.watches()[0].note == "timeout" and s.lists()[1].at > s.watches()[0].at
    await eventually(lambda: len(s.watches()) == 2)
    assert s.watches()[1].params["resourceVersion"] == str(s.fake.rv)
    assert list(s.registry.current) == ["prefill-p0"]


async def test_first_attempt_unreachable_still_starts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    registry = RecordingRegistry()
    cfg = KubernetesConfig(**{**FAST, "api_server": f"http://127.0.0.1:{port}"})
    kinds: list[str] = []
    discovery = KubernetesDiscovery(cfg, on_error=kinds.append)
    with trio.fail_after(5):
        await nursery.start(discovery.run, registry)
    assert registry.statuses == [(False, registry.statuses[0][1])]
    assert "unreachable" in registry.statuses[0][1] and discovery.errors["unreachable"] == 1
    assert kinds == ["unreachable"] and registry.calls == []
    await eventually(lambda: len(kinds) >= 3)  # keeps trying, with backoff


# -- annotations ----------------------------------------------------------------------------------


async def test_worker_ports_annotation(nursery: trio.Nursery, tmp_path: Path) -> None:
    s = await start(nursery, tmp_path)
    s.fake.add_ready_pod(
        "multi",
        labels=PREFILL,
        ip="10.0.0.4",
        annotations={
            "smg.ai/worker-ports": "8001, 8002,8001",
            "sglang.ai/bootstrap-port": "9001,9002",
        },
    )
    s.fake.add_ready_pod(
        "single",
        labels=PREFILL,
        ip="10.0.0.5",
        annotations={"smg.ai/worker-ports": "8005", "sglang.ai/bootstrap-port": "9005"},
    )
    s.fake.add_ready_pod(
        "bad", labels=DECODE, ip="10.0.0.6", annotations={"smg.ai/worker-ports": "80x"}
    )
    await s.synced()
    got = {wid: (r.spec.url, r.spec.bootstrap_port) for wid, r in s.registry.current.items()}
    assert got == {
        "prefill-multi-8001": ("http://10.0.0.4:8001", 9001),
        "prefill-multi-8002": ("http://10.0.0.4:8002", 9002),
        "prefill-single": ("http://10.0.0.5:8005", 9005),
        "decode-bad": ("http://10.0.0.6:8000", None),  # invalid list: the configured port
    }


def pod_view(**overrides: Any) -> PodView:
    values: dict[str, Any] = {
        "namespace": "default",
        "name": "p",
        "uid": "u1",
        "labels": dict(PREFILL),
        "annotations": {},
        "phase": "Running",
        "pod_ip": "10.0.0.1",
        "ready": True,
        "deleting": False,
        "created": "2026-12-01T00:00:00Z",
        "resource_version": "1",
    }
    values.update(overrides)
    return PodView(**values)


def test_bootstrap_annotation_rules() -> None:
    cfg = KubernetesConfig(**{**FAST, "port": 30000})
    one = records_for_pod(pod_view(annotations={"sglang.ai/bootstrap-port": "8998"}), cfg)
    assert [(r.spec.url, r.spec.bootstrap_port) for r in one] == [("http://10.0.0.1:30000", 8998)]
    assert records_for_pod(pod_view(), cfg)[0].spec.bootstrap_port is None
    decode = pod_view(labels=dict(DECODE), annotations={"sglang.ai/bootstrap-port": "8998"})
    assert records_for_pod(decode, cfg)[0].spec.bootstrap_port is None
    broadcast = pod_view(
        annotations={"smg.ai/worker-ports": "1,2", "sglang.ai/bootstrap-port": "7"}
    )
    assert [r.spec.bootstrap_port for r in records_for_pod(broadcast, cfg)] == [7, 7]
    misaligned = pod_view(
        annotations={"smg.ai/worker-ports": "1,2", "sglang.ai/bootstrap-port": "7,8,9"}
    )
    assert [r.spec.bootstrap_port for r in records_for_pod(misaligned, cfg)] == [None, None]
    custom = KubernetesConfig(**{**FAST, "bootstrap_port_annotation": "example.com/boot"})
    annotated = pod_view(annotations={"example.com/boot": "5000"})
    assert records_for_pod(annotated, custom)[0].spec.bootstrap_port == 5000


def test_ipv6_url_and_model_id() -> None:
    cfg = KubernetesConfig(**{**FAST, "model_id_from": "label:model"})
    pod = pod_view(pod_ip="fd00::5", labels={**PREFILL, "model": "llama"})
    (record,) = records_for_pod(pod, cfg)
    assert record.spec.url == "http://[fd00::5]:8000" and record.spec.model_id == "llama"


def test_not_serving_reasons() -> None:
    cfg = KubernetesConfig(**FAST)
    assert records_for_pod(pod_view(ready=False), cfg) == []
    assert records_for_pod(pod_view(phase="Pending"), cfg) == []
    assert records_for_pod(pod_view(pod_ip=None), cfg) == []
    assert records_for_pod(pod_view(deleting=True), cfg) == []
    assert records_for_pod(pod_view(labels={"app": "sglang"}), cfg) == []


# -- TLS and in-cluster defaults ------------------------------------------------------------------


def make_tls(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    """A CA (its certificate in a file, as a service account's `ca.crt`) and a server
    certificate for 127.0.0.1 it signed, from trustme (a dev dependency: nothing to skip)."""
    tmp_path.mkdir(exist_ok=True)
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    server.set_alpn_protocols(["http/1.1"])
    ca_file = tmp_path / "ca.crt"
    ca.cert_pem.write_to_path(str(ca_file))
    return server, ca_file


async def test_in_cluster_https_with_service_account_ca(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server_ctx, ca_file = make_tls(tmp_path)
    fake = await nursery.start(functools.partial(serve_fake_apiserver, ssl_context=server_ctx))
    fake.add_ready_pod("p0", labels=PREFILL, ip="10.0.0.1")
    port = fake.url.rsplit(":", 1)[1]
    (tmp_path / "token").write_text(fake.token)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    cfg = KubernetesConfig(
        **{**FAST, "token_file": str(tmp_path / "token"), "ca_file": str(ca_file)}
    )
    discovery = KubernetesDiscovery(cfg, environ=env)
    registry = RecordingRegistry()
    await nursery.start(discovery.run, registry)
    assert registry.ok is True and list(registry.current) == ["prefill-p0"]
    assert fake.requests_of("list")[0].token == fake.token


async def test_https_with_wrong_ca_is_refused(nursery: trio.Nursery, tmp_path: Path) -> None:
    server_ctx, _ = make_tls(tmp_path / "cluster")
    _, other_ca = make_tls(tmp_path / "elsewhere")
    fake = await nursery.start(functools.partial(serve_fake_apiserver, ssl_context=server_ctx))
    cfg = KubernetesConfig(**{**FAST, "api_server": fake.url, "ca_file": str(other_ca)})
    discovery = KubernetesDiscovery(cfg)
    registry = RecordingRegistry()
    await nursery.start(discovery.run, registry)
    assert registry.ok is False and discovery.errors["unreachable"] == 1
    assert fake.requests == []  # never got past the TLS handshake


def test_outside_cluster_without_api_server_is_an_error() -> None:
    discovery = KubernetesDiscovery(KubernetesConfig(**FAST), environ={})
    with pytest.raises(ValueError, match="--kube-api-server"):
        trio.run(discovery.run, RecordingRegistry())


# -- command line ---------------------------------------------------------------------------------


def parse(*argv: str) -> KubernetesConfig | None:
    """The Kubernetes config `trio-pd serve` builds from these flags (the flag table's rows;
    the in-cluster environment check of `router_config` left out)."""
    args = build_parser().parse_args(["serve", *argv])
    return serve_config(args.serve_parser, list(argv), args).kubernetes


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse() is None
    cfg = parse(
        "--service-discovery",
        "--prefill-selector", "app=sglang", "role=prefill",
        "--decode-selector", "app=sglang,role=decode",
        "--selector", "team=a",
        "--service-discovery-namespace", "inference",
    )  # fmt: skip
    assert cfg is not None
    assert cfg.prefill_selector == PREFILL and cfg.decode_selector == DECODE
    assert cfg.server_selector() == "app=sglang,team=a"
    assert (cfg.namespace, cfg.port) == ("inference", 80)
    assert cfg.bootstrap_port_annotation == "sglang.ai/bootstrap-port"
    assert cfg.worker_ports_annotation == "smg.ai/worker-ports"
    assert cfg.api_server is None and cfg.pods_path() == "/api/v1/namespaces/inference/pods"
    cfg = parse(
        "--service-discovery", "--decode-selector", "r=d", "--kube-api-server", "https://k:6443",
        "--kube-token-file", "/t", "--kube-ca-file", "/c", "--service-discovery-port", "30000",
    )  # fmt: skip
    assert cfg is not None
    assert (cfg.api_server, cfg.token_file, cfg.ca_file, cfg.port) == (
        "https://k:6443",
        "/t",
        "/c",
        30000,
    )
    assert cfg.pods_path() == "/api/v1/pods" and cfg.server_selector() == "r=d"
    for argv, words in (
        (("--service-discovery", "--selector", "app=sglang"), "prefill-selector"),
        (("--service-discovery", "--prefill-selector", "app"), "key=value"),
    ):
        with pytest.raises(SystemExit):  # a usage error, naming what is wrong
            parse(*argv)
        assert words in capsys.readouterr().err
