"""Engine-direct scenarios: the observables of SGLang 0.5.23 that trio_pd relies on.

Each scenario talks to a prefill/decode pair directly (no router) and returns a JSON-able dict
of observables: statuses, body *shapes* (keys and types, not values), rid rules, abort answers,
disconnect timing *classes*. `python -m tests.sglang.record` runs them against a real pair and
writes `tests/data/sglang_0.5.23_observables.json`; `tests/sglang/test_observables.py` re-runs
them live and compares; the simulator's differential test can drive the same functions against
simulator engines (they only need URLs and a bootstrap port) and compare with the recording.

Async on trio with httpx2, so in-process simulator engines keep running while a scenario waits.
Scenarios that need a prefill whose context is shorter than the decode's (`long_prompt_words`)
or an engine with `--admin-api-key` say so in `Target`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
import orjson
import trio

# Fits the tier's decode context (4096) and exceeds its prefill's (--context-length 1024): each
# "word" is 3 tokens of the tiny tokenizer.
LONG_PROMPT_WORDS = 500
GEN = {"text": "the tiny model says", "sampling_params": {"max_new_tokens": 4}}
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
# A hung leg is declared hung after this long (the engine's own timeout is 300 s).
HANG_SECS = 4.0


@dataclass
class Target:
    """Where the scenarios send requests."""

    prefill_url: str
    decode_url: str
    bootstrap_port: int
    # Sent as `Authorization: Bearer` on generation routes (the engines' --api-key).
    api_key: str | None = None
    # The engines' --admin-api-key, when they have one.
    admin_api_key: str | None = None


Observables = dict[str, Any]
Scenario = Callable[[Target, httpx2.AsyncClient], Awaitable[Observables]]


# ---------------------------------------------------------------------------------- shapes


def shape(value: Any, depth: int = 3) -> Any:
    """Keys and types of a JSON value; dicts below `depth` levels collapse to "object"."""
    if isinstance(value, dict):
        if depth <= 0:
            return "object"
        return {k: shape(v, depth - 1) for k, v in sorted(value.items())}
    if isinstance(value, list):
        if depth <= 0 or not value:
            return ["list"]
        return [shape(value[0], depth - 1)]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return type(value).__name__


def shape_differences(recorded: Any, live: Any, path: str = "$") -> list[str]:
    """Where two shapes differ. `null` matches any type (optional details come and go, e.g.
    `cached_tokens_details` is null until the radix cache hits), as do `int` and `float`."""
    if recorded == live or "null" in (recorded, live):
        return []
    if isinstance(recorded, str) and isinstance(live, str) and {recorded, live} <= {"int", "float"}:
        return []
    if isinstance(recorded, dict) and isinstance(live, dict):
        out = [f"{path}.{k}: missing" for k in recorded if k not in live]
        out += [f"{path}.{k}: unexpected" for k in live if k not in recorded]
        for k in recorded.keys() & live.keys():
            out += shape_differences(recorded[k], live[k], f"{path}.{k}")
        return out
    if isinstance(recorded, list) and isinstance(live, list):
        if ["list"] in (recorded, live):
            return []
        return shape_differences(recorded[0], live[0], f"{path}[0]")
    return [f"{path}: recorded {recorded!r}, live {live!r}"]


# --------------------------------------------------------------------------------- helpers


def room() -> int:
    """A bootstrap room from [1, 2**63-1]: 0 is the decode's "metadata not yet written"."""
    return random.randint(1, 2**63 - 1)


def fresh_rid(prefix: str) -> str:
    return f"{prefix}-{random.getrandbits(48):012x}"


def bootstrap(t: Target, bootstrap_room: int | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": t.bootstrap_port,
        "bootstrap_room": room() if bootstrap_room is None else bootstrap_room,
    }


def headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


