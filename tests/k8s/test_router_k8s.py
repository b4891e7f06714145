"""A router (in this process) with Kubernetes discovery beside the flags' workers and the admin
API: who owns what, readiness and metrics while the API server is away, the flags.

The lifecycle tests through a real `trio-pd serve` are in `test_serve_discovery.py`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import cluster_of, start_engine
from tests.k8s.engine_pods import (
    DECODE,
    PREFILL,
    ready_engine_pod,
    served_through,
    untouched,
    workers,
)
from tests.k8s.fake_apiserver import serve_fake_apiserver
from tests.router.helpers import eventually
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import KubernetesConfig
from trio_pd.membership.kubernetes import KubernetesDiscovery
from trio_pd.membership.memory import MemoryStore

PROPAGATION_SECS = 10.0  # a hang guard: a watch delivers in milliseconds, and the fallback it would
# hide is the 30 s resync; the 1 s figure of the design is not asserted (a busy machine breaks it)
OUTAGE_SECS = 10.0
DISCOVERY = ["--service-discovery", "--decode-selector", "r=d"]


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def membership_state(client: httpx2.AsyncClient) -> tuple[int, dict]:
    """Readiness: its status, and what it says of membership (the worker counts aside)."""
    response = await client.get("/readiness")
    body = response.json()
    return response.status_code, {
        k: body[k] for k in ("status", "degraded", "membership") if k in body
    }


async def test_discovered_static_and_admin_workers_side_by_side(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake = await nursery.start(functools.partial(serve_fake_apiserver, bookmark_interval=0.3))
    token_file = tmp_path / "token"
    token_file.write_text(fake.token)
    prefill = await start_engine(nursery, "prefill")
    pod_decode = await start_engine(nursery, "decode")
    flag_decode = await start_engine(nursery, "decode")
    admin_decode = await start_engine(nursery, "decode")
    ready_engine_pod(fake, "p0", prefill)
    ready_engine_pod(fake, "d0", pod_decode)
    config = KubernetesConfig(
        prefill_selector=PREFILL,
        decode_selector=DECODE,
        namespace="default",
        api_server=fake.url,
        token_file=str(token_file),
        backoff_initial_secs=0.05,
        backoff_max_secs=0.5,
    )
    cluster = await cluster_of(nursery, [], [flag_decode], kubernetes=config)
    client = cluster.client
    router = cluster.router
    assert isinstance(router.store, MemoryStore)  # Kubernetes is read-only: admin adds go here
    assert [type(s) for s in router.sources] == [KubernetesDiscovery]

    found = await workers(client)
    assert {wid: w["source"] for wid, w in found.items()} == {
        "decode-1": "static",
        "prefill-p0": "kubernetes",
        "decode-d0": "kubernetes",
    }
    uid = fake.pod("d0")["metadata"]["uid"]
    assert found["decode-d0"]["meta"] == {
        "pod": "d0", "namespace": "default", "uid": uid, "ip": "127.0.0.1"
    }  # fmt: skip
    assert found["decode-d0"]["url"] == pod_decode.url
    assert found["prefill-p0"]["bootstrap_port"] == prefill.bootstrap_port
    assert await membership_state(client) == (
        200, {"status": "ready", "membership": {"kubernetes": "up"}}
    )  # fmt: skip

    # A pod's worker belongs to Kubernetes: the admin API cannot remove it, nor register its URL.
    admin = cluster.admin  # no keys: changes go through the admin listener
    refused = await admin.delete("/workers/decode-d0")
    assert refused.status_code == 409 and "kubernetes" in refused.json()["error"]["message"]
    taken = await admin.post("/workers", json={"url": pod_decode.url, "worker_type": "decode"})
    assert taken.status_code == 409 and "decode-d0" in taken.json()["error"]["message"]
    added = await admin.post("/workers", json={"url": admin_decode.url, "worker_type": "decode"})
    assert added.status_code == 202 and added.json()["source"] == "admin"
    admin_id = added.json()["id"]

    text = (await client.get("/metrics")).text
    for source in ("kubernetes", "static", "admin"):
        assert metric(text, "trio_pd_membership_workers", source=source, role="decode") == 1
    assert metric(text, "trio_pd_worker_info", worker="decode-d0", source="kubernetes") == 1
    assert metric(text, "trio_pd_membership_source_up", source="kubernetes") == 1

    # The API server goes away: every worker stays and serves; readiness says degraded.
    fake.set_unavailable(True)

    async def kubernetes_is(state: str) -> bool:
        return (await membership_state(client))[1].get("membership") == {"kubernetes": state}

    await eventually(lambda: kubernetes_is("down"), OUTAGE_SECS, "API server seen down")
    code, body = await membership_state(client)
    assert (code, body["status"], body["degraded"]) == (200, "ready", True)
    assert set(await workers(client)) == {"decode-1", "prefill-p0", "decode-d0", admin_id}
    await eventually(lambda: served_through(client, pod_decode), 5.0, "the pod's worker serves")
    text = (await client.get("/metrics")).text
    assert metric(text, "trio_pd_membership_source_up", source="kubernetes") == 0
    errors = metric(
        text, "trio_pd_membership_errors_total", source="kubernetes", kind="unreachable"
    )
    assert errors is not None and errors >= 1

    # Back: watching resumes, and a change made after it arrives.
    fake.set_unavailable(False)
    await eventually(lambda: kubernetes_is("up"), OUTAGE_SECS, "API server seen back")
    fake.force_delete_pod("d0")

    async def d0_gone() -> bool:
        return "decode-d0" not in await workers(client)

    await eventually(d0_gone, PROPAGATION_SECS, "the force-deleted pod's worker leaves")
    await untouched(client, [pod_decode], 4)
    await cluster.client.aclose()


def test_service_discovery_flags_are_smgs() -> None:
    args = build_parser().parse_args(
        ["serve", "--service-discovery", "--selector", "app=sglang",
         "--prefill-selector", "role=prefill", "--decode-selector", "role=decode", "tier=a",
         "--service-discovery-port", "30000", "--service-discovery-namespace", "llm",
         "--bootstrap-port-annotation", "example.com/boot",
         "--kube-api-server", "https://10.0.0.1:6443"]
    )  # fmt: skip
    config = router_config(args).kubernetes
    assert config is not None
    assert config.selector == {"app": "sglang"}
    assert config.prefill_selector == {"role": "prefill"}
    assert config.decode_selector == {"role": "decode", "tier": "a"}
    assert (config.port, config.namespace) == (30000, "llm")
    assert config.bootstrap_port_annotation == "example.com/boot"
    assert config.api_server == "https://10.0.0.1:6443"
    assert router_config(build_parser().parse_args(["serve"])).kubernetes is None
    argv = ["serve", "--service-discovery", "--decode-selector", "r=d", "--kube-api-server", "x"]
    defaults = router_config(build_parser().parse_args(argv)).kubernetes
    assert defaults is not None
    assert (defaults.port, defaults.namespace) == (80, None)
    assert defaults.bootstrap_port_annotation == "sglang.ai/bootstrap-port"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--service-discovery", "--kube-api-server", "http://x:1"], "--prefill-selector"),
        (["--service-discovery", "--decode-selector", "oops"], "key=value"),
        # Outside a cluster (no KUBERNETES_SERVICE_HOST) without --kube-api-server.
        (DISCOVERY, "--kube-api-server"),
        ([*DISCOVERY, "--kube-api-server", "https://x:1", "--kube-ca-file", "/no/ca.crt"], "CA"),
    ],
)
def test_bad_service_discovery_flags_are_usage_errors(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        router_config(build_parser().parse_args(["serve", *argv]))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
