"""HTTPS on the engines' HTTP port (--ssl-certfile, --ssl-keyfile), mutual TLS (--ssl-ca-certs)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx2
import pytest
import trustme

from trio_pd_testing.engine import EngineConfig

from .helpers import new_room, pd_body, pd_post, start_engine

# A refused TLS client sees the handshake fail, or (TLS 1.3: the server checks the client
# certificate after the client finished) the connection end at the first read.
REFUSED = (httpx2.ConnectError, httpx2.ReadError, httpx2.RemoteProtocolError)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> dict[str, str]:
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {
        "ssl_certfile": tmp_path / "cert.pem",
        "ssl_keyfile": tmp_path / "key.pem",
        "ca": tmp_path / "ca.pem",
    }
    server.cert_chain_pems[0].write_to_path(files["ssl_certfile"])
    server.private_key_pem.write_to_path(files["ssl_keyfile"])
    ca.cert_pem.write_to_path(files["ca"])
    return {name: str(path) for name, path in files.items()}


def client_context(ca: trustme.CA | None, client_cert: trustme.LeafCert | None = None):
    context = ssl.create_default_context()
    if ca is not None:
        ca.configure_trust(context)
    if client_cert is not None:
        client_cert.configure_cert(context)
    return context


async def test_pd_request_over_https(nursery, ca, tls_files):
    tls = {"ssl_certfile": tls_files["ssl_certfile"], "ssl_keyfile": tls_files["ssl_keyfile"]}
    prefill = await start_engine(nursery, "prefill", **tls)
    decode = await start_engine(nursery, "decode", **tls)
    assert prefill.url.startswith("https://") and decode.url.startswith("https://")
    room = new_room()
    body = pd_body(prefill, room, text="a b", sampling_params={"max_new_tokens": 2})
    async with httpx2.AsyncClient(verify=client_context(ca), trust_env=False) as client:
        p, d = await pd_post(client, prefill, decode, "/generate", body)
        assert p.status_code == d.status_code == 200
        assert d.json()["text"] == "tok1 tok2"
        lonely = {**pd_body(prefill, new_room(), text="a"), "stream": True}
        async with client.stream("POST", decode.url + "/generate", json=lonely) as response:
            assert response.status_code == 200  # no prefill, no KV: but the SSE headers come
    assert decode.events.find("kv_ready", room=room)  # the bootstrap rendezvous stayed HTTP
    async with httpx2.AsyncClient(verify=client_context(None), trust_env=False) as untrusting:
        with pytest.raises(httpx2.ConnectError):
            await untrusting.get(decode.url + "/health")
    async with httpx2.AsyncClient(trust_env=False) as plain:
        with pytest.raises(httpx2.TransportError):
            await plain.get(decode.url.replace("https://", "http://") + "/health")
    # the engine outlived the failed handshakes
    async with httpx2.AsyncClient(verify=client_context(ca), trust_env=False) as client:
        assert (await client.get(decode.url + "/health")).status_code == 200


async def test_mutual_tls_requires_a_client_certificate(nursery, ca, tls_files):
    decode = await start_engine(
        nursery,
        "decode",
        ssl_certfile=tls_files["ssl_certfile"],
        ssl_keyfile=tls_files["ssl_keyfile"],
        ssl_ca_certs=tls_files["ca"],
    )
    async with httpx2.AsyncClient(verify=client_context(ca), trust_env=False) as anonymous:
        with pytest.raises(REFUSED):
            await anonymous.get(decode.url + "/health")
    stranger = trustme.CA().issue_cert("router@example.com")  # signed by another CA
    context = client_context(ca, stranger)
    async with httpx2.AsyncClient(verify=context, trust_env=False) as client:
        with pytest.raises(REFUSED):
            await client.get(decode.url + "/health")
    context = client_context(ca, ca.issue_cert("router@example.com"))
    async with httpx2.AsyncClient(verify=context, trust_env=False) as client:
        assert (await client.get(decode.url + "/health")).status_code == 200
        info = (await client.get(decode.url + "/server_info")).json()
        assert info["disaggregation_mode"] == "decode"


def test_tls_config_needs_a_certificate():
    with pytest.raises(ValueError):
        EngineConfig(role="decode", ssl_ca_certs="ca.pem")
    assert EngineConfig(role="decode", ssl_certfile="c.pem").scheme == "https"