@dataclass
class Answer:
    status: int
    body: Any
    text: str
    secs: float
    content_type: str = ""

    @classmethod
    def of(cls, response: httpx2.Response, t0: float) -> Answer:
        try:
            body = orjson.loads(response.content) if response.content else None
        except orjson.JSONDecodeError:
            body = None
        return cls(
            response.status_code,
            body,
            response.text,
            time.monotonic() - t0,
            response.headers.get("content-type", ""),
        )

    def error_message(self) -> str:
        """The message of either error envelope SGLang uses (native or OpenAI)."""
        if not isinstance(self.body, dict):
            return ""
        if isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("message", ""))
        return str(self.body.get("message", ""))

    def error_envelope(self) -> str:
        """Which error envelope: `{"error": {...}}` (native) or `{"object": "error"}` (OpenAI)."""
        if not isinstance(self.body, dict):
            return "none"
        if isinstance(self.body.get("error"), dict):
            return "error-object"
        if self.body.get("object") == "error":
            return "openai-error"
        return "none"


async def post(client: httpx2.AsyncClient, url: str, body: dict, key: str | None = None) -> Answer:
    t0 = time.monotonic()
    response = await client.post(url, json=body, headers=headers(key))
    return Answer.of(response, t0)


async def post_sse(
    client: httpx2.AsyncClient, url: str, body: dict, key: str | None = None
) -> tuple[Answer, list[Any]]:
    """A streaming POST: the answer (status, type) and its `data:` events ("[DONE]" kept)."""
    t0 = time.monotonic()
    events: list[Any] = []
    lines: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers(key)) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else orjson.loads(data))
    text = "\n".join(lines)
    try:
        body_json = orjson.loads(text) if text and not events else None
    except orjson.JSONDecodeError:
        body_json = None
    answer = Answer(
        response.status_code,
        body_json,
        text,
        time.monotonic() - t0,
        response.headers.get("content-type", ""),
    )
    return answer, events


async def pd(t: Target, client: httpx2.AsyncClient, path: str, body: dict) -> tuple[Answer, Answer]:
    """The same body to both legs at once, as a PD router sends it."""
    body = {**body, **bootstrap(t)}
    out: dict[str, Answer] = {}

    async def leg(name: str, url: str) -> None:
        out[name] = await post(client, url + path, body, t.api_key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "prefill", t.prefill_url)
        nursery.start_soon(leg, "decode", t.decode_url)
    return out["prefill"], out["decode"]


async def pd_stream(
    t: Target, client: httpx2.AsyncClient, path: str, body: dict
) -> tuple[Answer, tuple[Answer, list[Any]]]:
    body = {**body, **bootstrap(t), "stream": True}
    out: dict[str, Any] = {}

    async def prefill() -> None:
        out["prefill"] = await post(client, t.prefill_url + path, body, t.api_key)

    async def decode() -> None:
        out["decode"] = await post_sse(client, t.decode_url + path, body, t.api_key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefill)
        nursery.start_soon(decode)
    return out["prefill"], out["decode"]


async def loads(
    client: httpx2.AsyncClient, url: str, query: str = "", key: str | None = None
) -> Any:
    return (await client.get(url + "/v1/loads" + query, headers=headers(key))).json()


def busy(load: dict) -> int:
    """Requests a load snapshot still holds: running, waiting, and every PD queue."""
    disagg = load.get("disaggregation") or {}
    queues = [v for k, v in disagg.items() if k.endswith("_queue_reqs")]
    return load["num_running_reqs"] + load["num_waiting_reqs"] + sum(queues)


async def busy_count(client: httpx2.AsyncClient, url: str, key: str | None = None) -> int:
    return sum(busy(load) for load in (await loads(client, url, key=key))["loads"])


async def wait_busy(
    client: httpx2.AsyncClient, url: str, n: int, timeout: float = 10.0, key: str | None = None
) -> None:
    with trio.fail_after(timeout):
        while await busy_count(client, url, key) < n:
            await trio.sleep(0.01)


