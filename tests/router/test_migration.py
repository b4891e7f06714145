"""Migration over the wire (issue 29): a decode that dies mid-stream costs the client nothing.

Simulator engines and the real router on real sockets. The decode that gets a request dies (the
whole engine, as a SIGKILLed SGLang server: `die@Ntok`, fired by what happened, its N-th token)
after the client got N of the answer's tokens; the router resumes the request on the other
decode with the prompt's ids plus the N ids already sent. The simulator continues such a prompt
with the uninterrupted run's tokens (`workload.continued`), so the client's answer is compared
byte for byte with an uninterrupted run of the same request.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import attrs
import orjson
import pytest
import trio

from tests.conftest import start_cluster
from tests.router.helpers import read_sse, settle
from trio_pd.config import RetryConfig, TimeoutConfig
from trio_pd_testing.engine.detokenize import decode as detokenize
from trio_pd_testing.engine.workload import output_id

MAX = 8
PROMPT = "the quick brown fox jumps over the lazy dog"
RETRY = RetryConfig(max_retries=3, initial_backoff_ms=1, max_backoff_ms=5, jitter_factor=0.0)


def body(path: str, stream: bool = True, fault: str | None = None, **extra: Any) -> dict:
    if path == "/generate":
        out: dict[str, Any] = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": MAX, "temperature": 0},
        }
    elif path == "/v1/completions":
        out = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
        if stream:
            out["stream_options"] = {"include_usage": True}
    else:
        out = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX}
        if stream:
            out["stream_options"] = {"include_usage": True}
    out["stream"] = stream
    if fault is not None:
        out["sim_fault"] = fault
    return {**out, **extra}


async def stream(cluster, path: str, payload: dict, rid: str) -> tuple[int, list[Any], bytes]:
    async with cluster.client.stream(
        "POST", path, json=payload, headers={"x-request-id": rid}
    ) as response:
        if not response.headers["content-type"].startswith("text/event-stream"):
            raw = await response.aread()
            return response.status_code, [orjson.loads(raw)], raw
        return response.status_code, await read_sse(response), b""


def answer(path: str, events: list[Any]) -> dict[str, Any]:
    """What a client reads of a stream: the text, the ids, the finish, the counts, [DONE]s."""
    data = [e for e in events if e != "[DONE]"]
    out: dict[str, Any] = {
        "done": events.count("[DONE]"),
        "errors": [e for e in data if "error" in e],
    }
    if path == "/generate":
        last = data[-1]
        out.update(
            text=last["text"],
            ids=last["output_ids"],
            finish=last["meta_info"]["finish_reason"],
            prompt_tokens=last["meta_info"]["prompt_tokens"],
            completion_tokens=last["meta_info"]["completion_tokens"],
            ids_grow=[len(e["output_ids"]) for e in data],
            rid={e["meta_info"]["id"] for e in data},
        )
        return out
    choices = [c for e in data for c in e.get("choices") or []]
    out.update(
        text="".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices),
        finish=[c["finish_reason"] for c in choices if c.get("finish_reason")],
        usage=[e["usage"] for e in data if e.get("usage")],
        keys={k for c in choices for k in c},
        rid={e["id"] for e in data},
        created={e["created"] for e in data},
    )
    return out


async def migrations(cluster) -> dict[tuple[str, str], float]:
    text = (await cluster.client.get("/metrics")).text
    found = {}
    for line in text.splitlines():
        if line.startswith("trio_pd_migrations_total{"):
            labels, value = line.split("} ")
            parts = dict(p.split("=") for p in labels.split("{")[1].split(","))
            found[(parts["reason"].strip('"'), parts["outcome"].strip('"'))] = float(value)
    return found


def dead(cluster):
    return [d for d in cluster.decodes if d.events.find("engine_died")]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("after", [1, 3, MAX - 1])
async def test_a_stream_outlives_its_decode(nursery: trio.Nursery, path: str, after: int) -> None:
    cluster = await start_cluster(nursery, n_decode=2, migration_limit=2)
    # an uninterrupted run of the same request, while both decodes live
    status, reference, _ = await stream(cluster, path, body(path), "ref")
    want = answer(path, reference)
    assert status == 200 and want["done"] == 1 and not want["errors"]
    status, events, _ = await stream(cluster, path, body(path, fault=f"decode:die@{after}tok"), "m")
    assert status == 200
    [gone] = dead(cluster)  # the provoked thing happened: the decode that had it died
    [alive] = [d for d in cluster.decodes if d is not gone]
    got = answer(path, events)
    assert got["done"] == 1 and not got["errors"], events
    assert got["text"] == want["text"] and got["finish"] == want["finish"]
    if path == "/generate":
        assert got["ids"] == want["ids"] == [output_id(k) for k in range(1, MAX + 1)]
        assert got["ids_grow"] == list(range(1, MAX + 1))  # no token twice, none missing
        assert (got["prompt_tokens"], got["completion_tokens"]) == (
            want["prompt_tokens"],
            want["completion_tokens"],
        )
    else:
        assert got["usage"] == want["usage"]
        assert "token_ids" not in got["keys"] and "prompt_token_ids" not in got["keys"]
        assert len(got["created"]) == 1
    assert len(got["rid"]) == 1  # one answer id across both attempts
    # the resumed request on the other decode: the prompt plus the `after` ids already sent
    [resumed] = [r for r in alive.events.find("request_start", rid="m")]
    assert resumed
    assert (await migrations(cluster)) == {("transport", "resumed"): 1.0}
    await settle(lambda: gone.running == 0 and alive.running == 0)


MB_MAX = 12  # two cycles of the simulator's multibyte vocabulary (`detokenize.output_bytes`)
MULTIBYTE = {"multibyte_tokens": True}


def clean_cut(after: int) -> int:
    """The last of the first `after` tokens after which the text is whole: the vocabulary's
    `tok<6m+2>` ends with ب's first byte, `tok<6m+4>` and `tok<6m+5>` hold part of €."""
    return max(k for k in range(1, after + 1) if k % 6 in (0, 1, 3))


