"""`make bench-cache`, simulator half: which prefill policy makes the engines reuse the most KV.

A multi-turn trace (tenants with long shared system prompts, sessions growing a turn at a time)
is sent through TWO router replicas taking turns (as behind a load balancer), in front of the
same simulated engines: two prefills publishing SGLang's KV events with a small KV pool (so they
evict) and one decode. Each policy gets fresh engines and the same trace. The figure is the
engines' own count: cached tokens / prompt tokens over all prefills
(`testing/trio_pd_testing/engine/kv_events.py`), with wall time per request; the table is printed
and written to bench/results/cache-sim-*.json.
The real-engine half, with SMG 1.13, is `bench/cache_real.py` (`make bench-cache` runs both).

    .venv/bin/python -m bench.cache [--sessions 24] [--turns 6]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import zlib
from pathlib import Path

import attrs
import httpx2
import trio
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.harness import output
from tests.cluster import cluster_of, start_engine
from trio_pd.config import HealthConfig, PolicyConfig

KV = json.dumps(
    {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
)
HEALTH = HealthConfig(interval_secs=0.2, timeout_secs=1.0, failure_threshold=2, success_threshold=1)
POLICIES = ("random", "round_robin", "cache_aware", "kv_aware")


def word_id(word: str) -> int:
    return 100 + zlib.crc32(word.encode()) % 32000  # the simulator's (`workload.word_id`)


def vocabulary(count: int) -> list[str]:
    words: dict[int, str] = {}
    i = 0
    while len(words) < count:
        words.setdefault(word_id(f"v{i}"), f"v{i}")
        i += 1
    return list(words.values())


def write_tokenizer(directory: Path, words: list[str]) -> str:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: word_id(w) for w in words}}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)


def trace(words: list[str], tenants: int, sessions: int, turns: int, seed: int) -> list[str]:
    """Prompts in arrival order: sessions interleaved, each turn the whole conversation so far."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(tenants)]
    histories = [systems[s % tenants] for s in range(sessions)]
    out = []
    for _ in range(turns):
        for s in rng.sample(range(sessions), sessions):
            histories[s] += " " + " ".join(rng.choice(words) for _ in range(40))
            out.append(histories[s])
    return out


@attrs.define
class Row:
    policy: str
    prompt_tokens: int
    cached_tokens: int
    secs: float
    requests: int

    @property
    def ratio(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


async def run_policy(name: str, prompts: list[str], tokenizer: str, concurrency: int) -> Row:
    async with trio.open_nursery() as nursery:
        prefills = [
            await start_engine(
                nursery, "prefill", kv_events_config=KV, page_size=16, max_total_tokens=12_000
            )
            for _ in range(2)
        ]
        decodes = [await start_engine(nursery, "decode")]
        policy = (
            PolicyConfig(policy="round_robin", prefill_policy="kv_aware", tokenizer_path=tokenizer)
            if name == "kv_aware"
            else PolicyConfig(policy=name)
        )
        replicas = [
            await cluster_of(nursery, prefills, decodes, policy=policy, health=HEALTH)
            for _ in range(2)
        ]
        await trio.sleep(1.5)  # kv_aware: the subscriptions are made (a reconcile a second)
        queue = list(enumerate(prompts))
        started = time.perf_counter()

        async def client(index: int) -> None:
            async with httpx2.AsyncClient(timeout=60) as http:
                while queue:
                    n, text = queue.pop(0)
                    url = replicas[n % 2].url
                    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
                    answer = await http.post(url + "/generate", json=body)
                    assert answer.status_code == 200, answer.text

        async with trio.open_nursery() as clients:
            for i in range(concurrency):
                clients.start_soon(client, i)
        secs = time.perf_counter() - started
        prompt = sum(e.state.kv.prompt_tokens for e in prefills)
        cached = sum(e.state.kv.cached_tokens for e in prefills)
        for replica in replicas:
            await replica.client.aclose()
        nursery.cancel_scope.cancel()
    return Row(name, prompt, cached, secs, len(prompts))


async def main(args: argparse.Namespace) -> None:
    words = vocabulary(2000)
    prompts = trace(words, args.tenants, args.sessions, args.turns, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(Path(tmp), words)
        rows = [await run_policy(p, prompts, tokenizer, args.concurrency) for p in POLICIES]
    setup = "2 router replicas; 2 prefills (12k-token KV pools), 1 decode"
    print(f"{len(prompts)} requests, {args.tenants} tenants, {args.sessions} sessions x "
          f"{args.turns} turns; {setup}")  # fmt: skip
    print(f"{'policy':<14}{'cached/prompt':>15}{'prompt tokens':>15}{'ms/request':>12}")
    for row in rows:
        per = row.secs / row.requests * 1e3
        print(f"{row.policy:<14}{row.ratio:>15.3f}{row.prompt_tokens:>15}{per:>12.1f}")
    setup_line = f"{len(prompts)} requests, {args.tenants} tenants; {setup}"
    results = [{"policy": r.policy, "cached/prompt": round(r.ratio, 3),
                "prompt tokens": r.prompt_tokens, "ms/request": round(r.secs / r.requests * 1e3, 1)}
               for r in rows]  # fmt: skip
    print(f"written {output.write_result('cache-sim', {'setup': setup_line, 'rows': results})}")


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    trio.run(main, args)


if __name__ == "__main__":
    cli()