async def wait_idle(
    client: httpx2.AsyncClient, url: str, timeout: float = 10.0, key: str | None = None
) -> float:
    """Seconds until the engine's /v1/loads shows nothing held (polled every 5 ms)."""
    t0 = time.monotonic()
    with trio.fail_after(timeout):
        while await busy_count(client, url, key) != 0:
            await trio.sleep(0.005)
    return time.monotonic() - t0


async def abort(client: httpx2.AsyncClient, url: str, body: dict, key: str | None = None) -> Answer:
    return await post(client, url + "/abort_request", body, key)


class Background:
    """A request running in a nursery; `answer` is set when it finishes."""

    def __init__(self) -> None:
        self.answer: Answer | None = None
        self.done = trio.Event()

    async def run(self, coro: Awaitable[Answer]) -> None:
        try:
            self.answer = await coro
        finally:
            self.done.set()


def start(nursery: trio.Nursery, coro: Awaitable[Answer]) -> Background:
    job = Background()
    nursery.start_soon(job.run, coro)
    return job


def waiting_decode(
    t: Target, client: httpx2.AsyncClient, nursery: trio.Nursery, path: str, body: dict
) -> Background:
    """A decode-only request: no prefill ever sends its KV, so it waits (300 s) until aborted."""
    return start(nursery, post(client, t.decode_url + path, {**body, **bootstrap(t)}, t.api_key))


def timing_class(secs: float) -> str:
    """`at_once` (< 1 s: the engine saw it immediately) or `poll` (within SGLang's 4 s poll)."""
    if secs < 1.0:
        return "at_once"
    return "poll" if secs <= 5.0 else "late"


# ------------------------------------------------------------------------------- scenarios


async def generate_text(t: Target, client: httpx2.AsyncClient) -> Observables:
    """PD /generate with `text`: both legs 200, bodies with `meta_info` (http_server.py)."""
    p, d = await pd(t, client, "/generate", GEN)
    return {
        "status": [p.status, d.status],
        "prefill_shape": shape(p.body, 2),
        "decode_shape": shape(d.body, 2),
        "decode_finish_reason": d.body["meta_info"]["finish_reason"]["type"],
        "decode_completion_tokens": d.body["meta_info"]["completion_tokens"],
        "prefill_completion_tokens": p.body["meta_info"]["completion_tokens"],
    }


async def generate_input_ids(t: Target, client: httpx2.AsyncClient) -> Observables:
    p, d = await pd(t, client, "/generate", {"input_ids": [11, 12, 13, 14], **_no_text(GEN)})
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body, 2),
        "prompt_tokens": d.body["meta_info"]["prompt_tokens"],
    }


def _no_text(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "text"}