def text_and_ids(path: str, events: list[Any]) -> tuple[list[str], list[int]]:
    """The text the client held after each event, and the ids it got (each chunk's own)."""
    texts, ids, text = [], [], ""
    for e in events:
        if e == "[DONE]" or "error" in e:
            continue
        if path == "/generate":
            text, ids = e["text"], e["output_ids"]
        else:
            for c in e.get("choices") or []:
                text += c.get("text") or ""
                ids += c.get("token_ids") or []
        texts.append(text)
    return texts, ids


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("after", [2, 3, 4, 5, 8])
async def test_a_break_inside_a_multibyte_character_loses_no_text(
    nursery: trio.Nursery, path: str, after: int
) -> None:
    """SGLang holds a character's text back until all its bytes arrived (sending only a
    printable prefix), and decodes a resumed request behind its prompt: resumed from every id
    sent, a character cut at the break would never be sent. The router resumes from the last
    id after which the text is whole (the engine's own /detokenize says where), the engine
    generates the cut tail again (greedy: the same ids), and the client gets neither those ids
    twice nor the printable prefix twice: text and ids equal an uninterrupted run's."""
    cluster = await start_cluster(
        nursery, n_decode=2, migration_limit=2, prefill=MULTIBYTE, decode=MULTIBYTE
    )
    extra = {"return_token_ids": True} if path == "/v1/completions" else {}
    payload = body(path, **extra)
    if path == "/generate":
        payload["sampling_params"]["max_new_tokens"] = MB_MAX
    else:
        payload["max_tokens"] = MB_MAX
    status, reference, _ = await stream(cluster, path, payload, "ref")
    want_texts, want_ids = text_and_ids(path, reference)
    assert status == 200 and want_ids == [output_id(k) for k in range(1, MB_MAX + 1)]
    assert "\u0628" in want_texts[-1] and "\u20ac" in want_texts[-1]  # the characters are there
    # The engine's fault, not the request's (the resumed request generates the answer's
    # `after`-th token again): round robin gives the next request to the other decode.
    [gone] = [d for d in cluster.decodes if not d.events.find("request_start", rid="ref")]
    [alive] = [d for d in cluster.decodes if d is not gone]
    gone.set_faults([f"decode:die@{after}tok"])
    status, events, _ = await stream(cluster, path, payload, "mb")
    assert status == 200 and dead(cluster) == [gone]
    assert alive.events.find("request_start", rid="mb")  # resumed on the other decode
    texts, ids = text_and_ids(path, events)
    got = answer(path, events)
    assert got["done"] == 1 and not got["errors"], events
    assert texts[-1] == want_texts[-1] and ids == want_ids
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # nothing taken back
    if path == "/generate":
        assert got["ids_grow"] == list(range(1, MB_MAX + 1))  # no id twice, none missing
        assert got["completion_tokens"] == MB_MAX
    else:
        assert got["usage"] == answer(path, reference)["usage"]
    # The resumed request: the prompt plus the ids up to the last whole character.
    [start] = alive.events.find("request_start", rid="mb")
    sent_ids = start["body"]["input_ids" if path == "/generate" else "prompt"]
    kept = clean_cut(after)
    assert sent_ids[-kept:] == want_ids[:kept] and output_id(kept + 1) not in sent_ids
    assert (await migrations(cluster)) == {("transport", "resumed"): 1.0}
    await settle(lambda: gone.running == 0 and alive.running == 0)


