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
import socket
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
# `ignore_eos`: the tier's weights are random and drawn anew at each start (`--load-format
# dummy`), so a sample may end at EOS ("stop") in one recording and not in the next.
GEN = {
    "text": "the tiny model says",
    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
}
CHAT = {
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 4,
    "ignore_eos": True,
}
COMPLETION = {"prompt": "once upon", "max_tokens": 4, "ignore_eos": True}
# The stream scenarios' length. SGLang's tokenizer manager hands a stream's handler every output
# queued since it last ran as one event (`_wait_one_response`), so on a busy machine a 4-token
# answer can come as its final event alone (vLLM's did, CI 2026-12-05): 16 tokens on every
# stream scenario, and the first event compared is the first before the finish (`first_delta`).
STREAM_TOKENS = 16
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


def shape(value: Any) -> Any:
    """Keys and types of a JSON value, at every depth; a list is the list of its elements'
    shapes (so a later element that differs shows, and so does the length)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value]
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


# How the recording says a field may vary between runs of the real engine (written into the
# recording by `python -m tests.sglang.record` as `shape_rules`, read back by the comparison):
# - `optional`: fields whose value is `null` in one answer and a value in another of the same
#   engine (a `null` elsewhere matches only a `null`);
# - `any_length`: lists whose length depends on the tokenizer (the real tiny BPE tokenizer and
#   the simulator's one-token-per-word differ), compared element by element (a longer list's
#   extra elements against the recording's last), and empty only where the recording is empty.
SHAPE_RULES: dict[str, list[str]] = {
    "optional": sorted(
        {
            # null until the radix cache hits (`managers/tokenizer_manager.py`)
            "cached_tokens_details",
        }
    ),
    "any_length": sorted(
        {
            "input_token_logprobs",
            "input_top_logprobs",
            "input_token_ids_logprobs",
            "output_ids",
            "output_token_logprobs",
            "output_top_logprobs",
            "content",  # choices[].logprobs.content: one entry per token
        }
    ),
}


def shape_differences(
    recorded: Any, live: Any, path: str = "$", rules: dict[str, list[str]] | None = None
) -> list[str]:
    """Where two shapes differ, strictly: a `null` matches only a `null` (unless the field is
    `optional` in `rules`), lists element by element (or by an `any_length` rule), no depth
    limit. `int` and `float` match each other (JSON numbers: Python writes 0 for 0.0 where a
    figure happens to be integral)."""
    rules = SHAPE_RULES if rules is None else rules
    if recorded == live:
        return []
    field = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if "null" in (recorded, live) and field in rules.get("optional", ()):
        return []
    if isinstance(recorded, str) and isinstance(live, str) and {recorded, live} <= {"int", "float"}:
        return []
    if isinstance(recorded, dict) and isinstance(live, dict):
        out = [f"{path}.{k}: missing" for k in recorded if k not in live]
        out += [f"{path}.{k}: unexpected" for k in live if k not in recorded]
        for k in sorted(recorded.keys() & live.keys()):
            out += shape_differences(recorded[k], live[k], f"{path}.{k}", rules)
        return out
    if isinstance(recorded, list) and isinstance(live, list):
        if field in rules.get("any_length", ()):
            if bool(recorded) != bool(live):
                return [f"{path}: recorded {len(recorded)} items, live {len(live)}"]
            # element by element, a longer live list's extra elements against the recording's
            # last (a prompt's first input logprob differs from the rest: both are checked)
            out = []
            for i, item in enumerate(live):
                model = recorded[min(i, len(recorded) - 1)]
                out += shape_differences(model, item, f"{path}[{i}]", rules)
            return out
        if len(recorded) != len(live):
            return [f"{path}: recorded {len(recorded)} items, live {len(live)}"]
        out = []
        for i, (r, v) in enumerate(zip(recorded, live, strict=True)):
            out += shape_differences(r, v, f"{path}[{i}]", rules)
        return out
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
        "prefill_shape": shape(p.body),
        "decode_shape": shape(d.body),
        "decode_finish_reason": d.body["meta_info"]["finish_reason"]["type"],
        "decode_completion_tokens": d.body["meta_info"]["completion_tokens"],
        "prefill_completion_tokens": p.body["meta_info"]["completion_tokens"],
    }


async def generate_input_ids(t: Target, client: httpx2.AsyncClient) -> Observables:
    p, d = await pd(t, client, "/generate", {"input_ids": [11, 12, 13, 14], **_no_text(GEN)})
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body),
        "prompt_tokens": d.body["meta_info"]["prompt_tokens"],
    }


def _no_text(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "text"}


async def generate_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """Streaming: 200 text/event-stream, events with meta_info, then `data: [DONE]`; the last
    event carries the finish_reason object (what in-band detection and the n > 1 merge read)."""
    body = {**GEN, "sampling_params": {**GEN["sampling_params"], "max_new_tokens": STREAM_TOKENS}}
    p, (d, events) = await pd_stream(t, client, "/generate", body)
    data = [e for e in events if e != "[DONE]"]
    return {
        "status": [p.status, d.status],
        "decode_content_type": d.content_type.split(";")[0],
        "prefill_content_type": p.content_type.split(";")[0],
        "first_event_shape": shape(first_delta(events)),
        "last_event_shape": shape(data[-1]),
        "event_kinds": event_kinds(events),
        "finish_reason": data[-1]["meta_info"]["finish_reason"],
        "ends_with_done": events[-1] == "[DONE]",
    }


def event_kind(event: Any) -> str:
    """What a stream event is to the router: `done`, `error`, `usage` (an OpenAI chunk with no
    choices and a usage), `finish` (a finish_reason set), or `delta`."""
    if event == "[DONE]":
        return "done"
    if not isinstance(event, dict):
        return type(event).__name__
    if "error" in event:
        return "error"
    choices = event.get("choices")
    if choices == [] and isinstance(event.get("usage"), dict):
        return "usage"
    if isinstance(choices, list) and any(c.get("finish_reason") for c in choices):
        return "finish"
    meta = event.get("meta_info")
    if isinstance(meta, dict) and meta.get("finish_reason"):
        return "finish"
    return "delta"


def event_kinds(events: list[Any]) -> list[str]:
    """The kinds of a stream's events in order, runs of `delta` collapsed to one."""
    out: list[str] = []
    for event in events:
        kind = event_kind(event)
        if not (kind == "delta" and out and out[-1] == "delta"):
            out.append(kind)
    return out