async def generate_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Streaming: 200 text/event-stream, events with meta_info, then `data: [DONE]`."""
    p, (d, events) = await pd_stream(t, client, "/generate", GEN)
    return {
        "status": [p.status, d.status],
        "decode_content_type": d.content_type.split(";")[0],
        "prefill_content_type": p.content_type.split(";")[0],
        "first_event_shape": shape(events[0], 2),
        "ends_with_done": events[-1] == "[DONE]",
    }


async def chat(t: Target, client: httpx2.AsyncClient) -> Observables:
    """OpenAI chat: no top-level `meta_info` (entrypoints/openai/protocol.py)."""
    p, d = await pd(t, client, "/v1/chat/completions", CHAT)
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body, 3),
        "has_meta_info": "meta_info" in d.body,
        "finish_reason": d.body["choices"][0]["finish_reason"],
    }


async def chat_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    p, (d, events) = await pd_stream(t, client, "/v1/chat/completions", CHAT)
    return {
        "status": [p.status, d.status],
        "decode_content_type": d.content_type.split(";")[0],
        "first_event_shape": shape(events[0], 3),
        "any_event_has_meta_info": any(isinstance(e, dict) and "meta_info" in e for e in events),
        "ends_with_done": events[-1] == "[DONE]",
    }


async def completions(t: Target, client: httpx2.AsyncClient) -> Observables:
    p, d = await pd(t, client, "/v1/completions", {"prompt": "once upon", "max_tokens": 4})
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body, 3),
        "has_meta_info": "meta_info" in d.body,
    }


async def models(t: Target, client: httpx2.AsyncClient) -> Observables:
    r = await client.get(t.decode_url + "/v1/models", headers=headers(t.api_key))
    return {"status": r.status_code, "shape": shape(r.json(), 3)}


async def chat_n2_rid_list(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Chat `n=2` with a list of 2 rids: 400 "rids length mismatch" on both legs
    (managers/io_struct.py `_normalize_rid`: a rid list must have batch-size entries)."""
    body = {**CHAT, "n": 2, "rid": [fresh_rid("n2a"), fresh_rid("n2b")]}
    p, d = await pd(t, client, "/v1/chat/completions", body)
    return {
        "status": [p.status, d.status],
        "rids_length_mismatch": ["rids length mismatch" in a.error_message() for a in (p, d)],
        "envelope": d.error_envelope(),
    }


async def pd_n2_single_rid(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Chat `n=2`, one rid and one room: the prefill answers both choices, the decode hangs
    (one internal sample waits on the room for ever). The samples get fresh rids, so an abort
    by the request's rid does not free it; `abort_all` does (clean-up)."""
    rid = fresh_rid("n2")
    body = {**CHAT, "n": 2, "rid": rid, **bootstrap(t)}
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        dec = start(nursery, post(client, t.decode_url + "/v1/chat/completions", body, t.api_key))
        p = await post(client, t.prefill_url + "/v1/chat/completions", body, t.api_key)
        out["prefill_status"] = p.status
        out["prefill_choices"] = len(p.body["choices"]) if p.status == 200 else None
        with trio.move_on_after(HANG_SECS):
            await dec.done.wait()
        out["decode_hung"] = not dec.done.is_set()
        out["decode_busy_while_hung"] = await busy_count(client, t.decode_url) > 0
        await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key or t.api_key)
        with trio.move_on_after(2.0):
            await dec.done.wait()
        out["abort_by_rid_frees_it"] = dec.done.is_set()
        if not dec.done.is_set():
            await abort(client, t.decode_url, {"abort_all": True}, t.admin_api_key or t.api_key)
            with trio.fail_after(20):
                await dec.done.wait()
        assert dec.answer is not None
        out["decode_status_after_abort_all"] = dec.answer.status
    await wait_idle(client, t.decode_url)
    return out