async def test_a_sampled_request_keeps_every_id_sent(nursery: trio.Nursery) -> None:
    """Sampling (temperature > 0) would not generate a cut tail again the same: the resume
    keeps every id sent, no seam is asked for, and the character cut at the break loses its
    text (docs/protocol.md §14; the simulator's tokens are the same whatever the sampling)."""
    cluster = await start_cluster(
        nursery, n_decode=2, migration_limit=2, prefill=MULTIBYTE, decode=MULTIBYTE
    )
    payload = body("/generate", sampling_params={"max_new_tokens": MB_MAX, "temperature": 0.7})
    cluster.decodes[0].set_faults(["decode:die@2tok"])  # round robin's first pick
    status, events, _ = await stream(cluster, "/generate", payload, "sampled")
    assert status == 200 and dead(cluster) == [cluster.decodes[0]]
    texts, ids = text_and_ids("/generate", events)
    assert ids == [output_id(k) for k in range(1, MB_MAX + 1)]
    [start] = cluster.decodes[1].events.find("request_start", rid="sampled")
    assert start["body"]["input_ids"][-2:] == [output_id(1), output_id(2)]  # every id sent
    assert not cluster.prefills[0].events.find("detokenize")
    assert texts[-1] == detokenize(ids, True).replace(" \u0628", " ", 1)  # ب lost at the seam


async def test_a_second_resume_follows_a_resume_from_a_seam(nursery: trio.Nursery) -> None:
    """Three decodes: the first dies inside ب (after tok2: resumed from tok1), the next at
    tok7 (a whole end: resumed from every id); the third finishes the answer whole."""
    cluster = await start_cluster(
        nursery, n_decode=3, migration_limit=2, prefill=MULTIBYTE, decode=MULTIBYTE
    )
    first, *others = cluster.decodes
    first.set_faults(["decode:die@2tok"])
    for decode in others:
        decode.set_faults(["decode:die@7tok"])
    payload = body("/generate", sampling_params={"max_new_tokens": MB_MAX, "temperature": 0})
    status, events, _ = await stream(cluster, "/generate", payload, "twice")
    assert status == 200 and len(dead(cluster)) == 2 and first in dead(cluster)
    texts, ids = text_and_ids("/generate", events)
    want = [output_id(k) for k in range(1, MB_MAX + 1)]
    assert ids == want and texts[-1] == detokenize(want, True)
    assert answer("/generate", events)["ids_grow"] == list(range(1, MB_MAX + 1))
    assert (await migrations(cluster)) == {("transport", "resumed"): 2.0}
    assert len(cluster.prefills[0].events.find("detokenize")) == 2


async def test_migration_limit_zero_ends_the_stream_as_before(nursery: trio.Nursery) -> None:
    """--migration-limit 0: the cut stream ends with the error event (today's behaviour)."""
    cluster = await start_cluster(nursery, n_decode=2, migration_limit=0)
    status, events, _ = await stream(
        cluster, "/generate", body("/generate", fault="decode:die@3tok"), "m0"
    )
    assert status == 200 and dead(cluster)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    got = answer("/generate", events[:-2])
    assert got["completion_tokens"] == 3  # the client has 3 tokens and an error: no resume
    assert (await migrations(cluster)) == {}


@pytest.mark.parametrize(
    ("path", "extra", "rule"),
    [
        ("/v1/chat/completions", {}, "chat_stream"),
        ("/generate", {"sampling_params": {"max_new_tokens": MAX, "regex": "t.*"}},
         "structured_output"),
        ("/v1/completions", {"stop": ["tok5"]}, "stop_strings"),
        ("/generate", {"return_logprob": True}, "logprobs"),
    ],
)  # fmt: skip
async def test_refused_breaks_end_as_before_and_are_counted(
    nursery: trio.Nursery, path: str, extra: dict, rule: str
) -> None:
    cluster = await start_cluster(nursery, n_decode=2, migration_limit=2)
    status, events, _ = await stream(
        cluster, path, body(path, fault="decode:die@3tok", **extra), "r"
    )
    assert status == 200 and dead(cluster)
    assert events[-1] == "[DONE]" and "error" in events[-2]  # today's clean error event
    assert (await migrations(cluster)) == {("transport", f"refused_{rule}"): 1.0}


