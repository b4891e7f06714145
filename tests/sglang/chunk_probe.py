"""An abort landing while the prefill is mid chunked prefill (SGLang PR #35255's race), on a
real SGLang 0.5.23 pair.

`python -m tests.sglang.chunk_probe [--rounds N] [--out FILE]` (under `flock
/work/real-engine.lock`): one pair (two servers) whose prefill has `--chunked-prefill-size
128`, engine-direct (no router). The tier's main prefill chunks by 256 (`pairs.PREFILL_CHUNK`),
and its fault matrix runs `one_round` as a row (`test_abort_mid_chunked_prefill`); this probe
is the longer by-hand form (docs/protocol.md §10). Each round:

- a fresh ~850-token prompt's unfaulted answer (the reference), then `/flush_cache` so the
  round's request computes every chunk again;
- the same prompt as a PD request (both legs at once, one rid and room); the prefill's
  `/v1/loads` polled every 2 ms until it shows the request mid-chunks (KV tokens in use, fewer
  than the prompt's, nothing in the transfer queue);
- then what a router does on a client reset: both legs' connections closed and
  `/abort_request` to both engines. Measured from the engines' own counters: the time until
  both hold nothing and the prefill's KV tokens are back to 0;
- the same prompt once more, unfaulted: its answer must equal the reference (no garbled or
  crossed output), and both engines answer `/health`.

Prints one JSON document (per round: the trigger snapshot, release ms, equal-to-reference).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx2
import trio

from tests.sglang import pairs
from tests.sglang.faults import prompt
from tests.sglang.probe import held_of
from tests.sglang.scenarios import bootstrap, fresh_rid
from trio_pd_testing.sglang import SGLangPair

CHUNK = 128
WORDS = 280  # ~850 tokens of the tiny tokenizer: 7 chunks, under the prefill's 1024 context


async def snapshot(client: httpx2.AsyncClient, url: str) -> tuple[int, int, dict[str, int]]:
    return held_of((await client.get(url + "/v1/loads")).json())


async def pd_generate(client: httpx2.AsyncClient, pair: SGLangPair, text: str) -> dict[str, Any]:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "rid": fresh_rid("chunkref"),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair.bootstrap_port,
        "bootstrap_room": bootstrap(pairs.target(pair))["bootstrap_room"],
    }
    out: dict[str, Any] = {}

    async def leg(name: str, url: str) -> None:
        out[name] = (await client.post(url + "/generate", json=body)).json()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leg, "prefill", pair.prefill_url)
        nursery.start_soon(leg, "decode", pair.decode_url)
    return out["decode"]


async def one_round(client: httpx2.AsyncClient, pair: SGLangPair, seed: int) -> dict[str, Any]:
    text = prompt(seed, words=WORDS)
    reference = await pd_generate(client, pair, text)
    tokens = reference["meta_info"]["prompt_tokens"]
    flushed = (await client.post(pair.prefill_url + "/flush_cache")).status_code
    rid = fresh_rid("chunk")
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "rid": rid,
        **bootstrap(pairs.target(pair)),
    }
    trigger: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        legs = trio.CancelScope()

        async def both_legs() -> None:
            with legs:  # cancelled: the connections close (a client reset, as the router sees)
                async with trio.open_nursery() as inner:
                    for url in (pair.prefill_url, pair.decode_url):
                        inner.start_soon(lambda u=url: client.post(u + "/generate", json=body))

        nursery.start_soon(both_legs)
        with trio.fail_after(30):
            while True:
                held, used, queues = await snapshot(client, pair.prefill_url)
                inflight = queues.get("prefill_inflight_queue_reqs", 0)
                if 0 < used < tokens and not inflight:
                    trigger = {"held": held, "used_tokens": used, "queues": queues}
                    break
                if inflight:  # too late: the prefill finished every chunk
                    trigger = {"missed": True, "used_tokens": used, "queues": queues}
                    break
                await trio.sleep(0.002)
        t0 = time.monotonic()
        legs.cancel()
        for url in (pair.prefill_url, pair.decode_url):
            await client.post(url + "/abort_request", json={"rid": rid})
    with trio.fail_after(30):
        while True:
            p_held, p_used, _ = await snapshot(client, pair.prefill_url)
            d_held, _, _ = await snapshot(client, pair.decode_url)
            if p_held == 0 and p_used == 0 and d_held == 0:
                break
            await trio.sleep(0.002)
    release_ms = (time.monotonic() - t0) * 1e3
    after = await pd_generate(client, pair, text)
    health = [(await client.get(e.url + "/health")).status_code for e in pair.engines]
    return {
        "prompt_tokens": tokens,
        "flush_cache": flushed,
        "trigger": trigger,
        "mid_chunks": "missed" not in trigger,
        "release_ms": round(release_ms, 1),
        "after_equals_reference": after["text"] == reference["text"]
        and after.get("output_ids") == reference.get("output_ids"),
        "health": health,
    }


async def run(pair: SGLangPair, rounds: int) -> dict[str, Any]:
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(60.0)) as client:
        info = (await client.get(pair.prefill_url + "/server_info")).json()
        out: dict[str, Any] = {"prefill_chunked_prefill_size": info.get("chunked_prefill_size")}
        out["rounds"] = [await one_round(client, pair, 9000 + i) for i in range(rounds)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang.chunk_probe")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    pair = SGLangPair.start(
        prefill_args=("--chunked-prefill-size", str(CHUNK)),
        prefill_context_length=pairs.PREFILL_CONTEXT_LENGTH,
        log_dir=pairs.LOG_DIR,
        name="chunk",
    )
    try:
        result = trio.run(run, pair, args.rounds)
        result["prefill_log_mentions"] = {
            word: pair.prefill.log_text().count(word)
            for word in ("chunked", "abort", "Traceback", "leak")
        }
    finally:
        pair.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