def first_delta(events: list[Any]) -> Any:
    """The stream's first event before its finish (a `delta`); its first event when none is."""
    return first_of(events, "delta") or events[0]


def first_of(events: list[Any], kind: str) -> Any:
    return next((e for e in events if event_kind(e) == kind), None)


async def chat(t: Target, client: httpx2.AsyncClient) -> Observables:
    """OpenAI chat: no top-level `meta_info` (entrypoints/openai/protocol.py)."""
    p, d = await pd(t, client, "/v1/chat/completions", CHAT)
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body),
        "has_meta_info": "meta_info" in d.body,
        "finish_reason": d.body["choices"][0]["finish_reason"],
    }


async def chat_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A chat stream with `stream_options.include_usage`: content chunks, a finish chunk, one
    usage chunk with no choices, `[DONE]` (what the n > 1 stream merge reads,
    entrypoints/openai/serving_chat.py)."""
    body = {**CHAT, "max_tokens": STREAM_TOKENS, "stream_options": {"include_usage": True}}
    p, (d, events) = await pd_stream(t, client, "/v1/chat/completions", body)
    finish = first_of(events, "finish")
    return {
        "status": [p.status, d.status],
        "decode_content_type": d.content_type.split(";")[0],
        "first_event_shape": shape(first_delta(events)),
        "finish_event_shape": shape(finish),
        "usage_event_shape": shape(first_of(events, "usage")),
        "event_kinds": event_kinds(events),
        "any_event_has_meta_info": any(isinstance(e, dict) and "meta_info" in e for e in events),
        "ends_with_done": events[-1] == "[DONE]",
    }


async def completions_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """The same on /v1/completions (serving_completions.py)."""
    body = {**COMPLETION, "max_tokens": STREAM_TOKENS, "stream_options": {"include_usage": True}}
    p, (d, events) = await pd_stream(t, client, "/v1/completions", body)
    return {
        "status": [p.status, d.status],
        "first_event_shape": shape(first_delta(events)),
        "finish_event_shape": shape(first_of(events, "finish")),
        "usage_event_shape": shape(first_of(events, "usage")),
        "event_kinds": event_kinds(events),
    }


async def completions(t: Target, client: httpx2.AsyncClient) -> Observables:
    p, d = await pd(t, client, "/v1/completions", COMPLETION)
    return {
        "status": [p.status, d.status],
        "decode_shape": shape(d.body),
        "has_meta_info": "meta_info" in d.body,
    }


async def models(t: Target, client: httpx2.AsyncClient) -> Observables:
    r = await client.get(t.decode_url + "/v1/models", headers=headers(t.api_key))
    return {"status": r.status_code, "shape": shape(r.json())}


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
    # One request first, so the decode's figures that start null (`decode_moments` until a
    # decode step ran) are in their steady form on every engine this runs against.
    await pd(t, client, "/generate", GEN)
    for role, url in zip(("prefill", "decode"), _urls(t), strict=True):
        full = await loads(client, url)
        core = await loads(client, url, "?include=core")
        disagg = await loads(client, url, "?include=disagg")
        out[role] = {
            "shape": shape(full),
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
            # The fields the router acts on (control/engine_info.py `parse_server_info`).
            "max_running_requests": info.get("max_running_requests"),
            "disaggregation_transfer_backend": info.get("disaggregation_transfer_backend"),
            "enable_dynamic_batch_tokenizer": info.get("enable_dynamic_batch_tokenizer"),
            "router_reads": server_info_view(info),
            "alias_status": alias.status_code,
            "alias_same_keys": sorted(alias.json()) == sorted(info),
        }
    return out


def server_info_view(info: dict) -> Observables:
    """The router's parse of `/server_info` (control/engine_info.py `parse_server_info`)."""
    from trio_pd.control.engine_info import parse_server_info

    parsed = parse_server_info(orjson.dumps(info))
    return {
        "dp_width": parsed.dp_width,
        "transfer_backend": parsed.transfer_backend,
        "max_running_requests": parsed.max_running_requests,
        "abort_latch_hazard": parsed.abort_latch_hazard,
    }


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
            "events": [shape(e) for e in events],
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
        entry: Observables = {
            "prefill_status": p.status,
            "status": a.status,
            "shape": shape(a.body),
        }
        if route == "/generate":
            # The whole object: in-band detection reads its `type`, `message`, `status_code`.
            entry["finish_reason"] = a.body["meta_info"]["finish_reason"]
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