async def test_an_engine_abort_mid_stream_is_resumed_never_relayed(nursery: trio.Nursery) -> None:
    """A decode that aborts the request itself (as an engine shutting down may) sends an abort
    finish: the client never sees it, the answer goes on from the other decode."""
    cluster = await start_cluster(nursery, n_decode=2, migration_limit=2)
    status, events, _ = await stream(
        cluster, "/generate", body("/generate", fault="decode:abort@4tok"), "ab"
    )
    assert status == 200
    assert any(d.events.find("fault", rid="ab") for d in cluster.decodes)
    got = answer("/generate", events)
    assert got["done"] == 1 and not got["errors"]
    assert got["ids"] == [output_id(k) for k in range(1, MAX + 1)]
    assert got["finish"] == {"type": "length", "length": MAX}
    assert (await migrations(cluster)) == {("inband", "resumed"): 1.0}


async def test_a_silent_decode_is_resumed(nursery: trio.Nursery) -> None:
    """A decode that goes silent mid-stream (`hold@Ntok`: it stops after its 2nd token until
    released) is failed by the stream's idle timeout and resumed on the other one."""
    timeouts = attrs.evolve(TimeoutConfig(), stream_idle_secs=0.5)
    cluster = await start_cluster(nursery, n_decode=2, timeouts=timeouts, migration_limit=2)
    status, events, _ = await stream(
        cluster, "/generate", body("/generate", fault="decode:hold@2tok"), "idle"
    )
    assert status == 200
    got = answer("/generate", events)
    assert got["done"] == 1 and not got["errors"]
    assert got["ids"] == [output_id(k) for k in range(1, MAX + 1)]
    assert (await migrations(cluster)) == {("timeout", "resumed"): 1.0}
    for decode in cluster.decodes:
        decode.state.release_held()
    await settle(lambda: all(d.running == 0 for d in cluster.decodes))


@pytest.mark.parametrize("multibyte", [False, True])
@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
async def test_a_plain_request_is_answered_whole_by_a_retry(
    nursery: trio.Nursery, path: str, multibyte: bool
) -> None:
    """Without a stream nothing reached the client: the retry loop runs the request again on a
    fresh pair (the dead decode's tokens are generated again; a character cut at the death,
    `multibyte`, is whole in the answer)."""
    engines = {"multibyte_tokens": multibyte}
    cluster = await start_cluster(
        nursery, n_decode=2, retry=RETRY, migration_limit=2, prefill=engines, decode=engines
    )
    status, [want], _ = await stream(cluster, path, body(path, stream=False), "pref")
    # The engine's fault, not the request's (a retry sends the same body): round robin gives
    # the next request to the decode the reference did not use, and that one dies.
    [other] = [d for d in cluster.decodes if not d.events.find("request_start", rid="pref")]
    other.set_faults(["decode:die@2tok" if multibyte else "decode:die@3tok"])
    status, [got], _ = await stream(cluster, path, body(path, stream=False), "p")
    assert dead(cluster) == [other] and status == 200
    if path == "/generate":
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    else:
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"]


@pytest.mark.parametrize("limit", [1, 2])
async def test_the_migration_limit_bounds_the_resumes(nursery: trio.Nursery, limit: int) -> None:
    """Three decodes: the first dies at the answer's 2nd token, the others at its 4th (a
    resumed request counts the answer's tokens: the last decode, reached with 4 sent, lives).
    `--migration-limit 1` resumes once and ends the stream at the second death; 2 finishes."""
    cluster = await start_cluster(nursery, n_decode=3, migration_limit=limit)
    first, *others = cluster.decodes
    first.set_faults(["decode:die@2tok"])
    for decode in others:
        decode.set_faults(["decode:die@4tok"])
    status, events, _ = await stream(cluster, "/generate", body("/generate"), "lim")
    assert status == 200 and first in dead(cluster)  # round robin's first pick died first
    if limit == 1:
        assert len(dead(cluster)) == 2
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert answer("/generate", events[:-2])["ids"] == [output_id(k) for k in range(1, 5)]
        assert (await migrations(cluster)) == {
            ("transport", "resumed"): 1.0,
            ("transport", "limit"): 1.0,
        }
    else:
        got = answer("/generate", events)
        assert got["done"] == 1 and not got["errors"]
        assert got["ids"] == [output_id(k) for k in range(1, MAX + 1)]
        assert (await migrations(cluster)) == {("transport", "resumed"): 2.0}


