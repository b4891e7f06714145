"""Bad client input gets a clear JSON error and reaches no worker (docs/protocol.md §7)."""

from __future__ import annotations

import pytest

from tests.conftest import Cluster, start_cluster


def assert_envelope(response, status: int, error_type: str) -> None:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["message"]
    assert "code" in error


def no_engine_saw_a_request(cluster: Cluster) -> bool:
    return not cluster.prefill.events.find("request_start") and not cluster.decode.events.find(
        "request_start"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"text"', "JSON object"),
        (b"null", "JSON object"),
    ],
)
async def test_invalid_body_is_400(cluster: Cluster, content: bytes, message: str) -> None:
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        response = await cluster.client.post(path, content=content)
        assert_envelope(response, 400, "invalid_request_error")
        assert message in response.json()["error"]["message"]
    assert no_engine_saw_a_request(cluster)


async def test_body_over_limit_is_413(nursery) -> None:
    cluster = await start_cluster(nursery, max_payload_size=1000)
    big = b'{"text": "' + b"x" * 2000 + b'"}'
    response = await cluster.client.post("/generate", content=big)
    assert_envelope(response, 413, "payload_too_large")

    async def chunked():  # no content-length: the limit holds while reading
        for _ in range(10):
            yield b" " * 200
        yield b"{}"

    response = await cluster.client.post("/generate", content=chunked())
    assert_envelope(response, 413, "payload_too_large")
    ok = await cluster.client.post("/generate", json={"text": "small enough"})
    assert ok.status_code == 200
    assert len(cluster.decode.events.find("request_start")) == 1
    await cluster.client.aclose()


async def test_unknown_path_is_404(cluster: Cluster) -> None:
    response = await cluster.client.post("/v1/embeddings", json={"input": "x"})
    assert_envelope(response, 404, "not_found_error")
    assert no_engine_saw_a_request(cluster)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_wrong_method_is_405(cluster: Cluster, method: str) -> None:
    response = await cluster.client.request(method, "/generate")
    assert_envelope(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST, OPTIONS"
    assert no_engine_saw_a_request(cluster)


async def test_request_id_is_taken_from_the_client(cluster: Cluster) -> None:
    response = await cluster.client.post(
        "/generate", content=b"[]", headers={"x-correlation-id": "corr-7"}
    )
    assert response.headers["x-request-id"] == "corr-7"
    response = await cluster.client.get("/nope", headers={"x-request-id": "rid-9"})
    assert response.headers["x-request-id"] == "rid-9"
