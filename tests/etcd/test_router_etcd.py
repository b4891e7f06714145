"""A router (in this process) whose membership store is a real etcd: the admin API's answers,
`/health` and the metrics while etcd is down, the flags.

The replica tests with real `trio-pd serve` processes are in `test_replicas.py`.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from tests.conftest import Cluster, cluster_of, start_engine
from tests.etcd.conftest import EtcdServer
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import EtcdConfig
from trio_pd.membership.etcd import EtcdMembership
from trio_pd.serve.supervisor import per_process

OUTAGE_SECS = 15.0  # noticing an outage or a restart (the watch's retry backoff tops at 5 s)


async def health(client: httpx2.AsyncClient) -> tuple[int, dict[str, Any]]:
    """Readiness: its status, and what it says of membership (the worker counts aside)."""
    response = await client.get("/readiness")
    body = response.json()
    return response.status_code, {
        k: body[k] for k in ("status", "degraded", "membership") if k in body
    }


async def wait_health(client: httpx2.AsyncClient, etcd_state: str, timeout: float) -> dict:
    with trio.fail_after(timeout):
        while True:
            code, body = await health(client)
            if body.get("membership", {}).get("etcd") == etcd_state:
                return {"code": code, **body}
            await trio.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the Prometheus text, None when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def etcd_cluster(nursery: trio.Nursery, etcd_server: EtcdServer) -> tuple[Cluster, Any]:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    extra = await start_engine(nursery, "decode")
    config = EtcdConfig(endpoints=etcd_server.url, prefix=f"/t-{uuid.uuid4().hex[:8]}")
    cluster = await cluster_of(nursery, [prefill], [decode], etcd=config)
    return cluster, extra


async def test_admin_api_writes_through_etcd_and_maps_its_answers(
    nursery: trio.Nursery, etcd_server: EtcdServer
) -> None:
    cluster, extra = await etcd_cluster(nursery, etcd_server)
    client, admin = cluster.client, cluster.admin  # no keys: changes on the admin listener
    assert isinstance(cluster.router.store, EtcdMembership)
    assert cluster.router.sources == (cluster.router.store,)
    code, body = await health(client)
    assert (code, body) == (200, {"status": "ready", "membership": {"etcd": "up"}})

    added = await admin.post("/workers", json={"url": extra.url, "worker_type": "decode"})
    assert added.status_code == 202, added.text
    worker = added.json()
    assert worker["id"] == "etcd-decode-1"
    assert worker["source"] == "etcd"
    assert worker["meta"]["etcd_key"].endswith("/workers/decode/etcd-decode-1")
    listed = {w["id"]: w["source"] for w in (await client.get("/workers")).json()["workers"]}
    assert listed == {"prefill-1": "static", "decode-1": "static", "etcd-decode-1": "etcd"}

    # Conflicts: the same URL again (etcd's worker, or a static one), a static worker's removal.
    again = await admin.post("/workers", json={"url": extra.url, "worker_type": "decode"})
    assert again.status_code == 409 and "etcd-decode-1" in again.json()["error"]["message"]
    static_url = cluster.decode.url
    taken = await admin.post("/workers", json={"url": static_url, "worker_type": "decode"})
    assert taken.status_code == 409 and "decode-1" in taken.json()["error"]["message"]
    refused = await admin.delete("/workers/decode-1")
    assert refused.status_code == 409 and "static" in refused.json()["error"]["message"]
    # A per-worker key would be readable by anyone reading etcd: 400, nothing stored.
    keyed = {"url": "http://127.0.0.1:9", "worker_type": "decode", "api_key": "k"}
    unstorable = await admin.post("/workers", json=keyed)
    assert unstorable.status_code == 400 and "api_key" in unstorable.json()["error"]["message"]

    text = (await client.get("/metrics")).text
    assert metric(text, "trio_pd_membership_workers", source="etcd", role="decode") == 1
    assert metric(text, "trio_pd_membership_workers", source="static", role="decode") == 1
    assert metric(text, "trio_pd_worker_info", worker="etcd-decode-1", source="etcd") == 1
    assert metric(text, "trio_pd_membership_source_up", source="etcd") == 1

    # etcd goes away: the replica keeps its workers and keeps routing; readiness says degraded;
    # changes are refused with 503; the errors are counted.
    await trio.to_thread.run_sync(etcd_server.stop)
    assert not etcd_server.running
    down = await wait_health(client, "down", OUTAGE_SECS)
    assert down == {
        "code": 200,
        "status": "ready",
        "degraded": True,
        "membership": {"etcd": "down"},
    }
    ids = [w["id"] for w in (await client.get("/workers")).json()["workers"]]
    assert ids == ["prefill-1", "decode-1", "etcd-decode-1"]
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    served_before = len(extra.events.find("request_start"))
    for _ in range(4):  # round robin over both decodes: the etcd worker serves during the outage
        assert (await client.post("/generate", json=body)).status_code == 200
    assert len(extra.events.find("request_start")) > served_before
    other = await admin.post(
        "/workers", json={"url": "http://127.0.0.1:9", "worker_type": "decode"}
    )
    assert other.status_code == 503, other.text
    assert other.json()["error"]["type"] == "service_unavailable"
    gone = await admin.delete("/workers/etcd-decode-1")
    assert gone.status_code == 503
    text = (await client.get("/metrics")).text
    assert metric(text, "trio_pd_membership_source_up", source="etcd") == 0
    assert (metric(text, "trio_pd_membership_errors_total", source="etcd", kind="unavailable")
            or 0) >= 1  # fmt: skip

    # Back: watching resumes, the store takes writes again.
    await trio.to_thread.run_sync(etcd_server.start)
    up = await wait_health(client, "up", OUTAGE_SECS)
    assert up == {"code": 200, "status": "ready", "membership": {"etcd": "up"}}
    removed = await admin.delete("/workers/etcd-decode-1")
    assert removed.status_code == 202 and removed.json()["removed"] is True
    ids = [w["id"] for w in (await client.get("/workers")).json()["workers"]]
    assert ids == ["prefill-1", "decode-1"]
    await cluster.client.aclose()


async def test_unreachable_etcd_at_startup_does_not_hold_the_router(nursery: trio.Nursery) -> None:
    """etcd down from the start: the flags' workers serve, readiness says etcd is down."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    config = EtcdConfig(endpoints="http://127.0.0.1:9", dial_timeout_secs=0.5)
    with trio.fail_after(10):
        cluster = await cluster_of(nursery, [prefill], [decode], etcd=config)
    code, body = await health(cluster.client)
    assert (code, body) == (
        200,
        {"status": "ready", "degraded": True, "membership": {"etcd": "down"}},
    )
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert (await cluster.client.post("/generate", json=body)).status_code == 200
    await cluster.client.aclose()


def test_etcd_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--etcd-endpoints", "http://10.0.0.1:2379,http://10.0.0.2:2379",
         "--etcd-prefix", "/pd-a/", "--etcd-lease-ttl-secs", "10"]
    )  # fmt: skip
    config = router_config(args)
    assert config.etcd is not None
    assert config.etcd.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert config.etcd.prefix == "/pd-a"
    assert config.etcd.lease_ttl_secs == 10
    assert router_config(build_parser().parse_args(["serve"])).etcd is None
    # --workers N with etcd: every process watches etcd, no membership file.
    assert per_process(config, 2, Path("/tmp/x")).membership_file is None
    assert per_process(router_config(build_parser().parse_args(["serve"])), 2,
                       Path("/tmp/x")).membership_file  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--etcd-endpoints", "ftp://x"], "http(s) URL"),
        (["--etcd-endpoints", "http://x", "--etcd-lease-ttl-secs", "-1"], "lease_ttl_secs"),
        (["--etcd-endpoints", "http://x", "--membership-file", "m.json"], "pick one"),
    ],
)
def test_bad_etcd_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        router_config(build_parser().parse_args(["serve", *argv]))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
