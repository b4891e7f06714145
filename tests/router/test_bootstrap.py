"""Bootstrap injection on the wire (docs/protocol.md §2): batch shapes, fresh rooms, passthrough."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Cluster

BATCH_SHAPES: list[tuple[str, dict[str, Any], int | None]] = [
    ("/generate", {"text": "one prompt"}, None),
    ("/generate", {"input_ids": [1, 2, 3]}, None),
    ("/generate", {"text": ["first prompt", "second prompt", "third"]}, 3),
    ("/generate", {"input_ids": [[1, 2], [3, 4, 5]]}, 2),
    ("/v1/completions", {"prompt": "one prompt", "max_tokens": 3}, None),
    ("/v1/completions", {"prompt": ["a b", "c d", "e f", "g"], "max_tokens": 3}, 4),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 3}, 2),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        None,
    ),
]  # chat `n > 1` is not a batch on PD engines: tests/router/test_samples.py


@pytest.mark.parametrize(("path", "body", "n"), BATCH_SHAPES)
async def test_batch_shapes_get_matching_bootstrap_fields(
    cluster: Cluster, path: str, body: dict[str, Any], n: int | None
) -> None:
    response = await cluster.client.post(path, json=body)
    assert response.status_code == 200, response.text
    rid = response.headers["x-request-id"]
    seen = cluster.decode.events.find("request_start", rid=rid)[0]["body"]
    assert seen == cluster.prefill.events.find("request_start", rid=rid)[0]["body"]
    host = cluster.prefill.url.split("//")[1].rsplit(":", 1)[0]
    if n is None:
        assert seen["bootstrap_host"] == host
        assert seen["bootstrap_port"] == cluster.prefill.bootstrap_port
        assert isinstance(seen["bootstrap_room"], int)
        assert 1 <= seen["bootstrap_room"] < 2**63  # room 0 is the decode's "not yet" sentinel
    else:
        assert seen["bootstrap_host"] == [host] * n
        assert seen["bootstrap_port"] == [cluster.prefill.bootstrap_port] * n
        rooms = seen["bootstrap_room"]
        assert len(rooms) == n
        assert len(set(rooms)) == n
    answer = response.json()
    if path == "/generate" and n is not None:
        assert isinstance(answer, list)
        assert len(answer) == n


async def test_other_fields_pass_through_untouched(cluster: Cluster) -> None:
    body = {
        "text": "keep everything",
        "sampling_params": {"max_new_tokens": 2, "custom_knob": [1, {"x": None}]},
        "max_tokens": 7,
        "unknown_field": {"nested": "\u00e9\u4e2d"},
        "lora_path": "adapter-3",
        "bootstrap_room": 5,  # client values are overwritten: duplicate rooms crash engines
        "bootstrap_host": "evil.example",
    }
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    seen = cluster.decode.events.find("request_start", rid=rid)[0]["body"]
    for key in ("text", "sampling_params", "max_tokens", "unknown_field", "lora_path"):
        assert seen[key] == body[key]
    assert seen["bootstrap_room"] != 5
    assert seen["bootstrap_host"] == "127.0.0.1"


async def test_every_request_gets_a_fresh_room(cluster: Cluster) -> None:
    rooms = set()
    for _ in range(5):
        response = await cluster.client.post("/generate", json={"text": "same prompt"})
        rid = response.headers["x-request-id"]
        rooms.add(cluster.decode.events.find("request_start", rid=rid)[0]["body"]["bootstrap_room"])
    assert len(rooms) == 5


async def test_headers_are_forwarded_and_request_id_echoed(cluster: Cluster) -> None:
    headers = {
        "authorization": "Bearer secret-token",
        "x-request-id": "rid-abc",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1",
        "x-private": "must not leak upstream",
    }
    response = await cluster.client.post("/generate", json={"text": "hi"}, headers=headers)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "rid-abc"
    for engine in (cluster.prefill, cluster.decode):
        seen = engine.events.find("request_start", rid="rid-abc")[0]["headers"]
        assert seen["authorization"] == "Bearer secret-token"
        assert seen["traceparent"] == headers["traceparent"]
        assert seen["tracestate"] == "vendor=1"
        assert seen["content-type"] == "application/json"
        assert "x-private" not in seen