async def generate_batch(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A batch of two prompts on /generate with a rid and a room per prompt: both legs answer a
    list, one object per prompt, in order, with the given rids (io_struct.py
    `_normalize_rid`, `_normalize_bootstrap_params`)."""
    r = room()
    rids = [fresh_rid("ba"), fresh_rid("bb")]
    body = {
        "text": ["the tiny model", "says hello"],
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        "rid": rids,
        "bootstrap_host": ["127.0.0.1", "127.0.0.1"],
        "bootstrap_port": [t.bootstrap_port, t.bootstrap_port],
        "bootstrap_room": [r, r + 1],
    }
    out: dict[str, Answer] = {}

    async def leg(name: str, url: str) -> None:
        out[name] = await post(client, url + "/generate", body, t.api_key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "prefill", t.prefill_url)
        nursery.start_soon(leg, "decode", t.decode_url)
    p, d = out["prefill"], out["decode"]
    return {
        "status": [p.status, d.status],
        "prefill_shape": shape(p.body),
        "decode_shape": shape(d.body),
        "decode_ids_are_the_rids": [item["meta_info"]["id"] for item in d.body] == rids,
        "decode_finish_types": [item["meta_info"]["finish_reason"]["type"] for item in d.body],
    }


async def input_logprobs(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`return_logprob` with `logprob_start_len: 0`: the prefill computes the prompt's input
    logprobs, the decode has none of its own (the router puts the prefill's in front of the
    decode's, pd/frames.py `merge_logprobs`)."""
    body = {
        **GEN,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    p, d = await pd(t, client, "/generate", body)
    out: Observables = {
        "status": [p.status, d.status],
        "prefill_shape": shape(p.body),
        "decode_shape": shape(d.body),
    }
    for name, a in (("prefill", p), ("decode", d)):
        meta = a.body["meta_info"]
        # Lengths relative to the prompt (the two tokenizers differ in length, not in rule).
        out[f"{name}_input_logprobs"] = {
            key: "prompt" if len(meta[key]) == meta["prompt_tokens"] else len(meta[key])
            for key in LOGPROB_LISTS
        }
        out[f"{name}_output_logprobs_minus_completion"] = (
            len(meta["output_token_logprobs"]) - meta["completion_tokens"]
        )
    return out


LOGPROB_LISTS = ("input_token_logprobs", "input_top_logprobs")


async def generate_n2_single_rid(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`n: 2` on /generate (`sampling_params.n`), one rid and one room: as on chat, the
    prefill answers both samples and the decode hangs on the room; `abort_all` frees it."""
    rid = fresh_rid("gn2")
    body = {
        "text": "the tiny model says",
        "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True},
        "rid": rid,
        **bootstrap(t),
    }
    key = t.admin_api_key or t.api_key
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        dec = start(nursery, post(client, t.decode_url + "/generate", body, t.api_key))
        p = await post(client, t.prefill_url + "/generate", body, t.api_key)
        out["prefill_status"] = p.status
        out["prefill_shape"] = shape(p.body)
        with trio.move_on_after(HANG_SECS):
            await dec.done.wait()
        out["decode_hung"] = not dec.done.is_set()
        await abort(client, t.decode_url, {"rid": rid}, key)
        with trio.move_on_after(2.0):
            await dec.done.wait()
        out["abort_by_rid_frees_it"] = dec.done.is_set()
        if not dec.done.is_set():
            await abort(client, t.decode_url, {"abort_all": True}, key)
            with trio.fail_after(20):
                await dec.done.wait()
        assert dec.answer is not None
        out["decode_status_after_abort_all"] = dec.answer.status
    await wait_idle(client, t.decode_url)
    return out


def load_view(answer: dict) -> Observables:
    """What the router reads of a `/v1/loads` answer: the raw figures of rank 0 and its own
    parse (control/engine_info.py `parse_v1_loads`: `queued` is what the overload veto reads,
    `waiting_for_kv` what it leaves out)."""
    from trio_pd.control.engine_info import parse_v1_loads

    load = answer["loads"][0]
    disagg = load.get("disaggregation") or {}
    parsed = parse_v1_loads(orjson.dumps(answer)).ranks[0]
    return {
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "queues": load.get("queues"),
        "disaggregation": {k: v for k, v in disagg.items() if k.endswith("_reqs")},
        "router_reads": {
            "running": parsed.running,
            "waiting": parsed.waiting,
            "waiting_for_kv": parsed.waiting_for_kv,
            "queued": parsed.queued,
        },
    }


async def loads_while_waiting_for_kv(t: Target, client: httpx2.AsyncClient) -> Observables:
    """`/v1/loads` of a decode holding a request whose room is registered with the prefill
    and whose KV never comes, and of a prefill holding one whose decode never registers
    (managers/scheduler_components/load_inquirer.py): a decode's KV waiters are in
    `num_waiting_reqs` *and* its prealloc/transfer queues, not queued for compute, so the
    router's `queued` stays 0 (fleet/overload.py); a prefill's request waiting for its decode's
    handshake is in `num_waiting_reqs` *and* its bootstrap queue, `queues.waiting` 0: the
    router's `queued` stays 0 there too (recorded as 1 before the router left the bootstrap
    queue out, 2026-12-05)."""
    key = t.admin_api_key or t.api_key
    out: Observables = {}
    async with trio.open_nursery() as nursery:
        rid = fresh_rid("kvw")
        dec = waiting_decode(t, client, nursery, "/generate", {**GEN, "rid": rid})
        await wait_busy(client, t.decode_url, 1)
        await trio.sleep(1.0)  # past the handshake: the room is registered, the KV awaited
        out["decode"] = load_view(await loads(client, t.decode_url, key=key))
        out["prefill_meanwhile"] = load_view(await loads(client, t.prefill_url, key=key))
        await abort(client, t.decode_url, {"rid": rid}, key)
        await dec.done.wait()
        await wait_idle(client, t.decode_url)
        rid = fresh_rid("bsw")
        pre = start(
            nursery,
            post(client, t.prefill_url + "/generate", {**GEN, **bootstrap(t), "rid": rid}, key),
        )
        await wait_busy(client, t.prefill_url, 1)
        await trio.sleep(1.0)
        out["prefill"] = load_view(await loads(client, t.prefill_url, key=key))
        await abort(client, t.prefill_url, {"rid": rid}, key)
        await pre.done.wait()
    await wait_idle(client, t.prefill_url)
    return out


async def abort_latch(t: Target, client: httpx2.AsyncClient) -> Observables:
    """The tokenizer manager's abort latch (`abort_sent`, tokenizer_manager.py) belongs to a
    request's state, not to its rid: a rid aborted, ended and used again is aborted again; an
    abort of a rid that ended is dropped and harms nobody."""
    key = t.admin_api_key or t.api_key
    rid = fresh_rid("latch")
    out: Observables = {}
    statuses, freed = [], []
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            dec = waiting_decode(t, client, nursery, "/generate", {**GEN, "rid": rid})
            await wait_busy(client, t.decode_url, 1)
            await trio.sleep(0.3)
            await abort(client, t.decode_url, {"rid": rid}, key)
            with trio.move_on_after(HANG_SECS):
                await dec.done.wait()
            freed.append(dec.done.is_set())
            if not dec.done.is_set():
                await abort(client, t.decode_url, {"abort_all": True}, key)
                await dec.done.wait()
        assert dec.answer is not None
        statuses.append(dec.answer.status)
        await wait_idle(client, t.decode_url)
        # The ended rid aborted again: dropped (nothing holds it), answer 200 as always.
        late = await abort(client, t.decode_url, {"rid": rid}, key)
        out.setdefault("abort_of_ended_rid", [late.status, late.text])
    out["abort_by_rid_frees_it"] = freed
    out["aborted_statuses"] = statuses
    return out


async def _stream_into(
    box: dict, done: trio.Event, client: httpx2.AsyncClient, url: str, body: dict, key: str | None
) -> None:
    try:
        box["answer"] = await post_sse(client, url, body, key)
    finally:
        done.set()


async def running_abort_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A running (decoding) stream aborted, on chat and /generate: how it ends (the finish
    event the router's in-band detection reads, pd/frames.py `inband_failure`)."""
    out: Observables = {}
    key = t.admin_api_key or t.api_key
    for route, body in (
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "max_tokens": 400,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/generate",
            {"text": "go on", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        ),
    ):
        rid = fresh_rid("runs")
        body = {**body, "rid": rid, **bootstrap(t), "stream": True}
        async with trio.open_nursery() as nursery:
            dec: dict[str, Any] = {}
            done = trio.Event()
            url = t.decode_url + route
            nursery.start_soon(_stream_into, dec, done, client, url, body, t.api_key)
            p = await post(client, t.prefill_url + route, body, t.api_key)
            with trio.fail_after(20):
                while True:
                    load = (await loads(client, t.decode_url))["loads"][0]
                    if load["num_running_reqs"] > 0 or done.is_set():
                        break
                    await trio.sleep(0.01)
            await abort(client, t.decode_url, {"rid": rid}, key)
            await done.wait()
        answer, events = dec["answer"]
        data = [e for e in events if e != "[DONE]"]
        finish = first_of(events, "finish")
        entry: Observables = {
            "prefill_status": p.status,
            "status": answer.status,
            "event_kinds": event_kinds(events),
            "finish_event_shape": shape(finish),
            "last_event_shape": shape(data[-1]),
        }
        if route == "/generate":
            entry["finish_reason"] = finish["meta_info"]["finish_reason"] if finish else None
        else:
            entry["finish_reasons"] = sorted({c["finish_reason"] for c in finish["choices"]})
            entry["usage_event_shape"] = shape(first_of(events, "usage"))
        out[route] = entry
    await wait_idle(client, t.decode_url)
    return out


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def unreachable_bootstrap(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A KV transfer that cannot start: the decode's request names a bootstrap port nobody
    listens on. The decode retries the prefill's parallel info (15 attempts, 1 s apart,
    disaggregation/decode.py `_ensure_prefill_info`), then aborts the receiver: the request
    fails with a 500 naming the failure (what the router sees of a failed KV handshake)."""
    port = closed_port()
    body = {**GEN, "rid": fresh_rid("unreach"), **bootstrap(t), "bootstrap_port": port}
    a = await post(client, t.decode_url + "/generate", body, t.api_key)
    await wait_idle(client, t.decode_url)
    message = a.error_message().replace(str(port), "<port>").replace(body["rid"], "<rid>")
    message = message.replace(str(body["bootstrap_room"]), "<room>")
    return {
        "status": a.status,
        "envelope": a.error_envelope(),
        "message": message,
        "shape": shape(a.body),
        "secs": round(a.secs, 1),
    }


async def waiting_abort_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    """A stream aborted while its decode waits for KV, on chat and /generate: what status and
    events the router sees before any token (pd/frames.py, pd/samples.py hold a stream's
    headers until its first event)."""
    out: Observables = {}
    key = t.admin_api_key or t.api_key
    for route, body in (("/v1/chat/completions", CHAT), ("/generate", GEN)):
        rid = fresh_rid("waits")
        body = {**body, "rid": rid, **bootstrap(t), "stream": True}
        async with trio.open_nursery() as nursery:
            dec: dict[str, Any] = {}
            done = trio.Event()
            url = t.decode_url + route
            nursery.start_soon(_stream_into, dec, done, client, url, body, t.api_key)
            await wait_busy(client, t.decode_url, 1)
            await trio.sleep(0.3)
            await abort(client, t.decode_url, {"rid": rid}, key)
            with trio.fail_after(10):
                await done.wait()
        answer, events = dec["answer"]
        out[route] = {
            "status": answer.status,
            "content_type": answer.content_type.split(";")[0],
            "envelope": answer.error_envelope(),
            "event_kinds": event_kinds(events),
            "event_shapes": [shape(e) for e in events if e != "[DONE]"],
        }
    await wait_idle(client, t.decode_url)
    return out


# Scenarios for the tier's main pair (prefill --context-length shorter than the decode's).
SCENARIOS: dict[str, Scenario] = {
    "generate_text": generate_text,
    "generate_input_ids": generate_input_ids,
    "generate_stream": generate_stream,
    "chat": chat,
    "chat_stream": chat_stream,
    "completions_stream": completions_stream,
    "generate_batch": generate_batch,
    "input_logprobs": input_logprobs,
    "generate_n2_single_rid": generate_n2_single_rid,
    "loads_while_waiting_for_kv": loads_while_waiting_for_kv,
    "abort_latch": abort_latch,
    "running_abort_stream": running_abort_stream,
    "unreachable_bootstrap": unreachable_bootstrap,
    "waiting_abort_stream": waiting_abort_stream,
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

# Scenarios whose `n: 2` samples share one bootstrap room: each can crash the prefill engine
# (SGLang 0.5.23, a race between the samples: tests/sglang/pairs.py `past_shared_room_crashes`
# runs them on the real tier, retried past that crash).
SHARED_ROOM = frozenset({"pd_n2_single_rid", "generate_n2_single_rid"})

# Scenarios for a pair started with --api-key and --admin-api-key.
ADMIN_SCENARIOS: dict[str, Scenario] = {"admin_key_abort": admin_key_abort}

# Observables that are measurements, not facts: recorded for the docs, never compared.
MEASURED_KEYS = frozenset(
    {"abort_ms", "stream_ms", "non_stream_ms", "decode_answer_ms", "slot_freed_ms", "ms", "secs"}
)


def comparable(observables: Any) -> Any:
    """The observables without the measured figures (what a live run must reproduce)."""
    if isinstance(observables, dict):
        return {k: comparable(v) for k, v in observables.items() if k not in MEASURED_KEYS}
    return observables


def differences(
    recorded: Any, live: Any, path: str = "$", rules: dict[str, list[str]] | None = None
) -> list[str]:
    """Where a live run differs from the recording: values exactly, `*shape*` keys by shape
    (`shape_differences`, with the recording's `shape_rules`)."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        out = [f"{path}.{k}: missing" for k in recorded if k not in live]
        out += [f"{path}.{k}: unexpected" for k in live if k not in recorded]
        for k in sorted(recorded.keys() & live.keys()):
            if "shape" in k or k == "events":
                out += shape_differences(recorded[k], live[k], f"{path}.{k}", rules)
            else:
                out += differences(recorded[k], live[k], f"{path}.{k}", rules)
        return out
    if recorded != live:
        return [f"{path}: recorded {recorded!r}, live {live!r}"]
    return []


def client() -> httpx2.AsyncClient:
    return httpx2.AsyncClient(timeout=httpx2.Timeout(60.0))
