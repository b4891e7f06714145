"""TLS with SGLang's router flag names (issue 10): https workers on the hot path and in health
probes (`--ca-cert-paths`), mutual TLS to workers (`--client-cert-path`, `--client-key-path`),
and serving HTTPS (`--tls-cert-path`, `--tls-key-path`), against the simulator serving TLS with
a throwaway CA."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs
import httpx2
import pytest
import trio
import trustme

from tests.conftest import ROUTER_DEFAULTS, start_engine, start_router
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body, read_sse, settle
from trio_pd.config import RouterConfig
from trio_pd.spec import WorkerSpec


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def files(ca: trustme.CA, tmp_path: Path) -> dict[str, str]:
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trio-pd-router")
    paths = {
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "ca": ca.cert_pem,
    }
    out = {}
    for name, blob in paths.items():
        path = tmp_path / f"{name}.pem"
        blob.write_to_path(path)
        out[name] = str(path)
    return out


async def tls_engines(nursery: trio.Nursery, files: dict[str, str], **extra) -> list:
    tls = {"ssl_certfile": files["server_cert"], "ssl_keyfile": files["server_key"], **extra}
    return [await start_engine(nursery, role, **tls) for role in ("prefill", "decode")]


def config_for(prefill, decode, **options) -> RouterConfig:
    return RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(decode.url, "decode"),),
        **{**ROUTER_DEFAULTS, "health": FAST_HEALTH, **options},
    )


async def test_https_workers_with_a_private_ca(nursery: trio.Nursery, files) -> None:
    prefill, decode = await tls_engines(nursery, files)
    assert prefill.url.startswith("https://")
    router, url = await start_router(
        nursery, config_for(prefill, decode, ca_cert_paths=(files["ca"],))
    )
    async with httpx2.AsyncClient(base_url=url) as client:
        await settle(lambda: all(w.healthy for w in router.fleet.workers()), LOOSE)
        for stream in (False, True):
            body = generate_body(stream=stream, max_new_tokens=3)
            async with client.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                if stream:
                    assert (await read_sse(response))[-1] == "[DONE]"
                else:
                    await response.aread()
        rid = response.headers["x-request-id"]
    assert decode.events.find("request_start", rid=rid)


async def test_a_worker_whose_certificate_does_not_verify(nursery: trio.Nursery, files) -> None:
    """Unhealthy (its probes fail), and a request that reaches it anyway fails with a 502
    saying why: never a healthy-looking worker whose every request fails."""
    prefill, decode = await tls_engines(nursery, files)
    slow_to_judge = attrs.evolve(FAST_HEALTH, failure_threshold=10**6)
    router, url = await start_router(
        nursery, config_for(prefill, decode, health=slow_to_judge)
    )  # the CA is not trusted
    await trio.sleep(FAST_HEALTH.interval_secs * 3)
    assert not any(w.healthy for w in router.fleet.workers())
    for worker in router.fleet.workers():
        worker.healthy = True  # as if its certificate had just been rotated to a bad one
    async with httpx2.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json=generate_body())
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "certificate verify failed" in message and "worker failed" in message
    assert not prefill.events.find("request_start") and not decode.events.find("request_start")


async def test_mutual_tls_to_workers(nursery: trio.Nursery, files) -> None:
    prefill, decode = await tls_engines(nursery, files, ssl_ca_certs=files["ca"])
    bare, _ = await start_router(
        nursery, config_for(prefill, decode, ca_cert_paths=(files["ca"],), port=0)
    )
    router, url = await start_router(
        nursery,
        config_for(
            prefill, decode, ca_cert_paths=(files["ca"],),
            client_cert_path=files["client_cert"], client_key_path=files["client_key"],
        ),
    )  # fmt: skip
    await settle(lambda: all(w.healthy for w in router.fleet.workers()), LOOSE)
    async with httpx2.AsyncClient(base_url=url) as client:
        assert (await client.post("/generate", json=generate_body())).status_code == 200
    # Without a client certificate the workers refuse the router: never healthy.
    assert not any(w.healthy for w in bare.fleet.workers())


async def test_serving_https(nursery: trio.Nursery, files, ca: trustme.CA) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router, url = await start_router(
        nursery,
        config_for(prefill, decode, tls_cert_path=files["server_cert"],
                   tls_key_path=files["server_key"]),
    )  # fmt: skip
    assert url.startswith("https://")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with httpx2.AsyncClient(base_url=url, verify=context) as client:
        await settle(lambda: all(w.healthy for w in router.fleet.workers()), LOOSE)
        response = await client.post("/generate", json=generate_body())
        assert response.status_code == 200
    async with httpx2.AsyncClient(base_url=url.replace("https", "http")) as plain:
        with pytest.raises(httpx2.TransportError):
            await plain.get("/health")
