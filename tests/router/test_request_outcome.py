"""The access line is the request's outcome (`respond.RequestOutcome`), over the wire.

A real router on real sockets in front of simulator engines, `--access-log` on, two engines of
each role (round robin) so a line naming the wrong worker names another that exists. Which
worker served a request is read off the engines (the request id and the engine rid each one
received), never off the router; the line is then compared with it, its fields in the order
operators parse (method, path, status, ms, bytes, client_rid, model, prefill, decode, attempts,
migrations, samples, inband_status, each only when known) and its text `key=value` form.
Where tracing is on, the request's span is checked against the same line: both read one value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import leave_when, read_sse, settle
from trio_pd.config import RouterConfig
from trio_pd.observe.logs import RequestIdFilter
from trio_pd.respond import RequestOutcome, Responder

ORDER = (
    "method", "path", "status", "ms", "bytes", "client_rid", "model", "prefill", "decode",
    "attempts", "migrations", "samples", "inband_status",
)  # fmt: skip
LOOSE = 10.0
CHAT = {"messages": [{"role": "user", "content": "two"}], "max_tokens": 3, "sim_tag": True}


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.addFilter(RequestIdFilter())  # the request's id on its record, as in the logs
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept() -> Iterator[Kept]:
    """The access lines written while the test runs."""
    handler = Kept()
    logger = logging.getLogger("trio_pd.access")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def access_line(kept: Kept, rid: str) -> dict[str, Any]:
    """The one access line of request `rid` (written just after the client has its answer),
    checked for its order and its text form."""

    def mine() -> list[logging.LogRecord]:
        return [r for r in kept.records if getattr(r, "request_id", None) == rid]

    await settle(lambda: len(mine()) > 0)
    [record] = mine()
    fields: dict[str, Any] = getattr(record, "access")  # noqa: B009 - set by `log_access`
    assert list(fields) == [key for key in ORDER if key in fields], fields
    assert record.getMessage() == " ".join(f"{k}={v}" for k, v in fields.items())
    return fields


def worker_id(cluster: Cluster, engine: Any) -> str:
    [worker] = [w for w in cluster.router.fleet.workers(engine.role) if w.url == engine.url]
    return worker.id


def served(cluster: Cluster, engines: list[Any], rid: str, **fields: Any) -> list[str]:
    """The ids of the workers among `engines` whose engine received a request of `rid`."""
    return [
        worker_id(cluster, e) for e in engines if e.events.find("request_start", rid=rid, **fields)
    ]


async def test_success_names_the_pair_that_answered(nursery: trio.Nursery, kept: Kept) -> None:
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, access_log=True)
    for n in range(3):  # round robin: the pairs differ from one request to the next
        rid = f"ok-{n}"
        response = await cluster.client.post(
            "/generate",
            json={"text": "a b c", "rid": "mine", "sampling_params": {"max_new_tokens": 3}},
            headers={"x-request-id": rid},
        )
        assert response.status_code == 200
        [prefill] = served(cluster, cluster.prefills, rid)
        [decode] = served(cluster, cluster.decodes, rid)
        line = await access_line(kept, rid)
        assert line.pop("ms") >= 0
        assert line == {
            "method": "POST", "path": "/generate", "status": 200,
            "bytes": len(response.content), "client_rid": "mine", "model": "-",
            "prefill": prefill, "decode": decode, "attempts": 1,
        }  # fmt: skip


async def test_a_failed_prefill_names_its_pair_and_the_status_sent(
    nursery: trio.Nursery, kept: Kept
) -> None:
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, access_log=True)
    rid = "prefill-500"
    response = await cluster.client.post(
        "/generate",
        json={"text": "a b c", "sim_fault": "prefill:500"},
        headers={"x-request-id": rid},
    )
    assert response.status_code == 502
    [prefill] = served(cluster, cluster.prefills, rid)
    [decode] = served(cluster, cluster.decodes, rid)
    [engine] = [e for e in cluster.prefills if worker_id(cluster, e) == prefill]
    assert engine.events.find("fault", rid=rid)  # provoked: that prefill failed it
    line = await access_line(kept, rid)
    assert (line["status"], line["bytes"]) == (502, len(response.content))
    assert (line["prefill"], line["decode"], line["attempts"]) == (prefill, decode, 1)
    assert "inband_status" not in line and "migrations" not in line


async def test_a_migrated_stream_names_the_pair_that_finished_it(
    nursery: trio.Nursery, kept: Kept
) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=2, n_decode=2, migration_limit=2, access_log=True
    )
    rid = "migrated"
    payload = {
        "text": "a b c", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "stream": True, "sim_fault": "decode:die@2tok",
    }  # fmt: skip
    async with cluster.client.stream(
        "POST", "/generate", json=payload, headers={"x-request-id": rid}
    ) as response:
        assert response.status_code == 200
        events = await read_sse(response)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    [gone] = [d for d in cluster.decodes if d.events.find("engine_died")]  # provoked
    [alive] = [d for d in cluster.decodes if d is not gone]
    assert served(cluster, cluster.decodes, rid) == [worker_id(cluster, d) for d in cluster.decodes]
    # The resumed attempt's prefill: the one sent the prompt's ids plus the ids already sent.
    resumed = [
        worker_id(cluster, p)
        for p in cluster.prefills
        for start in p.events.find("request_start", rid=rid)
        if "input_ids" in start["body"]
    ]
    assert len(resumed) == 1
    line = await access_line(kept, rid)
    assert (line["status"], line["migrations"], line["attempts"]) == (200, 1, 2)
    assert (line["prefill"], line["decode"]) == (resumed[0], worker_id(cluster, alive))
    assert line["bytes"] > 0 and "inband_status" not in line


async def test_samples_name_sample_0s_pair(nursery: trio.Nursery, kept: Kept) -> None:
    """`n > 1`: every sample is a PD request of its own; the line names sample 0's pair (the
    engine rid that wrote choice 0: `sim_tag`) and counts the samples."""
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, access_log=True)
    rid = "two-samples"
    response = await cluster.client.post(
        "/v1/chat/completions", json={**CHAT, "n": 2}, headers={"x-request-id": rid}
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    tags = [c["message"]["content"].split(" ", 1)[0] for c in choices]
    pairs = [
        (served(cluster, cluster.prefills, rid, sglang_rid=tag),
         served(cluster, cluster.decodes, rid, sglang_rid=tag))
        for tag in tags
    ]  # fmt: skip
    assert all(len(p) == len(d) == 1 for p, d in pairs), pairs
    assert pairs[0] != pairs[1]  # provoked: the samples went to different pairs
    line = await access_line(kept, rid)
    assert (line["status"], line["samples"], line["attempts"]) == (200, 2, 1)
    assert (line["prefill"], line["decode"]) == (pairs[0][0][0], pairs[0][1][0])


async def test_a_failed_sample_names_its_own_pair(nursery: trio.Nursery, kept: Kept) -> None:
    """The sample that fails decides the answer, and the line names its pair (not sample 0's,
    cancelled by that failure, when it is another)."""
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, access_log=True)
    faulty = cluster.prefills[1]
    faulty.state.set_faults(["500"])  # every request it gets fails
    for n in range(4):  # round robin: the faulty prefill gets sample 0 or sample 1
        rid = f"sample-fails-{n}"
        response = await cluster.client.post(
            "/v1/chat/completions", json={**CHAT, "n": 2}, headers={"x-request-id": rid}
        )
        assert response.status_code == 502, response.text
        [started] = faulty.events.find("request_start", rid=rid)  # provoked: a sample there
        tag = started["sglang_rid"]
        [decode] = served(cluster, cluster.decodes, rid, sglang_rid=tag)
        line = await access_line(kept, rid)
        assert (line["status"], line["samples"]) == (502, 2)
        assert (line["prefill"], line["decode"]) == (worker_id(cluster, faulty), decode)


async def test_a_client_gone_is_one_outcome_in_the_line_and_the_span(
    nursery: trio.Nursery, kept: Kept
) -> None:
    """A request cut by its client still names the pair it had reached, and its span says the
    same as its line: both read the one outcome (499, the pair, the attempts)."""
    from tests.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        cluster = await start_cluster(
            nursery, n_prefill=2, n_decode=2, access_log=True, enable_trace=True,
            otlp_traces_endpoint=receiver.endpoint,
        )  # fmt: skip
        rid = "gone"
        gave_up = await leave_when(  # once a prefill (which hangs) has the request
            lambda: cluster.client.post(
                "/generate",
                json={"text": "a b c", "sim_fault": "prefill:hang"},
                headers={"x-request-id": rid},
            ),
            lambda: settle(lambda: bool(served(cluster, cluster.prefills, rid)), LOOSE),
        )
        assert gave_up.cancelled_caught
        [prefill] = served(cluster, cluster.prefills, rid)
        [decode] = served(cluster, cluster.decodes, rid)
        line = await access_line(kept, rid)
        spans = await receiver.wait_for(
            lambda s: any(x.attributes.get("request_id") == rid for x in s), "the 499's span"
        )
        [span] = [s for s in spans if s.attributes.get("request_id") == rid]
    assert (line["status"], line["prefill"], line["decode"], line["attempts"]) == (
        499, prefill, decode, 1,
    )  # fmt: skip
    attributes = span.attributes
    assert (attributes["status_code"], attributes["cancel_cause"]) == (499, "client_gone")
    assert {k: attributes[k] for k in ("model", "prefill", "decode", "attempts")} == {
        k: line[k] for k in ("model", "prefill", "decode", "attempts")
    }


async def test_an_error_event_after_the_keepalive_headers_is_the_inband_status(
    nursery: trio.Nursery, kept: Kept, autojump_clock: trio.testing.MockClock
) -> None:
    """The keep-alive sent the stream's 200 before the prefill failed: the client's status is
    200 (the line's), the error event's 502 is `inband_status`, and the pair is named."""
    keepalive = attrs.evolve(RouterConfig().edges, sse_keepalive_secs=1)
    cluster = await start_cluster(
        nursery, n_prefill=2, n_decode=2, access_log=True, edges=keepalive
    )
    rid = "late-502"
    payload = {"text": "a b c", "stream": True, "sim_fault": "prefill:500@3000"}
    async with cluster.client.stream(
        "POST", "/generate", json=payload, headers={"x-request-id": rid}
    ) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert response.status_code == 200
    assert raw.startswith(b": ping") and b'"code":502' in raw.replace(b" ", b"")  # provoked
    [prefill] = served(cluster, cluster.prefills, rid)
    [decode] = served(cluster, cluster.decodes, rid)
    line = await access_line(kept, rid)
    assert (line["status"], line["inband_status"], line["bytes"]) == (200, 502, len(raw))
    assert (line["prefill"], line["decode"], line["attempts"]) == (prefill, decode, 1)


async def test_an_internal_error_mid_stream_is_an_inband_500_and_an_error_span(
    nursery: trio.Nursery, kept: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug after the stream started: the client got 200 and then the router's error event;
    the line says `inband_status=500` and the span, with the same status 200, is an error."""
    from tests.otlp_receiver import otlp_receiver

    original = Responder.send
    sends = 0

    async def flaky_send(self: Responder, chunk: bytes) -> None:
        nonlocal sends
        sends += 1
        if sends == 3:
            raise RuntimeError("a bug in the relay")
        await original(self, chunk)

    with otlp_receiver() as receiver:
        cluster = await start_cluster(
            nursery, decode={"inter_token_ms": 10.0}, access_log=True, enable_trace=True,
            otlp_traces_endpoint=receiver.endpoint,
        )  # fmt: skip
        monkeypatch.setattr(Responder, "send", flaky_send)
        rid = "a-bug"
        payload = {"text": "a b c", "stream": True, "sampling_params": {"max_new_tokens": 50}}
        async with cluster.client.stream(
            "POST", "/generate", json=payload, headers={"x-request-id": rid}
        ) as response:
            events = await read_sse(response)
        assert response.status_code == 200 and sends == 3  # provoked: the third send failed
        assert events[-2]["error"]["code"] == 500
        line = await access_line(kept, rid)
        spans = await receiver.wait_for(
            lambda s: any(x.attributes.get("request_id") == rid for x in s), "the span"
        )
        [span] = [s for s in spans if s.attributes.get("request_id") == rid]
    assert (line["status"], line["inband_status"]) == (200, 500)
    assert span.attributes["status_code"] == 200 and span.status == "error"


def test_every_field_known_keeps_the_order() -> None:
    """No request above has every field at once (a resumed sample after the keep-alive's
    headers would): the order of all of them, without a socket."""
    outcome = RequestOutcome(
        status=200, bytes_sent=1, inband_status=502, model="m", client_rid="c",
        prefill="p", decode="d", attempts=3, migrations=1, samples=2,
        cancel_cause=None, error=None,
    )  # fmt: skip
    assert tuple(outcome.access_fields()) == ORDER[5:]
