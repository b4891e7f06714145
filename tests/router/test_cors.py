"""CORS (`--cors-allowed-origins`, SMG 0.3.2's tower-http layer) over real sockets: preflights the
router answers itself, and the headers on every other answer: success, error and stream."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import generate_body, read_sse
from trio_pd.cli.main import build_parser, router_config
from trio_pd.edge.cors import CorsPolicy
from trio_pd.upstream.headers import relayable_headers
from trio_pd.upstream.http11 import Response

ALLOWED = "https://app.example"
OTHER = "https://evil.example"
VARY = "origin, access-control-request-method, access-control-request-headers"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "x-y"}


def cors_headers(response: httpx2.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def engine_records(cluster: Cluster) -> list[int]:
    return [len(engine.events.records) for engine in (cluster.prefill, cluster.decode)]


async def test_preflights_are_answered_by_the_router_and_reach_no_engine(
    nursery: trio.Nursery,
) -> None:
    # A data-plane key too: a browser's preflight carries no credentials and needs none.
    cluster = await start_cluster(
        nursery, cors_allowed_origins=(ALLOWED, "http://localhost:3000"),
        data_plane_api_keys=("data-key",),
    )  # fmt: skip
    before = engine_records(cluster)
    client = cluster.client
    for path in ("/generate", "/v1/chat/completions", "/workers", "/health"):
        response = await client.options(path, headers={"origin": ALLOWED, **PREFLIGHT})
        assert response.status_code == 200, path
        assert response.content == b""
        assert cors_headers(response) == {
            "access-control-allow-origin": ALLOWED,
            "access-control-allow-methods": "GET,POST,OPTIONS",
            "access-control-allow-headers": "content-type,authorization",
            "access-control-max-age": "3600",
        }
        assert response.headers["vary"] == VARY
        assert response.headers["x-request-id"]
    # An origin not listed (or none) gets the answer without a single CORS grant.
    for headers in ({"origin": OTHER, **PREFLIGHT}, PREFLIGHT):
        response = await client.options("/generate", headers=headers)
        assert response.status_code == 200
        assert cors_headers(response) == {}
        assert response.headers["vary"] == VARY
    # An unknown path stays a 404 (with the grant: it is an answer like any other).
    missing = await client.options("/nope", headers={"origin": ALLOWED, **PREFLIGHT})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert missing.headers["access-control-allow-origin"] == ALLOWED
    assert engine_records(cluster) == before  # no engine heard of any of it
    assert not cluster.decode.events.find("request_start")
    # The preflight let the browser through; the real request still needs the key.
    refused = await client.post("/generate", json=generate_body(), headers={"origin": ALLOWED})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ALLOWED
    await client.aclose()


async def test_allowed_origin_gets_its_grant_on_success_error_and_stream(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, cors_allowed_origins=(ALLOWED,))
    client = cluster.client
    grant = {
        "access-control-allow-origin": ALLOWED,
        "access-control-expose-headers": "x-request-id",
    }
    origin = {"origin": ALLOWED}

    def check(response: httpx2.Response, status: int, expected: dict[str, str]) -> None:
        assert response.status_code == status, response.text
        assert cors_headers(response) == expected
        assert response.headers["vary"] == VARY
        assert response.headers["x-request-id"]

    ok = await client.post("/generate", json=generate_body(), headers=origin)
    check(ok, 200, grant)
    assert cluster.decode.events.find("request_start", rid=ok.headers["x-request-id"])
    check(await client.post("/generate", content=b"{not json", headers=origin), 400, grant)
    failed = generate_body(sim_fault="prefill:500")
    check(await client.post("/generate", json=failed, headers=origin), 502, grant)
    check(await client.get("/generate", headers=origin), 405, grant)
    check(await client.get("/health", headers=origin), 200, grant)
    async with client.stream(
        "POST", "/generate", json=generate_body(stream=True), headers=origin
    ) as stream:
        check(stream, 200, grant)
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(stream)
        assert events[-1] == "[DONE]"
    # Another origin, or none, is served as before but granted nothing.
    for headers in ({"origin": OTHER}, {"origin": ALLOWED.upper()}, {}):
        check(await client.post("/generate", json=generate_body(), headers=headers), 200, {})
    await client.aclose()


async def test_any_origin_by_default(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    client = cluster.client
    any_grant = {"access-control-allow-origin": "*", "access-control-expose-headers": "*"}
    for headers in ({"origin": OTHER}, {}):  # SMG's `Any`: even without an Origin header
        response = await client.post("/generate", json=generate_body(), headers=headers)
        assert response.status_code == 200
        assert cors_headers(response) == any_grant
        assert response.headers["vary"] == VARY
    error = await client.post("/v1/completions", content=b"[]", headers={"origin": OTHER})
    assert error.status_code == 400
    assert cors_headers(error) == any_grant
    preflight = await client.options("/v1/completions", headers={"origin": OTHER, **PREFLIGHT})
    assert preflight.status_code == 200
    assert cors_headers(preflight) == {
        "access-control-allow-origin": "*",
        "access-control-allow-methods": "*",
        "access-control-allow-headers": "*",
        "access-control-max-age": "3600",
    }
    assert not cluster.decode.events.find("request_start", rid=preflight.headers["x-request-id"])
    await client.aclose()


def test_a_workers_own_cors_headers_are_never_relayed() -> None:
    # An engine answering `Allow-Origin: *` must not widen the router's list.
    upstream: Any = Response(
        None,  # type: ignore[arg-type]
        200,
        [
            (b"content-type", b"application/json"),
            (b"access-control-allow-origin", b"*"),
            (b"access-control-allow-credentials", b"true"),
            (b"vary", b"accept-encoding"),
        ],
    )
    assert relayable_headers(upstream) == [
        (b"content-type", b"application/json"),
        (b"vary", b"accept-encoding"),
    ]


def test_policy_matches_origins_byte_for_byte() -> None:
    policy = CorsPolicy.from_origins([ALLOWED])
    granted = dict(policy.response_headers([(b"origin", ALLOWED.encode())]))
    assert granted[b"access-control-allow-origin"] == ALLOWED.encode()
    for origin in (ALLOWED + "/", ALLOWED.upper(), "https://app.example:443"):
        headers = policy.response_headers([(b"origin", origin.encode())])
        assert not any(name.startswith(b"access-control-") for name, _ in headers), origin
    # The first Origin header decides, as tower-http reads it.
    two = [(b"origin", OTHER.encode()), (b"origin", ALLOWED.encode())]
    assert b"access-control-allow-origin" not in dict(policy.response_headers(two))


@pytest.mark.parametrize(
    "origin",
    ["https://app.example/", "app.example", "https://app.example/path", "HTTPS://APP.EXAMPLE",
     "https://App.example", "https://user@app.example", "*", ""],
)  # fmt: skip
def test_an_origin_no_browser_sends_is_a_usage_error(
    origin: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It would grant nothing, silently: refused at start-up, saying why."""
    argv = ["serve", "--cors-allowed-origins", "https://ok.example", origin]
    with pytest.raises(SystemExit) as exited:
        router_config(build_parser().parse_args(argv))
    assert exited.value.code == 2
    assert "--cors-allowed-origins" in capsys.readouterr().err
    ok = ["https://ok.example", "http://127.0.0.1:3000", "https://[::1]:8443"]
    assert router_config(build_parser().parse_args(["serve", "--cors-allowed-origins", *ok]))
