"""vLLM workers in the fleet: pairs never mix engines, and a worker's engine survives every way
of registering it (the admin API, the shared membership file, etcd, Kubernetes)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import httpx2
import pytest
import trio

from tests.conftest import ROUTER_DEFAULTS, start_engine, start_router, wait_until_ready
from tests.router.helpers import settle
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import RouterConfig
from trio_pd.membership import etcd, kubernetes, shared_file
from trio_pd.membership.worker_json import spec_from_json
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine.vllm import VllmEngineConfig, VllmEngineHandle, serve_vllm_engine


@pytest.fixture
async def vllm_engines(nursery: trio.Nursery) -> AsyncIterator[list[VllmEngineHandle]]:
    engines = [
        await nursery.start(serve_vllm_engine, VllmEngineConfig(), role)
        for role in ("prefill", "decode")
    ]
    yield engines
    for engine in engines:  # no KV block left held by any test here
        await engine.wait_blocks_free(timeout=5)


async def test_one_router_serves_sglang_and_vllm_pairs_never_mixed(
    nursery: trio.Nursery, vllm_engines: list[VllmEngineHandle]
) -> None:
    s_prefill = await start_engine(nursery, "prefill")
    s_decode = await start_engine(nursery, "decode")
    v_prefill, v_decode = vllm_engines
    config = RouterConfig(
        prefill=(WorkerSpec(s_prefill.url, "prefill", s_prefill.bootstrap_port),
                 WorkerSpec(v_prefill.url, "prefill", engine="vllm")),
        decode=(WorkerSpec(s_decode.url, "decode"),
                WorkerSpec(v_decode.url, "decode", engine="vllm")),
        **{**ROUTER_DEFAULTS, "policy": attrs.evolve(RouterConfig().policy, policy="random")},
    )  # fmt: skip
    _, url = await start_router(nursery, config)
    async with httpx2.AsyncClient(base_url=url, timeout=20) as client:
        await wait_until_ready(client)
        for i in range(12):
            body = {"model": "sim-model", "prompt": f"request {i} of a mixed fleet",
                    "max_tokens": 3}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert "kv_transfer_params" not in response.json()
    v_prefills = v_prefill.events.find("request_start")
    v_decodes = v_decode.events.find("request_start")
    s_prefills = s_prefill.events.find("request_start")
    s_decodes = s_decode.events.find("request_start")
    assert v_prefills and s_prefills  # both pairs served (random over 12 requests)
    assert len(v_prefills) + len(s_prefills) == 12
    # vLLM decodes only ever got a vLLM prefill's handoff; SGLang's only bootstrap fields.
    assert len(v_decodes) == len(v_prefills)
    assert all(d["params"]["remote_engine_id"] == v_prefill.state.engine_id for d in v_decodes)
    assert len(s_decodes) == len(s_prefills)
    assert all("kv_transfer_params" not in d["body"] for d in s_decodes)
    assert all("bootstrap_room" not in d["body"] for d in v_decodes)


async def test_a_vllm_worker_added_by_the_admin_api_pairs_only_with_vllm(
    nursery: trio.Nursery, vllm_engines: list[VllmEngineHandle]
) -> None:
    v_prefill, v_decode = vllm_engines
    s_decode = await start_engine(nursery, "decode")
    config = RouterConfig(
        prefill=(WorkerSpec(v_prefill.url, "prefill", engine="vllm"),),
        decode=(WorkerSpec(s_decode.url, "decode"),),
        **ROUTER_DEFAULTS,
    )
    router, url = await start_router(nursery, config)
    admin = httpx2.AsyncClient(base_url=router.access.admin_url, timeout=20)
    async with httpx2.AsyncClient(base_url=url, timeout=20) as client, admin:
        # Only an SGLang decode: the vLLM prefill has no partner, so nothing is sent anywhere.
        await settle(lambda: all(w.healthy for w in router.fleet.workers()))
        assert len(router.fleet.routable("prefill")) == len(router.fleet.routable("decode")) == 1
        unready = await client.get("/readiness")  # both roles healthy, yet no pair can form
        assert unready.status_code == 503
        assert unready.json()["reason"] == "no prefill and decode of one engine"
        body = {"model": "sim-model", "prompt": "no partner yet", "max_tokens": 2}
        refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert v_prefill.events.find("request_start") == []
        bad = await admin.post("/workers", json={"url": v_decode.url, "worker_type": "decode",
                                                 "engine": "tensorrt"})  # fmt: skip
        assert bad.status_code == 400 and "engine" in bad.json()["error"]["message"]
        added = await admin.post(
            "/workers", json={"url": v_decode.url, "worker_type": "decode", "engine": "vllm"}
        )
        assert added.status_code == 202 and added.json()["engine"] == "vllm"
        await settle(lambda: all(w.healthy for w in router.fleet.workers()))
        assert (await client.get("/readiness")).status_code == 200
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200
    assert len(v_decode.events.find("request_start")) == 1
    assert s_decode.events.find("request_start") == []


def test_the_engine_survives_the_shared_file_and_etcd() -> None:
    spec = WorkerSpec("http://127.0.0.1:8100", "prefill", None, "m", engine="vllm")
    entry = shared_file.spec_json("prefill-1", spec)
    assert entry["engine"] == "vllm"
    (record,) = shared_file.parse_workers({"workers": [entry]})
    assert record.spec == spec
    assert etcd.decode_spec("prefill", etcd.encode_spec(spec)).engine == "vllm"
    sglang = WorkerSpec("http://127.0.0.1:8100", "prefill", 8998)
    assert "engine" not in shared_file.spec_json("prefill-1", sglang)  # as before
    assert etcd.decode_spec("prefill", etcd.encode_spec(sglang)) == sglang
    assert spec_from_json({"url": spec.url, "worker_type": "decode"}).engine == "sglang"


def test_vllm_mode_makes_discovered_pods_vllm() -> None:
    argv = ["serve", "--vllm-pd-disaggregation", "--service-discovery", "--prefill-selector",
            "role=prefill", "--decode-selector", "role=decode", "--kube-api-server",
            "http://127.0.0.1:1"]  # fmt: skip
    config = router_config(build_parser().parse_args(argv))
    assert config.kubernetes is not None and config.kubernetes.engine == "vllm"
    pod = kubernetes.PodView(
        name="p0", namespace="default", uid="u", pod_ip="10.0.0.5",
        labels={"role": "prefill"}, annotations={}, phase="Running", ready=True,
        deleting=False, created="2026-12-01T00:00:00Z", resource_version="1",
    )  # fmt: skip
    (record,) = kubernetes.records_for_pod(pod, config.kubernetes)
    assert record.spec.engine == "vllm"
