"""`n` as the router counts it, and the admission cap counting PD requests (issue 26, N2, N3).

N2: on 486b667 an `n` the router did not count (`8.0`, `"8"`, `"1024"`, an `n` inside a list of
per-prompt `sampling_params`) went to the engines as one PD request, which SGLang's pydantic
models read as 8 or 1024 (the extra samples then wait for KV that never comes), past
`--max-batch-size` and the batch-with-`n` 400. Now anything but a JSON integer is a 400, and an
`n` other than 1 in a list of sampling_params is refused as `n` with a batch.

N3: on 486b667 `n > 1` took one admission slot for up to 1,024 PD requests. Now a request of n
samples holds n slots of `--max-concurrent-requests` (the n - 1 more taken at once once its body
is read, or a 429), and an n past the cap is a 400.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import settle

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def starts(cluster: Cluster, rid: str, role: str) -> list[dict[str, Any]]:
    engines = cluster.decodes if role == "decode" else cluster.prefills
    return [e for engine in engines for e in engine.events.find("request_start", rid=rid)]


UNCOUNTED = [
    ("/v1/chat/completions", {**CHAT, "n": 8.0}, "`n` must be an integer, not a number"),
    ("/v1/chat/completions", {**CHAT, "n": "8"}, "`n` must be an integer, not a string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": "1024"}, "not a string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": True}, "not a boolean"),
    ("/v1/chat/completions", {**CHAT, "n": None}, "`n` must be an integer, not null"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 8.0}}, "not a number"),
    ("/generate", {"text": "hi", "sampling_params": {"n": "8"}}, "not a string"),
    (
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"n": 8}, {"n": 8}]},
        "list of sampling_params",
    ),
    (
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": "1024"}]},
        "not a string",
    ),
]


@pytest.mark.parametrize(("path", "body", "says"), UNCOUNTED)
async def test_an_n_the_router_would_not_count_is_refused(
    cluster: Cluster, path: str, body: dict[str, Any], says: str
) -> None:
    rid = f"uncounted-{path}-{body!r}"
    response = await cluster.client.post(path, json=body, headers={"x-request-id": rid})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"], error
    assert not starts(cluster, rid, "prefill") and not starts(cluster, rid, "decode")


async def test_an_integer_n_is_counted_and_a_list_with_n_1_is_a_batch(cluster: Cluster) -> None:
    """The controls: an integer `n` runs n PD requests; `n: 1` in a list of per-prompt
    sampling_params is an ordinary batch (one PD request, scalar-free)."""
    response = await cluster.client.post(
        "/v1/chat/completions", json={**CHAT, "n": 2}, headers={"x-request-id": "counted"}
    )
    assert response.status_code == 200, response.text
    assert len(starts(cluster, "counted", "prefill")) == 2
    assert len(starts(cluster, "counted", "decode")) == 2
    body = {"text": ["a", "b"], "sampling_params": [{"n": 1, "max_new_tokens": 2}] * 2}
    response = await cluster.client.post("/generate", json=body, headers={"x-request-id": "batch"})
    assert response.status_code == 200, response.text
    [start] = starts(cluster, "batch", "decode")
    assert isinstance(start["body"]["bootstrap_room"], list)  # one PD request, a batch of 2


async def test_the_cap_counts_each_sample(nursery: trio.Nursery) -> None:
    """`--max-concurrent-requests 4 --queue-size 0`: an `n` of 5 can never run (400); one of 3
    holds three slots while it runs, so beside it an `n` of 2 is a 429 and a single request
    runs; once it ended, `n` of 4 runs. None of the refused reaches a worker."""
    cluster = await start_cluster(nursery, max_concurrent_requests=4, queue_size=0)
    client = cluster.client

    async def post(rid: str, n: int, **extra: Any) -> int:
        body = {**CHAT, "n": n, **extra}
        response = await client.post(
            "/v1/chat/completions", json=body, headers={"x-request-id": rid}
        )
        return response.status_code

    over = await client.post(
        "/v1/chat/completions", json={**CHAT, "n": 5}, headers={"x-request-id": "over"}
    )
    assert over.status_code == 400, over.text
    assert "--max-concurrent-requests 4" in over.json()["error"]["message"]

    held: dict[str, int] = {}

    async def holder() -> None:
        held["status"] = await post("holder", 3, sim_fault="decode:slow:3000")

    nursery.start_soon(holder)
    await settle(lambda: len(starts(cluster, "holder", "decode")) == 3, LOOSE)  # provoked
    assert cluster.router.admission.limiter is not None
    assert cluster.router.admission.limiter.borrowed_tokens == 3  # three samples, three slots

    pair = await client.post(
        "/v1/chat/completions", json={**CHAT, "n": 2}, headers={"x-request-id": "pair"}
    )
    assert pair.status_code == 429, pair.text
    assert pair.headers["retry-after"] == "1"
    assert "n = 2 samples need 2 request slots" in pair.json()["error"]["message"]
    assert await post("single", 1) == 200  # the fourth slot
    await settle(lambda: "status" in held, LOOSE)
    assert held["status"] == 200
    # Every slot given back: a request's slots are released as the router's side of it ends,
    # which can be just after the client read its answer (make test, 2026-12-05: 3 still held).
    limiter = cluster.router.admission.limiter
    await settle(lambda: limiter.borrowed_tokens == 0, LOOSE)
    assert await post("four", 4) == 200
    assert len(starts(cluster, "four", "decode")) == 4
    for rid in ("over", "pair"):
        assert not starts(cluster, rid, "prefill") and not starts(cluster, rid, "decode")
    await client.aclose()
