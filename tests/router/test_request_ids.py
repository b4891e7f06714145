"""Request ids (`--request-id-headers`, SMG 0.3.2's rules) over real sockets: which client header
wins, the id generated when there is none, and what the engines see of it."""

from __future__ import annotations

import re

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import generate_body
from trio_pd.cli.main import build_parser, router_config
from trio_pd.edge.request_ids import RequestIds

ENGINE_RID = re.compile(r"trio-pd-[0-9a-f]{32}")
GENERATED = {
    "/generate": re.compile(r"gnt-[A-Za-z0-9]{24}"),
    "/v1/completions": re.compile(r"cmpl-[A-Za-z0-9]{24}"),
    "/v1/chat/completions": re.compile(r"chatcmpl-[A-Za-z0-9]{24}"),
    "/health": re.compile(r"req-[A-Za-z0-9]{24}"),
}
BODIES = {
    "/generate": generate_body(),
    "/v1/completions": {"model": "sim-model", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
}


def seen_by_engines(cluster: Cluster, request_id: str) -> list[dict]:
    """Each engine's `request_start` for this x-request-id (the engines key events by it)."""
    starts = []
    for engine in (cluster.prefill, cluster.decode):
        found = engine.events.find("request_start", rid=request_id)
        assert len(found) == 1, (engine.role, request_id)
        starts.append(found[0])
    return starts


async def test_default_headers_are_tried_in_smg_order(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, abort_on_cancel=True)  # rids go out with aborts on
    cases = [  # headers sent (in this order) -> the id the router uses
        ({"request-id": "r-4", "x-trace-id": "t-3"}, "t-3"),
        ({"x-trace-id": "t-3", "x-correlation-id": "c-2"}, "c-2"),
        ({"request-id": "r-4", "x-correlation-id": "c-2", "x-request-id": "q-1"}, "q-1"),
        ({"request-id": "r-4"}, "r-4"),
        ({"x-request-id": "", "x-trace-id": "t-5"}, "t-5"),  # an empty value does not count
        ({"x-request-id": "caf\u00e9", "request-id": "r-6"}, "r-6"),  # nor non-ASCII (SMG)
    ]
    for headers, expected in cases:
        encoded = [(k.encode(), v.encode("utf-8")) for k, v in headers.items()]
        response = await cluster.client.post("/generate", json=generate_body(), headers=encoded)
        assert response.status_code == 200
        assert response.headers["x-request-id"] == expected
        for start in seen_by_engines(cluster, expected):
            assert start["headers"]["x-request-id"] == expected
            # The attempt's SGLang rid is the router's own, not made of the request id.
            assert ENGINE_RID.fullmatch(start["sglang_rid"])
    await cluster.client.aclose()


async def test_a_custom_header_list_replaces_the_defaults(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, abort_on_cancel=True, request_id_headers=("X-Amzn-Trace-Id", "x-my-id")
    )
    both = {"x-my-id": "mine-2", "x-amzn-trace-id": "amzn-1", "x-request-id": "ignored"}
    response = await cluster.client.post("/generate", json=generate_body(), headers=both)
    assert response.headers["x-request-id"] == "amzn-1"  # the list's order, case-insensitive
    for start in seen_by_engines(cluster, "amzn-1"):
        assert start["headers"]["x-request-id"] == "amzn-1"
        assert ENGINE_RID.fullmatch(start["sglang_rid"])
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"x-my-id": "mine-3"}
    )
    assert response.headers["x-request-id"] == "mine-3"
    # A header no longer listed gives nothing: the router makes an id of its own.
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"x-request-id": "not-listed"}
    )
    assert GENERATED["/generate"].fullmatch(response.headers["x-request-id"])
    assert not cluster.decode.events.find("request_start", rid="not-listed")
    await cluster.client.aclose()


async def test_without_a_client_id_the_router_makes_one_and_the_engines_see_it(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, abort_on_cancel=True)
    ids = set()
    for path, body in BODIES.items():
        response = await cluster.client.post(path, json=body)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        assert GENERATED[path].fullmatch(request_id), request_id
        ids.add(request_id)
        for start in seen_by_engines(cluster, request_id):
            assert start["headers"]["x-request-id"] == request_id
            assert ENGINE_RID.fullmatch(start["sglang_rid"])
    health = await cluster.client.get("/health")
    assert GENERATED["/health"].fullmatch(health.headers["x-request-id"])
    # Errors carry one too, and every id is new.
    error = await cluster.client.post("/generate", content=b"not json")
    assert error.status_code == 400
    assert GENERATED["/generate"].fullmatch(error.headers["x-request-id"])
    ids |= {health.headers["x-request-id"], error.headers["x-request-id"]}
    assert len(ids) == len(BODIES) + 2
    await cluster.client.aclose()


async def test_the_flag_with_no_header_never_takes_the_clients(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, request_id_headers=())
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"x-request-id": "client-id"}
    )
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    assert GENERATED["/generate"].fullmatch(request_id)
    assert seen_by_engines(cluster, request_id)
    await cluster.client.aclose()


async def test_request_id_prefixed_headers_reach_the_workers(nursery: trio.Nursery) -> None:
    # SMG forwards `x-request-id-*` with the tracing headers; other headers stay behind.
    cluster = await start_cluster(nursery)
    headers = {"x-request-id": "q-1", "x-request-id-user": "u-7", "x-unrelated": "no"}
    response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
    assert response.status_code == 200
    for start in seen_by_engines(cluster, "q-1"):
        assert start["headers"]["x-request-id-user"] == "u-7"
        assert "x-unrelated" not in start["headers"]
    await cluster.client.aclose()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"request-id", b"r"), (b"x-request-id", b"q")], b"q"),
        ([(b"x-trace-id", b"\x80bad"), (b"x-trace-id", b"second"), (b"request-id", b"r")], b"r"),
        ([(b"x-trace-id", b"t\tab")], b"t\tab"),  # tab is allowed (http's HeaderValue::to_str)
        ([(b"x-other", b"o")], None),
    ],
)
def test_incoming_follows_smg(headers: list[tuple[bytes, bytes]], expected: bytes | None) -> None:
    # A header's first value decides (SMG's `HeaderMap::get`): a bad first value is skipped
    # with its header, even when a good second value follows.
    assert RequestIds().incoming(headers) == expected


def test_generated_ids_are_unique_per_process() -> None:
    one, two = RequestIds(), RequestIds()
    assert one.new("/generate") != two.new("/generate")  # another process, another prefix
    assert len({one.new("/x") for _ in range(1000)}) == 1000


async def test_client_gets_the_id_on_a_stream_too(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    body = generate_body(stream=True)
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        await response.aread()
    assert GENERATED["/generate"].fullmatch(request_id)
    assert seen_by_engines(cluster, request_id)
    await cluster.client.aclose()


@pytest.mark.parametrize("name", ["x-id-€", "x id", "x-id:", ""])
def test_a_header_name_that_is_no_token_is_a_usage_error(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused at start-up (an invalid name would fail every process at its start, and with
    --workers N restart them forever)."""
    with pytest.raises(SystemExit) as exited:
        router_config(build_parser().parse_args(["serve", "--request-id-headers", name]))
    assert exited.value.code == 2
    assert "--request-id-headers" in capsys.readouterr().err