async def get_load_gone(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`GET /get_load` no longer exists (404); loads are at `/v1/loads` (entrypoints/v1_loads)."""
    return {
        "status": [(await client.get(u + "/get_load")).status_code for u in _urls(t)],
    }


def _urls(t: Target) -> tuple[str, str]:
    return (t.prefill_url, t.decode_url)


async def v1_loads(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`GET /v1/loads`: per-DP-rank `loads`, each with a `disaggregation` section;
    `?include=` narrows the sections (entrypoints/v1_loads.py, managers/load_snapshot.py)."""
    out: Observables = {}
    for role, url in zip(("prefill", "decode"), _urls(t), strict=True):
        full = await loads(client, url)
        core = await loads(client, url, "?include=core")
        disagg = await loads(client, url, "?include=disagg")
        out[role] = {
            "shape": shape(full, 4),
            "num_ranks": len(full["loads"]),
            "disaggregation_mode": full["loads"][0]["disaggregation"]["mode"],
            "include_core_keys": sorted(core["loads"][0]),
            "include_disagg_keys": sorted(disagg["loads"][0]),
        }
    return out


async def server_info(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`GET /server_info` carries `dp_size` and `attn_dp_size` (the DP width is their
    product, runtime_context.py); `/get_server_info` is the deprecated alias."""
    out: Observables = {}
    for role, url in zip(("prefill", "decode"), _urls(t), strict=True):
        info = (await client.get(url + "/server_info")).json()
        alias = await client.get(url + "/get_server_info")
        out[role] = {
            "dp_size": info.get("dp_size"),
            "attn_dp_size": info.get("attn_dp_size"),
            "disaggregation_mode": info.get("disaggregation_mode"),
            "bootstrap_port_is_int": isinstance(info.get("disaggregation_bootstrap_port"), int),
            "has_version": isinstance(info.get("version"), str),
            "alias_status": alias.status_code,
            "alias_same_keys": sorted(alias.json()) == sorted(info),
        }
    return out


async def abort_prefix(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Aborting `X` aborts every live rid starting with `X` (managers/scheduler.py
    `startswith`): `X` and `X-retry1` both end; an unrelated `Y` stays; aborting `X-retry1`
    first leaves `X` alone. Answer: 200, empty body (entrypoints/http_server.py)."""
    x = fresh_rid("X")
    key = t.admin_api_key or t.api_key
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        jobs = {
            name: waiting_decode(t, client, nursery, "/generate", {**GEN, "rid": rid})
            for name, rid in (("X", x), ("X-retry1", x + "-retry1"), ("Y", fresh_rid("Y")))
        }
        await wait_busy(client, t.decode_url, 3)
        # The longer rid first: it must not take the shorter one with it.
        a1 = await abort(client, t.decode_url, {"rid": x + "-retry1"}, key)
        with trio.fail_after(10):
            await jobs["X-retry1"].done.wait()
        await trio.sleep(0.3)
        out["longer_rid_abort_spares_shorter"] = not jobs["X"].done.is_set()
        # Re-start the retry rid, then abort the short one: both go.
        jobs["X-retry1"] = waiting_decode(
            t, client, nursery, "/generate", {**GEN, "rid": x + "-retry1"}
        )
        await wait_busy(client, t.decode_url, 3)
        t0 = time.monotonic()
        a2 = await abort(client, t.decode_url, {"rid": x}, key)
        with trio.fail_after(10):
            await jobs["X"].done.wait()
            await jobs["X-retry1"].done.wait()
        out["abort_ms"] = round((time.monotonic() - t0) * 1000, 1)
        await trio.sleep(0.3)
        out["prefix_aborted"] = [jobs["X"].done.is_set(), jobs["X-retry1"].done.is_set()]
        out["unrelated_alive"] = not jobs["Y"].done.is_set()
        await abort(client, t.decode_url, {"abort_all": True}, key)
    answers = [jobs[n].answer for n in ("X", "X-retry1")]
    out["abort_answer"] = [a1.status, a1.text, a2.status, a2.text]
    out["aborted_status"] = [a.status for a in answers if a]
    out["aborted_message_says"] = ["Aborted by AbortReq" in a.error_message() for a in answers if a]
    out["aborted_envelope"] = answers[0].error_envelope() if answers[0] else None
    await wait_idle(client, t.decode_url)
    return out


async def abort_list_rid(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`/abort_request` takes one string rid; a list is a validation error (io_struct AbortReq)."""
    a = await abort(client, t.decode_url, {"rid": ["a", "b"]}, t.admin_api_key or t.api_key)
    return {"status": a.status, "envelope": a.error_envelope()}


async def abort_unknown_rid(t: Target, client: httpx2.AsyncClient) -> Observables:
    a = await abort(
        client, t.decode_url, {"rid": fresh_rid("nobody")}, t.admin_api_key or t.api_key
    )
    return {"status": a.status, "body": a.text}


async def duplicate_rid(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A second live request with the same rid is refused (managers/tokenizer_manager.py):
    a JSON 400 on /generate; on a stream, what the client sees."""
    rid = fresh_rid("dup")
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        first = waiting_decode(t, client, nursery, "/generate", {**GEN, "rid": rid})
        await wait_busy(client, t.decode_url, 1)
        second = await post(
            client, t.decode_url + "/generate", {**GEN, **bootstrap(t), "rid": rid}, t.api_key
        )
        stream_answer, events = await post_sse(
            client,
            t.decode_url + "/generate",
            {**GEN, **bootstrap(t), "rid": rid, "stream": True},
            t.api_key,
        )
        out["non_stream"] = {
            "status": second.status,
            "envelope": second.error_envelope(),
            "says_duplicate": "Duplicate request ID" in second.error_message(),
        }
        out["stream"] = {
            "status": stream_answer.status,
            "events": [shape(e, 2) for e in events],
            "says_duplicate": any("Duplicate request ID" in str(e) for e in events)
            or "Duplicate request ID" in stream_answer.text,
        }
        out["first_still_waiting"] = not first.done.is_set()
        await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key or t.api_key)
    await wait_idle(client, t.decode_url)
    return out


async def prefill_context_400(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A prompt longer than the prefill's --context-length but not the decode's: the prefill
    answers 400 at once, the decode keeps waiting for KV (it would for 300 s) until aborted;
    the abort frees it (500 "Aborted by AbortReq") and /v1/loads is idle again."""
    rid = fresh_rid("long")
    body = {"text": "word " * LONG_PROMPT_WORDS, "sampling_params": {"max_new_tokens": 4}}
    body = {**body, "rid": rid, **bootstrap(t)}
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        dec = start(nursery, post(client, t.decode_url + "/generate", body, t.api_key))
        p = await post(client, t.prefill_url + "/generate", body, t.api_key)
        out["prefill_status"] = p.status
        out["prefill_envelope"] = p.error_envelope()
        out["prefill_says_context"] = "context length" in p.error_message()
        await wait_busy(client, t.decode_url, 1)
        await trio.sleep(1.0)
        out["decode_waiting_after_prefill_400"] = not dec.done.is_set()
        t0 = time.monotonic()
        await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key or t.api_key)
        await dec.done.wait()
        out["decode_answer_ms"] = round((time.monotonic() - t0) * 1000, 1)
        freed = await wait_idle(client, t.decode_url)
        out["slot_freed_ms"] = round((time.monotonic() - t0) * 1000, 1)
        del freed
    assert dec.answer is not None
    out["decode_status"] = dec.answer.status
    out["decode_says_aborted"] = "Aborted by AbortReq" in dec.answer.error_message()
    return out


async def running_abort_openai(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A running (decoding) OpenAI request aborted: 200, `choices[*].finish_reason ==
    "abort"`, no top-level `meta_info`; the same on /generate shows
    `meta_info.finish_reason.type == "abort"`."""
    out: Observables = {}
    for route, body in (
        ("/v1/chat/completions", {**CHAT, "max_tokens": 400, "ignore_eos": True}),
        (
            "/generate",
            {"text": "go on", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        ),
    ):
        rid = fresh_rid("run")
        body = {**body, "rid": rid, **bootstrap(t)}
        async with trio.open_nursery() as nursery:
            dec = start(nursery, post(client, t.decode_url + route, body, t.api_key))
            p = await post(client, t.prefill_url + route, body, t.api_key)
            # Running on the decode: the KV has arrived and it is generating.
            with trio.fail_after(20):
                while True:
                    load = (await loads(client, t.decode_url))["loads"][0]
                    if load["num_running_reqs"] > 0 or dec.done.is_set():
                        break
                    await trio.sleep(0.01)
            await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key or t.api_key)
            await dec.done.wait()
        a = dec.answer
        assert a is not None
        entry: Observables = {"prefill_status": p.status, "status": a.status}
        if route == "/generate":
            entry["finish_reason"] = a.body["meta_info"]["finish_reason"]["type"]
        else:
            entry["has_meta_info"] = "meta_info" in a.body
            entry["finish_reasons"] = sorted({c["finish_reason"] for c in a.body["choices"]})
        out[route] = entry
    await wait_idle(client, t.decode_url)
    return out


async def waiting_abort_openai(t: Target, client: httpx2.AsyncClient) -> Observables:
    """An OpenAI request aborted while its decode waits for KV: an HTTP status with an
    OpenAI error object (`{"object": "error", ...}`), not a 200 with `finish_reason`."""
    out: Observables = {}
    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x"})):
        rid = fresh_rid("wait")
        async with trio.open_nursery() as nursery:
            dec = waiting_decode(t, client, nursery, route, {**body, "rid": rid})
            await wait_busy(client, t.decode_url, 1)
            await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key or t.api_key)
        a = dec.answer
        assert a is not None
        out[route] = {"status": a.status, "envelope": a.error_envelope()}
    return out


async def _disconnect(t: Target, client: httpx2.AsyncClient, stream: bool) -> float:
    """Seconds from the client closing a decode waiting for KV to /v1/loads idle."""
    body = {**GEN, **bootstrap(t), "rid": fresh_rid("disc"), "stream": stream}
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0)) as leaving:  # noqa: SIM117
        async with trio.open_nursery() as nursery:

            async def request() -> None:
                if stream:
                    async with leaving.stream("POST", t.decode_url + "/generate", json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                else:
                    await leaving.post(t.decode_url + "/generate", json=body)

            nursery.start_soon(request)
            await wait_busy(client, t.decode_url, 1)
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
    t0 = time.monotonic()
    await wait_idle(client, t.decode_url, timeout=15)
    return time.monotonic() - t0


async def disconnect_timing(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A closed connection: a stream is aborted at once, a non-stream one at the next 4 s poll
    of `request.is_disconnected()` (managers/tokenizer_manager.py,
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT)."""
    stream = await _disconnect(t, client, stream=True)
    non_stream = [await _disconnect(t, client, stream=False) for _ in range(2)]
    return {
        "stream_class": timing_class(stream),
        "non_stream_class": timing_class(max(non_stream)),
        "stream_ms": round(stream * 1000),
        "non_stream_ms": [round(s * 1000) for s in non_stream],
    }


async def room_zero(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Room 0 is the decode's "metadata not yet written" sentinel (disaggregation/utils.py):
    what a PD request with `bootstrap_room: 0` does, bounded."""
    body = {**GEN, "rid": fresh_rid("room0"), **bootstrap(t, 0)}
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        dec = start(nursery, post(client, t.decode_url + "/generate", body, t.api_key))
        p = await post(client, t.prefill_url + "/generate", body, t.api_key)
        with trio.move_on_after(HANG_SECS):
            await dec.done.wait()
        out["prefill_status"] = p.status
        out["decode_done"] = dec.done.is_set()
        out["decode_status"] = dec.answer.status if dec.answer else None
        if not dec.done.is_set():
            await abort(client, t.decode_url, {"rid": body["rid"]}, t.admin_api_key or t.api_key)
    await wait_idle(client, t.decode_url)
    return out


async def health_vs_ready(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`/health` runs a 1-token generation and waits in 1 s steps (≥ 1 s); `/ready` is cheap
    (entrypoints/http_server.py)."""
    out: Observables = {}
    for path in ("/health", "/ready"):
        secs = []
        statuses = []
        for _ in range(2):
            t0 = time.monotonic()
            statuses.append((await client.get(t.decode_url + path)).status_code)
            secs.append(time.monotonic() - t0)
        out[path] = {"status": statuses[0], "at_least_1s": min(secs) >= 0.95, "ms": _ms(secs)}
    return out


def _ms(secs: list[float]) -> list[float]:
    return [round(s * 1000, 1) for s in secs]


async def admin_key_abort(t: Target, client: httpx2.AsyncClient) -> Observables:
    """With --admin-api-key, /abort_request needs the admin key: the generation key (and no
    key) get 401 (utils/auth.py ADMIN_OPTIONAL). Needs a Target with both keys."""
    assert t.admin_api_key and t.api_key, "needs an engine started with both keys"
    rid = fresh_rid("adm")
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        dec = waiting_decode(t, client, nursery, "/generate", {**GEN, "rid": rid})
        await wait_busy(client, t.decode_url, 1, key=t.api_key)
        with_api_key = await abort(client, t.decode_url, {"rid": rid}, t.api_key)
        without_key = await abort(client, t.decode_url, {"rid": rid}, None)
        await trio.sleep(0.3)
        out["generation_key_status"] = with_api_key.status
        out["no_key_status"] = without_key.status
        out["still_waiting_after_refused_aborts"] = not dec.done.is_set()
        with_admin = await abort(client, t.decode_url, {"rid": rid}, t.admin_api_key)
        out["admin_key_status"] = with_admin.status
        with trio.fail_after(10):
            await dec.done.wait()
    out["server_info_status_with_api_key"] = (
        await client.get(t.decode_url + "/server_info", headers=headers(t.api_key))
    ).status_code
    await wait_idle(client, t.decode_url, key=t.api_key)
    return out


# Scenarios for the tier's main pair (prefill --context-length shorter than the decode's).
SCENARIOS: dict[str, Scenario] = {
    "generate_text": generate_text,
    "generate_input_ids": generate_input_ids,
    "generate_stream": generate_stream,
    "chat": chat,
    "chat_stream": chat_stream,
    "completions": completions,
    "models": models,
    "chat_n2_rid_list": chat_n2_rid_list,
    "pd_n2_single_rid": pd_n2_single_rid,
    "get_load_gone": get_load_gone,
    "v1_loads": v1_loads,
    "server_info": server_info,
    "abort_prefix": abort_prefix,
    "abort_list_rid": abort_list_rid,
    "abort_unknown_rid": abort_unknown_rid,
    "duplicate_rid": duplicate_rid,
    "prefill_context_400": prefill_context_400,
    "running_abort_openai": running_abort_openai,
    "waiting_abort_openai": waiting_abort_openai,
    "disconnect_timing": disconnect_timing,
    "room_zero": room_zero,
    "health_vs_ready": health_vs_ready,
}
# Scenarios for a pair started with --api-key and --admin-api-key.
ADMIN_SCENARIOS: dict[str, Scenario] = {"admin_key_abort": admin_key_abort}

# Observables that are measurements, not facts: recorded for the docs, never compared.
MEASURED_KEYS = frozenset(
    {"abort_ms", "stream_ms", "non_stream_ms", "decode_answer_ms", "slot_freed_ms", "ms"}
)


def comparable(observables: Any) -> Any:
    """The observables without the measured figures (what a live run must reproduce)."""
    if isinstance(observables, dict):
        return {k: comparable(v) for k, v in observables.items() if k not in MEASURED_KEYS}
    return observables


def differences(recorded: Any, live: Any, path: str = "$") -> list[str]:
    """Where a live run differs from the recording: values exactly, `*shape*` keys by shape."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        out = [f"{path}.{k}: missing" for k in recorded if k not in live]
        out += [f"{path}.{k}: unexpected" for k in live if k not in recorded]
        for k in recorded.keys() & live.keys():
            if "shape" in k or k == "events":
                out += shape_differences(recorded[k], live[k], f"{path}.{k}")
            else:
                out += differences(recorded[k], live[k], f"{path}.{k}")
        return out
    if recorded != live:
        return [f"{path}: recorded {recorded!r}, live {live!r}"]
    return []


def client() -> httpx2.AsyncClient:
    return httpx2.AsyncClient(timeout=httpx2.Timeout(60.0))