async def test_each_of_n_samples_resumes_on_its_own(nursery: trio.Nursery) -> None:
    """`n: 2`: each sample is its own PD request; both decodes they reach die, both resume on
    the third, and the merged stream equals an uninterrupted run's."""
    cluster = await start_cluster(nursery, n_decode=3, migration_limit=2)
    payload = body("/v1/completions", n=2)
    status, reference, _ = await stream(cluster, "/v1/completions", payload, "n-ref")
    for decode in cluster.decodes:
        decode.set_faults(["decode:die@3tok"])
    status, events, _ = await stream(cluster, "/v1/completions", payload, "n2")
    assert status == 200 and len(dead(cluster)) == 2
    got, want = answer("/v1/completions", events), answer("/v1/completions", reference)
    assert got["done"] == 1 and not got["errors"]
    by_index = {}
    for e in events:
        for c in (e.get("choices") or []) if isinstance(e, dict) else []:
            by_index[c["index"]] = by_index.get(c["index"], "") + (c.get("text") or "")
    ref_index = {}
    for e in reference:
        for c in (e.get("choices") or []) if isinstance(e, dict) else []:
            ref_index[c["index"]] = ref_index.get(c["index"], "") + (c.get("text") or "")
    assert by_index == ref_index and got["usage"] == want["usage"]
    assert (await migrations(cluster)) == {("transport", "resumed"): 2.0}


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_resume_is_a_span_event_and_an_access_log_field(nursery: trio.Nursery) -> None:
    from tests.otlp_receiver import otlp_receiver

    kept = Kept()
    access_logger = logging.getLogger("trio_pd.access")
    access_logger.addHandler(kept)
    level = access_logger.level
    access_logger.setLevel(logging.INFO)

    with otlp_receiver() as receiver:
        cluster = await start_cluster(
            nursery, n_decode=2, migration_limit=2, enable_trace=True,
            otlp_traces_endpoint=receiver.endpoint, access_log=True,
        )  # fmt: skip
        try:
            status, events, _ = await stream(
                cluster, "/generate", body("/generate", fault="decode:die@3tok"), "traced"
            )
            # the access line is written once the answer ended, just after the client read it
            await settle(
                lambda: any(
                    getattr(r, "access", {}).get("path") == "/generate" for r in kept.records
                )
            )
        finally:
            access_logger.removeHandler(kept)
            access_logger.setLevel(level)
        assert status == 200 and dead(cluster) and answer("/generate", events)["done"] == 1

        def exported(spans) -> bool:
            names = sorted(s.name for s in spans if s.name == "pd_attempt")
            return len(names) == 2 and any(s.name == "http_request" for s in spans)

        await receiver.wait_for(lambda spans: exported(receiver.trace_of("traced")), "2 attempts")
        spans = receiver.trace_of("traced")
        [request] = [s for s in spans if s.name == "http_request"]
        assert [
            (name, e["resume"], e["reason"], e["sent_tokens"]) for name, e in request.events
        ] == [("migration", 1, "transport", 3)]
        assert request.attributes["migrations"] == 1 and request.attributes["attempts"] == 2
        assert sorted(s.attributes["attempt"] for s in spans if s.name == "pd_attempt") == [1, 2]
    access = [getattr(r, "access", None) for r in kept.records]
    [line] = [a for a in access if a is not None and a.get("path") == "/generate"]
    assert line["migrations"] == 1 and line["attempts"] == 2 and line["status"] == 200


async def test_a_draining_decode_finishes_its_streams(nursery: trio.Nursery) -> None:
    """SGLang 0.5.23 on SIGTERM to its server drains: `/ready` and `/health` answer 503 and the
    requests it holds run to their end (docs/protocol.md §14). The simulator's `stopping` is
    that drain: set once the client got 3 tokens (the stream paused there by `hold@3tok`), the
    stream still ends whole on the same decode and nothing is migrated."""
    cluster = await start_cluster(nursery, n_decode=2, migration_limit=2)
    seen: list[Any] = []

    async def client() -> None:
        async with cluster.client.stream(
            "POST", "/generate", json=body("/generate", fault="decode:hold@3tok")
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    seen.append(data if data == "[DONE]" else orjson.loads(data))

    async with trio.open_nursery() as inner:
        inner.start_soon(client)
        await settle(lambda: len(seen) >= 3)
        [draining] = [d for d in cluster.decodes if d.running]
        draining.state.stopping = True  # SIGTERM: drain
        assert (await cluster.client.get(draining.url + "/ready")).status_code == 503
        draining.state.release_held()
    got = answer("/generate", seen)
    assert got["done"] == 1 and not got["errors"]
    assert got["ids"] == [output_id(k) for k in range(1, MAX + 1)]
    assert (await migrations(cluster)) == {}
