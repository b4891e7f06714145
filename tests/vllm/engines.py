"""What the real vLLM engines saw, read from their own `/metrics` (and logs where nothing else
shows it); shared by the tier's tests, the recording and the simulator's differential test.

Waits are conditions polled until a bound, never sleeps as triggers: a KV read can stall up to
the prefill's 30 s lease on a loaded 2-core machine (issue 27), so every bound on "blocks freed"
is the lease plus a margin, and tests tell "freed by the read" from "freed by the lease" with
the prefill's `vllm:nixl_num_kv_expired_reqs` counter, not with a clock.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import trio
from prometheus_client.parser import text_string_to_metric_families

from trio_pd_testing.sglang.launcher import Engine
from trio_pd_testing.vllm import KV_LEASE_SECS, SERVED_MODEL_NAME, engine_metrics

# Blocks a finished request left are freed by the decode's read (ms) or at worst by the lease.
FREED_WITHIN_SECS = KV_LEASE_SECS + 30.0
MODEL = SERVED_MODEL_NAME


async def metrics(client: httpx2.AsyncClient, url: str) -> dict[str, float]:
    """Every sample of the engine's `/metrics`, summed over labels, by sample name (so a
    counter is `name_total`, a histogram's count `name_count`)."""
    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return engine_metrics.summed(r.text)


async def labelled(client: httpx2.AsyncClient, url: str, name: str) -> dict[str, float]:
    """The samples of one name keyed by their labels (engine and model dropped)."""
    r = await client.get(url + "/metrics")
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name:
                labels = {
                    k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")
                }
                key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def wait_for(
    client: httpx2.AsyncClient,
    url: str,
    condition: Callable[[dict[str, float]], bool],
    timeout: float,
    what: str,
) -> tuple[dict[str, float], float]:
    """Poll `/metrics` every 20 ms until `condition` holds; the snapshot and seconds taken."""
    t0 = time.monotonic()
    last: dict[str, float] = {}
    with trio.move_on_after(timeout):
        while True:
            last = await metrics(client, url)
            if condition(last):
                return last, time.monotonic() - t0
            await trio.sleep(0.02)
    raise AssertionError(f"{url}: {what} not seen within {timeout} s: {last}")


async def wait_kv_free(client: httpx2.AsyncClient, url: str, timeout: float = FREED_WITHIN_SECS):
    """Until the engine holds no KV block (`vllm:kv_cache_usage_perc` 0) and runs nothing."""
    return await wait_for(client, url, engine_metrics.idle, timeout, "no KV block held")


def completion(prompt: str = "the tiny model says", max_tokens: int = 4, **kw: Any) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **kw}


def chat(content: str = "hello there", max_tokens: int = 4, **kw: Any) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **kw,
    }


# Over the prefill's --max-model-len 512, under the decode's 2048 (3 tokens per "word").
LONG_PROMPT = "word " * 300


async def router_sum(client: httpx2.AsyncClient, metrics_url: str, name: str, **labels: str):
    """A `trio-pd serve`'s own metric (its `--prometheus-port`), summed over the samples whose
    labels include `labels`."""
    r = await client.get(metrics_url + "/metrics")
    r.raise_for_status()
    total = 0.0
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def wait_router(
    client: httpx2.AsyncClient,
    metrics_url: str,
    name: str,
    condition: Callable[[float], bool],
    what: str,
    timeout: float = FREED_WITHIN_SECS,
    **labels: str,
) -> float:
    """Poll the router's metric every 20 ms until `condition` holds on it."""
    value = 0.0
    with trio.move_on_after(timeout):
        while True:
            value = await router_sum(client, metrics_url, name, **labels)
            if condition(value):
                return value
            await trio.sleep(0.02)
    raise AssertionError(f"router {name}{labels}: {what} not seen within {timeout} s: {value}")


@contextlib.contextmanager
def stopped(engine: Engine) -> Iterator[None]:
    """The engine's whole process group (API server, engine core, NIXL's threads) stopped with
    SIGSTOP, continued on leaving: its kernel still accepts connections and queues what they
    carry, it reads and answers nothing. Makes "in flight on that engine" an event a test can
    wait for instead of a time it must guess."""
    os.killpg(engine.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(engine.pid, signal.SIGCONT)


EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
LATE = "vllm:nixl_num_notifications_after_expiry_total"
LATE_READ_SECS = 120.0  # a hang guard: late notifications came up to 2 minutes late
# The prefill's own lines for a lease that expired and for a read it was told of after that
# (vLLM 0.32: `base_worker.py` "Releasing expired KV blocks ...", `pull_worker.py` "Potentially
# invalid KV blocks for unrecognized request ..."; the counters EXPIRED and LATE count them).
EXPIRED_LINE = re.compile(rb"Releasing expired KV blocks for request (\S+) which were retrieved")
LATE_LINE = re.compile(rb"KV blocks for unrecognized request (\S+) were retrieved by a decode")


def lease_mark(pair: Any) -> int:
    """Where the prefill's log stands now: the leases a test left are those logged after it."""
    return int(pair.prefill.log_path.stat().st_size)


def leases_unread(pair: Any, mark: int) -> set[bytes]:
    """The prefill's leases that expired since `mark` with no read of them logged since."""
    with open(pair.prefill.log_path, "rb") as log:
        log.seek(mark)
        text = log.read()
    return set(EXPIRED_LINE.findall(text)) - set(LATE_LINE.findall(text))


async def expired_leases_were_read(client: httpx2.AsyncClient, pair: Any, mark: int) -> None:
    """Every lease of the prefill's that expired since `mark` was read by a decode, late. On
    this CPU the prefill's notification of a read came after its 30 s lease a few times a tier
    run (2026-12-05: the read done, the decode answering): the engine's slowness, not a lease
    the router left unread, which no read would ever follow. A late read is logged at the
    prefill's next engine step: a one-token request of its own (no handoff) makes one.

    By request, from the prefill's log, not by its counters: a lease that expired before the
    test (a fixture's warm-up read, an earlier test's) and was read late during it once made
    the counters' deltas disagree with nothing left unread (CI from a clean clone,
    2026-12-05)."""
    left = leases_unread(pair, mark)
    with trio.move_on_after(LATE_READ_SECS):
        while left:
            await client.post(
                pair.prefill_url + "/v1/completions", json=completion("nudge", max_tokens=1)
            )
            await trio.sleep(0.5)
            left = leases_unread(pair, mark)
    assert not left, ("leases the router left unread", left)
