"""kv_aware against a real SGLang 0.5.23 pair whose prefill publishes KV events (issue 30).

The prefill runs with `--kv-events-config` (PUB + replay ROUTER on loopback); a real
`trio-pd serve --prefill-policy kv_aware --tokenizer-path <the model>` subscribes from what
`/server_info` advertises. The proof: the router's index, built from the engine's own events and
the router's own tokenization and hashing, predicts exactly the cached tokens the engine then
reports. The engine's `kv_events` descriptor and a live event batch are recorded
(`tests/data/sglang_0.5.23_kv_events.json`) for the simulator's differential test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2
import msgspec
import pytest
import zmq
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.sglang.conftest import ROUTER_FLAGS
from tests.sglang.scenarios import shape
from trio_pd.control.engine_info import parse_kv_events
from trio_pd.testing.sglang import SGLangPair
from trio_pd.testing.sglang.launcher import MODEL_DIR, distinct_free_ports

RECORD = Path(__file__).parent.parent / "data" / "sglang_0.5.23_kv_events.json"
# Its own pair (the prefill with --kv-events-config) would be a third and fourth server beside
# the tier's session pairs, so it runs alone, as `make test-sglang`'s second step:
# `TRIO_PD_SGLANG_TIER=1 TRIO_PD_SGLANG_KV=1 .venv/bin/python -m pytest
# tests/sglang/test_kv_aware_real.py` (tests/sglang/conftest.py collects it only then).
# 2026-12-04: 2 passed in 47 s.
PROMPT = " ".join(f"tenant seven system prompt line {i} says the same thing" for i in range(24))


@pytest.fixture(scope="module")
def kv_pair(log_dir: Path):
    pub, replay = distinct_free_ports(2)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    pair = SGLangPair.start(
        prefill_args=("--kv-events-config", json.dumps(config)), log_dir=log_dir, name="kv"
    )
    try:
        yield pair
    finally:
        pair.stop()


def _kv(router_url: str) -> dict:
    workers = httpx2.get(router_url + "/workers", timeout=10).json()["workers"]
    [prefill] = [w for w in workers if w["worker_type"] == "prefill"]
    return prefill["kv_events"]


def _until(check, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.2)


def test_the_index_predicts_what_the_engine_reuses(kv_pair, start_router) -> None:
    info = httpx2.get(kv_pair.prefill_url + "/server_info", timeout=10).json()["kv_events"]
    parsed = parse_kv_events(info)
    assert parsed is not None, info
    # A raw subscriber records one live batch as the engine encodes it.
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, info["topic"].encode())
    sub.connect(parsed.endpoints("127.0.0.1")[0][0])
    time.sleep(0.5)  # the subscription reaches the PUB socket
    router = start_router(
        kv_pair, *ROUTER_FLAGS, "--prefill-policy", "kv_aware", "--tokenizer-path", str(MODEL_DIR)
    )
    _until(lambda: _kv(router.url)["state"] == "precise")
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = httpx2.post(router.url + "/generate", json=body, timeout=120)
    assert first.status_code == 200, first.text
    frames = sub.recv_multipart() if sub.poll(30_000) else None
    assert frames is not None, "no KV event from the engine"
    stored = _until(lambda: _kv(router.url)["blocks"] > 0 and _kv(router.url))
    second = httpx2.post(router.url + "/generate", json=body, timeout=120)
    assert second.status_code == 200, second.text
    kv = _until(lambda: _kv(router.url)["self_check"]["samples"] >= 2 and _kv(router.url))
    check = kv["self_check"]
    # Predicted == reported on both: 0 on the first, the whole cached prefix on the second.
    assert check["error"] == 0.0 and check["engine_hit_ratio"] > 0.4, kv
    assert kv["state"] == "precise" and kv["gaps"] == 0, kv
    batch = msgspec.msgpack.decode(frames[2])
    RECORD.write_text(
        json.dumps(
            {
                "recorded": "sglang 0.5.23 on CPU, tiny llama, page_size 1, 2026-12-04",
                "server_info_kv_events": shape(info),
                "frames": len(frames),
                "seq_bytes": len(frames[1]),
                "batch": {
                    "length": len(batch),
                    "ts": shape(batch[0]),
                    "events": {e["type"]: shape(e) for e in batch[1]},
                    "attn_dp_rank": shape(batch[2]) if len(batch) > 2 else None,
                },
                "blocks_after_first_prompt": stored["blocks"],
            },
            indent=1,
        )
    )
    sub.close(linger=0)
    context.destroy(linger=0)


def test_flush_clears_and_a_wrong_tokenizer_trips(kv_pair, start_router, tmp_path) -> None:
    """`/flush_cache` publishes AllBlocksCleared (`RadixCache.reset`); a router tokenizing with
    another vocabulary predicts nothing the engine reuses, and its self-check says so."""
    router = start_router(
        kv_pair, *ROUTER_FLAGS, "--prefill-policy", "kv_aware", "--tokenizer-path", str(MODEL_DIR)
    )
    _until(lambda: _kv(router.url)["state"] == "precise")
    body = {"text": PROMPT + " again", "sampling_params": {"max_new_tokens": 2}}
    assert httpx2.post(router.url + "/generate", json=body, timeout=120).status_code == 200
    _until(lambda: _kv(router.url)["blocks"] > 0)
    assert httpx2.post(kv_pair.prefill_url + "/flush_cache", timeout=60).status_code == 200
    kv = _until(lambda: (k := _kv(router.url))["cleared"] >= 1 and k["blocks"] == 0 and k)
    assert kv["state"] == "precise", kv
    words = sorted(set(PROMPT.split()))
    vocab = {"[UNK]": 0, **{w: i + 5 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    wrong = start_router(
        kv_pair, *ROUTER_FLAGS, "--prefill-policy", "kv_aware", "--tokenizer-path", str(tmp_path)
    )
    _until(lambda: _kv(wrong.url)["state"] == "precise")
    for _ in range(6):
        answer = httpx2.post(wrong.url + "/generate", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
    kv = _until(lambda: (k := _kv(wrong.url))["state"] == "self_check_failed" and k)
    assert kv["self_check"]["engine_hit_ratio"] > 0.4, kv
    assert kv["self_check"]["predicted_hit_ratio"] == 0.0, kv
