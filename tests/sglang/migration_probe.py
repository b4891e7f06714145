"""What a real SGLang 0.5.23 pair does to the facts migration (issue 29) builds on.

`python -m tests.sglang.migration_probe [--out FILE]` (under `flock /work/real-engine.lock`):
one pair, engine-direct (no router), prints one JSON document:

- `stream_shapes`: on `/generate`, is `text` cumulative and `output_ids` incremental per chunk,
  and what `meta_info` counts; the OpenAI routes' deltas and usage;
- `tokenize`: `/tokenize` with a prompt and with chat messages, against the `prompt_tokens` the
  engine reports for the same request;
- `resume_exact`: an uninterrupted greedy run, then the same request resumed at token k with
  `input_ids` = prompt ids + the first k output ids and `max_new_tokens` reduced by k: are the
  remaining ids (and text) the same? On `/generate` (text prompt) and chat (prompt rendered by
  `/tokenize` with `messages`, resumed on `/generate`);
- `sigterm_leader`, `sigterm_group`, `sigkill`: a decode streaming a long answer gets the signal
  after N events; what the client sees after it (more events? how it ends, how long), what a
  new request and `/ready` get meanwhile, and how long until the server is gone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from typing import Any

import httpx2
import orjson
import trio

from tests.sglang import pairs
from tests.sglang.scenarios import Target, bootstrap, fresh_rid
from trio_pd_testing.sglang import SGLangPair

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words"
MESSAGES = [{"role": "user", "content": PROMPT}]


async def sse(client: httpx2.AsyncClient, url: str, body: dict, on_event=None) -> dict[str, Any]:
    """Stream and record every event with its time; how the stream ended."""
    t0 = time.monotonic()
    events: list[Any] = []
    times: list[float] = []
    end = "eof"
    status = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else orjson.loads(data))
                times.append(time.monotonic())
                if on_event is not None:
                    on_event(len(events))
    except httpx2.HTTPError as e:
        end = f"error: {type(e).__name__}: {e}"
    ended_at = time.monotonic()
    return {"status": status, "events": events, "times": times, "t0": t0, "end": end,
            "ended_at": ended_at}  # fmt: skip


async def pd_sse(t: Target, client: httpx2.AsyncClient, path: str, body: dict, on_event=None):
    body = {**body, **bootstrap(t), "stream": True}
    out: dict[str, Any] = {}

    async def prefill() -> None:
        try:
            r = await client.post(t.prefill_url + path, json=body)
            out["prefill"] = r.status_code
        except httpx2.HTTPError as e:
            out["prefill"] = repr(e)

    async def decode() -> None:
        out["decode"] = await sse(client, t.decode_url + path, body, on_event)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefill)
        nursery.start_soon(decode)
    return out


async def pd_plain(t: Target, client: httpx2.AsyncClient, path: str, body: dict) -> Any:
    body = {**body, **bootstrap(t)}
    out: dict[str, Any] = {}

    async def leg(name: str, url: str) -> None:
        try:
            r = await client.post(url + path, json=body)
        except httpx2.HTTPError as e:  # an engine killed under the probe
            out[name] = (0, repr(e))
            return
        out[name] = (r.status_code, orjson.loads(r.content) if r.content else None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "prefill", t.prefill_url)
        nursery.start_soon(leg, "decode", t.decode_url)
    return out["decode"]


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


async def stream_shapes(t: Target, client: httpx2.AsyncClient) -> dict[str, Any]:
    gen = await pd_sse(t, client, "/generate", {"text": PROMPT, "sampling_params": greedy(6)})
    data = [e for e in gen["decode"]["events"] if e != "[DONE]"]
    texts = [e["text"] for e in data]
    ids = [e.get("output_ids") for e in data]
    plain = await pd_plain(t, client, "/generate", {"text": PROMPT, "sampling_params": greedy(6)})
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    common["stream_options"] = {"include_usage": True}
    chat = await pd_sse(t, client, "/v1/chat/completions", {"messages": MESSAGES, **common})
    comp = await pd_sse(t, client, "/v1/completions", {"prompt": PROMPT, **common})
    return {
        "generate_texts": texts,
        "generate_text_cumulative": all(b.startswith(a) for a, b in itertools.pairwise(texts)),
        "generate_output_ids_per_chunk": ids,
        "generate_plain_output_ids": plain[1]["output_ids"],
        "generate_plain_text": plain[1]["text"],
        "generate_meta_info_per_chunk": [
            {k: e["meta_info"].get(k) for k in ("prompt_tokens", "completion_tokens", "id")}
            | {"finish_reason": e["meta_info"].get("finish_reason")}
            for e in data
        ],
        "chat_events": chat["decode"]["events"],
        "completions_events": comp["decode"]["events"],
    }


async def tokenize(client: httpx2.AsyncClient, url: str, payload: dict) -> Any:
    r = await client.post(url + "/tokenize", json=payload)
    return r.status_code, orjson.loads(r.content)


async def resume_exact(t: Target, client: httpx2.AsyncClient) -> dict[str, Any]:
    n, k = 24, 9
    full = await pd_plain(t, client, "/generate", {"text": PROMPT, "sampling_params": greedy(n)})
    full_ids = full[1]["output_ids"]
    status, tok = await tokenize(client, t.prefill_url, {"prompt": PROMPT})
    prompt_ids = tok["tokens"]
    resumed = await pd_plain(
        t,
        client,
        "/generate",
        {"input_ids": prompt_ids + full_ids[:k], "sampling_params": greedy(n - k)},
    )
    # chat: rendered by the engine's /tokenize with the messages, resumed on /generate
    common = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
    chat_full = await pd_plain(t, client, "/v1/chat/completions", {"messages": MESSAGES, **common})
    chat_text = chat_full[1]["choices"][0]["message"]["content"]
    cstatus, ctok = await tokenize(client, t.prefill_url, {"messages": MESSAGES})
    chat_ids = ctok["tokens"]
    chat_gen = await pd_plain(
        t, client, "/generate", {"input_ids": chat_ids, "sampling_params": greedy(n)}
    )
    chat_gen_ids = chat_gen[1]["output_ids"]
    chat_resumed = await pd_plain(
        t,
        client,
        "/generate",
        {"input_ids": chat_ids + chat_gen_ids[:k], "sampling_params": greedy(n - k)},
    )
    # completions with token ids as the prompt
    comp_resumed = await pd_plain(
        t,
        client,
        "/v1/completions",
        {"prompt": chat_ids + chat_gen_ids[:k], **common, "max_tokens": n - k},
    )
    return {
        "tokenize_status": status,
        "tokenize_count": tok["count"],
        "engine_prompt_tokens": full[1]["meta_info"]["prompt_tokens"],
        "generate_full_ids": full_ids,
        "generate_resumed_ids": resumed[1]["output_ids"],
        "generate_exact": resumed[1]["output_ids"] == full_ids[k:],
        "generate_text_exact": full[1]["text"].endswith(resumed[1]["text"])
        and full[1]["text"] == _detok_join(full[1]["text"], resumed[1]["text"]),
        "generate_full_text": full[1]["text"],
        "generate_resumed_text": resumed[1]["text"],
        "generate_resumed_prompt_tokens": resumed[1]["meta_info"]["prompt_tokens"],
        "chat_tokenize_status": cstatus,
        "chat_tokenize_count": ctok["count"],
        "chat_engine_prompt_tokens": chat_full[1]["usage"]["prompt_tokens"],
        "chat_text": chat_text,
        "chat_via_generate_text": chat_gen[1]["text"],
        "chat_via_generate_same_text": chat_gen[1]["text"] == chat_text,
        "chat_resumed_exact": chat_resumed[1]["output_ids"] == chat_gen_ids[k:],
        "chat_resumed_text": chat_resumed[1]["text"],
        "completions_ids_prompt_status": comp_resumed[0],
        "completions_ids_prompt_text": (comp_resumed[1] or {}).get("choices", [{}])[0].get("text"),
        "completions_ids_prompt_usage": (comp_resumed[1] or {}).get("usage"),
    }


def _detok_join(full: str, tail: str) -> str:
    return full[: len(full) - len(tail)] + tail


async def signal_decode(
    pair: SGLangPair, t: Target, how: str, after_events: int = 20
) -> dict[str, Any]:
    """Stream 1500 tokens from the decode; send the signal after `after_events` events."""
    sent: dict[str, float] = {}
    during: dict[str, Any] = {}

    def on_event(count: int) -> None:
        if count == after_events and "at" not in sent:
            sent["at"] = time.monotonic()
            if how == "sigterm_leader":
                os.kill(pair.decode.pid, signal.SIGTERM)
            elif how == "sigterm_group":
                os.killpg(pair.decode.pid, signal.SIGTERM)
            else:
                os.killpg(pair.decode.pid, signal.SIGKILL)

    async with httpx2.AsyncClient(timeout=120) as client:

        async def probe_after() -> None:
            while "at" not in sent:
                await trio.sleep(0.01)
            await trio.sleep(0.5)
            try:
                r = await client.get(t.decode_url + "/ready", timeout=3)
                during["ready_0.5s"] = r.status_code
            except httpx2.HTTPError as e:
                during["ready_0.5s"] = type(e).__name__
            try:
                with trio.fail_after(10):
                    answer = await pd_plain(
                        t,
                        client,
                        "/generate",
                        {"text": PROMPT, "sampling_params": greedy(4), "rid": fresh_rid("new")},
                    )
                during["new_request"] = [answer[0], str(answer[1])[:300]]
            except (httpx2.HTTPError, trio.TooSlowError) as e:
                during["new_request"] = type(e).__name__

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe_after)
            out = await pd_sse(
                t,
                client,
                "/generate",
                {"text": PROMPT, "sampling_params": greedy(1500), "rid": fresh_rid(how)},
                on_event,
            )
    decode = out["decode"]
    at = sent.get("at", 0.0)
    after = [e for e, tm in zip(decode["events"], decode["times"], strict=True) if tm > at]
    last = [e for e in decode["events"] if e != "[DONE]"][-1:]
    meta = (last[0].get("meta_info") or {}) if last else {}
    end_secs = (decode["times"][-1] if decode["times"] else at) - at
    gone = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not pair.decode.pids():
            gone = time.monotonic() - at
            break
        await trio.sleep(0.1)
    return {
        "signal": how,
        "after_events": after_events,
        "events_after_signal": len(after),
        "last_event_secs_after_signal": round(end_secs, 3),
        "end": decode["end"],
        "done_seen": "[DONE]" in decode["events"],
        "last_finish_reason": meta.get("finish_reason"),
        "last_completion_tokens": meta.get("completion_tokens"),
        "stream_ended_secs_after_signal": round(decode["ended_at"] - at, 3),
        "group_gone_secs_after_signal": None if gone is None else round(gone, 2),
        "prefill_status": out["prefill"],
        **during,
    }


async def main_async(pair: SGLangPair, which: list[str]) -> dict[str, Any]:
    t = pairs.target(pair)
    report: dict[str, Any] = {}
    async with httpx2.AsyncClient(timeout=60) as client:
        if "shapes" in which:
            report["stream_shapes"] = await stream_shapes(t, client)
            report["resume_exact"] = await resume_exact(t, client)
            print(json.dumps(report, default=str), file=sys.stderr)
    # One signal per pair: a decode restarted on its old port once failed to bind it
    # ("address already in use") right after a SIGTERM drain, so each run ends with its signal.
    signals = [how for how in ("sigterm_leader", "sigterm_group", "sigkill") if how in which]
    if len(signals) > 1:
        raise SystemExit("one signal per run (--only shapes,sigkill, --only sigterm_group, ...)")
    for how in signals:
        report[how] = await signal_decode(pair, t, how)
        print(json.dumps(report[how]), file=sys.stderr)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--only", default="shapes,sigkill", help="comma list: shapes and at most one signal"
    )
    args = parser.parse_args()
    pair = SGLangPair.start(log_dir=pairs.LOG_DIR / "migration-probe", name="probe")
    try:
        report = trio.run(main_async, pair, args.only.split(","))
    finally:
        pair.stop()
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
