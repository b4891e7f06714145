"""kv_aware over real sockets: simulated prefills publish SGLang's KV events over ZMQ, a real
router subscribes, and the prefill it picks is read from the engines' own logs."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.conftest import cluster_of, start_engine
from tests.router.fleet_tools import FAST_HEALTH, LOOSE, who_started
from tests.router.helpers import settle
from trio_pd.config import PolicyConfig
from trio_pd_testing.engine.bootstrap import FAKE_BOOTSTRAP_HOST


def word_id(word: str) -> int:
    """The simulator's token id of a word (`testing/trio_pd_testing/engine/workload.word_id`)."""
    return 100 + zlib.crc32(word.encode()) % 32000


def distinct_words(count: int) -> list[str]:
    """Words whose ids differ: a WordLevel tokenizer.json keeps one word per id."""
    words: dict[int, str] = {}
    i = 0
    while len(words) < count:
        words.setdefault(word_id(f"w{i}"), f"w{i}")
        i += 1
    return list(words.values())


WORDS = distinct_words(400)
PAGE = 4  # the engines' page size: the events' block size
KV_CONFIG = json.dumps(
    {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
)


def write_tokenizer(path: Path, shift: int = 0) -> str:
    """A tokenizer.json giving each word the simulator's own id (`workload.word_id`), or those
    ids shifted: the wrong tokenizer."""
    vocab = {"[UNK]": 0, **{w: word_id(w) + shift for w in WORDS}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


def prompt(seed: int, words: int = 40) -> str:
    return " ".join(WORDS[(seed * 37 + i * 7) % len(WORDS)] for i in range(words))


def policy(tokenizer: str, **knobs: Any) -> PolicyConfig:
    return PolicyConfig(
        policy="round_robin", prefill_policy="kv_aware", tokenizer_path=tokenizer, **knobs
    )


async def kv_cluster(nursery: trio.Nursery, tokenizer: str, n_prefill: int = 2, **knobs: Any):
    prefills = [
        await start_engine(nursery, "prefill", kv_events_config=KV_CONFIG, page_size=PAGE)
        for _ in range(n_prefill)
    ]
    decodes = [await start_engine(nursery, "decode")]
    return await router_for(nursery, prefills, decodes, tokenizer, **knobs)


async def router_for(nursery, prefills, decodes, tokenizer: str, **knobs: Any):
    cluster = await cluster_of(
        nursery, prefills, decodes, policy=policy(tokenizer, **knobs), health=FAST_HEALTH
    )
    await settle(lambda: True)
    await wait_states(cluster, "precise")
    return cluster


async def kv_of(cluster) -> dict[str, dict[str, Any]]:
    workers = (await cluster.client.get("/workers")).json()["workers"]
    return {w["url"]: w["kv_events"] for w in workers if w["worker_type"] == "prefill"}


async def wait_states(cluster, state: str, urls: list[str] | None = None) -> None:
    with trio.fail_after(LOOSE):
        while True:
            kv = await kv_of(cluster)
            if all(kv[u]["state"] == state for u in (urls or kv)):
                return
            await trio.sleep(0.02)


async def wait_kv(cluster, url: str, check) -> dict[str, Any]:
    with trio.fail_after(LOOSE):
        while True:
            kv = (await kv_of(cluster))[url]
            if check(kv):
                return kv
            await trio.sleep(0.02)


async def warm(engine, text: str, room: int = 8) -> int:
    """Prefill `text` on `engine` directly (SGLang's fake bootstrap: no decode, no router)."""
    body = {
        "text": text,
        "bootstrap_host": FAKE_BOOTSTRAP_HOST,
        "bootstrap_room": room,
        "sampling_params": {"max_new_tokens": 1},
    }
    async with httpx2.AsyncClient() as client:
        answer = await client.post(engine.url + "/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["meta_info"]["cached_tokens"]


def test_the_test_tokenizer_is_the_simulators(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(write_tokenizer(tmp_path) + "/tokenizer.json")
    assert tokenizer.encode(prompt(3)).ids == [word_id(w) for w in prompt(3).split()]


async def routed(cluster, rid: str, text: str) -> int:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    answer = await cluster.client.post("/generate", json=body, headers={"x-request-id": rid})
    assert answer.status_code == 200, answer.text
    [p] = who_started(cluster.prefills, rid)
    return p


@pytest.fixture
def tokenizer(tmp_path: Path) -> str:
    return write_tokenizer(tmp_path / "model")


async def test_the_prefill_holding_the_prefix_gets_it(nursery, tokenizer) -> None:
    """Prompts prefilled on an engine behind the router's back go where their blocks are, and
    the engine confirms the reuse: the router learned it from the events alone."""
    cluster = await kv_cluster(nursery, tokenizer)
    urls = [e.url for e in cluster.prefills]
    holders = [0, 1, 1, 0, 1, 0]
    for seed, holder in enumerate(holders):
        assert await warm(cluster.prefills[holder], prompt(seed)) == 0
    for i in (0, 1):
        stored = holders.count(i) * 10  # 40 words: 10 blocks each
        await wait_kv(cluster, urls[i], lambda kv, n=stored: kv["blocks"] == n)
    for seed, holder in enumerate(holders):
        assert (
            await routed(cluster, f"kv-{seed}", prompt(seed) + f" {WORDS[1]} {WORDS[2]}") == holder
        )
    kv = await kv_of(cluster)
    for url in urls:  # predicted == reported: 36 of 42 tokens each time (at most len - 1)
        check = kv[url]["self_check"]
        assert check["samples"] == 3 and check["error"] == 0.0, check
        assert check["engine_hit_ratio"] > 0.8 and not check["tripped"]
    await cluster.client.aclose()


async def test_two_replicas_choose_the_same_prefill(nursery, tokenizer) -> None:
    cluster = await kv_cluster(nursery, tokenizer)
    other = await router_for(nursery, cluster.prefills, cluster.decodes, tokenizer)
    first = [await routed(cluster, f"a-{seed}", prompt(seed)) for seed in range(8)]
    assert set(first) == {0, 1}  # least loaded, ties drawn at random: both got some (p=1/128)
    for i, url in enumerate(e.url for e in cluster.prefills):
        stored = first.count(i) * 10
        await wait_kv(other, url, lambda kv, n=stored: kv["blocks"] == n)
    again = [await routed(other, f"b-{seed}", prompt(seed) + f" {WORDS[9]}") for seed in range(8)]
    assert again == first, (first, again, await kv_of(other))
    await cluster.client.aclose()
    await other.client.aclose()


async def test_a_gap_is_filled_from_the_replay_socket(nursery, tokenizer) -> None:
    cluster = await kv_cluster(nursery, tokenizer)
    engine, url = cluster.prefills[1], cluster.prefills[1].url
    engine.state.kv.drop_live(1)  # its next batch never reaches the subscriber live
    await warm(engine, prompt(1))
    await warm(engine, prompt(2))  # the next batch shows the gap
    kv = await wait_kv(cluster, url, lambda kv: kv["blocks"] == 20)
    assert kv["gaps"] == 1 and kv["replayed"] >= 1 and kv["lost"] == 0, kv
    assert await routed(cluster, "gap-1", prompt(1)) == 1
    await cluster.client.aclose()


async def test_flush_and_restart_resync_the_index(nursery, tokenizer) -> None:
    cluster = await kv_cluster(nursery, tokenizer)
    engine, url = cluster.prefills[1], cluster.prefills[1].url
    await warm(engine, prompt(1))
    await wait_kv(cluster, url, lambda kv: kv["blocks"] == 10)
    async with httpx2.AsyncClient() as client:
        assert (await client.post(engine.url + "/flush_cache")).status_code == 200
    kv = await wait_kv(cluster, url, lambda kv: kv["cleared"] == 1)
    assert kv["blocks"] == 0
    await warm(engine, prompt(2))
    await warm(engine, prompt(3))
    await wait_kv(cluster, url, lambda kv: kv["blocks"] == 20)
    engine.state.kv.restart()  # a new engine process: empty cache, sequence from 0
    await warm(engine, prompt(4))
    kv = await wait_kv(cluster, url, lambda kv: kv["restarts"] == 1 and kv["blocks"] == 10)
    assert kv["state"] == "precise" and not kv["partial"], kv
    assert await routed(cluster, "after-restart", prompt(4)) == 1
    await cluster.client.aclose()


async def test_a_worker_whose_events_stop_is_announced_and_falls_back(nursery, tokenizer) -> None:
    cluster = await kv_cluster(nursery, tokenizer, kv_events_stale_secs=0.2)
    for engine in cluster.prefills:
        engine.state.kv.pause()
    p = await routed(cluster, "quiet", prompt(5))  # stores 10 blocks: an event is due
    url = cluster.prefills[p].url
    await wait_states(cluster, "stale", [url])
    ready = (await cluster.client.get("/readiness")).json()
    assert ready["kv_events"][f"prefill-{p + 1}"] == "stale" and ready["degraded"], ready
    metrics = (await cluster.client.get("/metrics")).text
    assert (
        f'trio_pd_kv_events_precise{{role="prefill",url="{url}",worker="prefill-{p + 1}"}} 0.0'
        in metrics
    )
    for engine in cluster.prefills:
        engine.state.kv.pause(False)
    await warm(cluster.prefills[p], prompt(6))
    await wait_states(cluster, "precise", [url])
    await cluster.client.aclose()


async def test_the_self_check_trips_on_a_wrong_tokenizer(nursery, tmp_path) -> None:
    wrong = write_tokenizer(tmp_path / "wrong", shift=1)
    cluster = await kv_cluster(nursery, wrong, n_prefill=1)
    url = cluster.prefills[0].url
    for i in range(6):  # the same prompt: the engine reuses it, the index never sees it
        await routed(cluster, f"w-{i}", prompt(9))
    kv = await wait_kv(cluster, url, lambda kv: kv["state"] == "self_check_failed")
    assert kv["self_check"]["tripped"] and kv["self_check"]["engine_hit_ratio"] > 0.5, kv
    assert kv["self_check"]["predicted_hit_ratio"] == 0.0
    ready = (await cluster.client.get("/readiness")).json()
    assert ready["kv_events"]["prefill-1"] == "self_check_failed", ready
    await cluster.client.aclose()


async def test_the_kv_gauges_sync_across_processes(
    nursery, tokenizer, tmp_path, monkeypatch
) -> None:
    """With --workers N the gauges are mirrored into multiprocess gauges: each kv_aware gauge
    needs its combining mode (a missing one failed the sync)."""
    from prometheus_client import CollectorRegistry

    from trio_pd.observe.metrics import FleetCollector, SyncedGauges

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    cluster = await kv_cluster(nursery, tokenizer)
    router = cluster.router
    collector = FleetCollector(router.fleet, router.pool, lambda: 0)
    assert any(f.name == "trio_pd_kv_events_precise" for f in collector.collect())
    SyncedGauges(collector, CollectorRegistry()).sync()
    await cluster.client.aclose()


async def test_long_prompts_are_hashed_whole(nursery, tokenizer) -> None:
    """A prompt past the routing text's cap (32768 characters) is tokenized from the body, whole:
    routed to its holder, and the engine's report feeds the self-check."""
    cluster = await kv_cluster(nursery, tokenizer)
    url = cluster.prefills[1].url
    long = " ".join(prompt(seed) for seed in range(220))  # ~8,800 words, past the cap
    assert len(long) > 40_000
    await warm(cluster.prefills[1], long)
    await wait_kv(cluster, url, lambda kv: kv["blocks"] > 2000)
    assert await routed(cluster, "long", long + f" {WORDS[3]}") == 1
    check = (await kv_of(cluster))[url]["self_check"]
    assert check["samples"] == 1 and check["error"] == 0.0, check
    await cluster.client.aclose()


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def with_chat_template(path: str, template: str) -> str:
    """The test model with a chat template: the simulator's chat ids are its messages' words
    (`workload.parse_workload`), which this template renders."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(config))
    return path


async def routed_chat(cluster, rid: str, body: dict[str, Any]) -> int:
    answer = await cluster.client.post(
        "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2, **body},
        headers={"x-request-id": rid},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    [p] = who_started(cluster.prefills, rid)
    return p


async def test_chat_and_token_ids_route_by_what_the_engine_holds(nursery, tokenizer) -> None:
    """A chat request is scored by the ids of the model's chat template, `/generate` and
    completions `input_ids` by the ids as given (nothing tokenized); a chat the router cannot
    render as the engine does (tools, media) is left to the approximate tree."""
    cluster = await kv_cluster(nursery, with_chat_template(tokenizer, CHAT_TEMPLATE))
    urls = [e.url for e in cluster.prefills]
    for seed, holder in ((1, 1), (2, 0), (3, 1)):
        await warm(cluster.prefills[holder], prompt(seed))
    await wait_kv(cluster, urls[1], lambda kv: kv["blocks"] == 20)
    await wait_kv(cluster, urls[0], lambda kv: kv["blocks"] == 10)
    policy = cluster.router.fleet.kv_policy()
    words = prompt(1).split()
    chat = {"messages": [
        {"role": "system", "content": " ".join(words[:17])},
        {"role": "user", "content": [{"type": "text", "text": " ".join(words[17:])}]},
        {"role": "user", "content": f"{WORDS[5]} {WORDS[6]}"},
    ]}  # fmt: skip
    assert await routed_chat(cluster, "chat-1", chat) == 1
    ids = [word_id(w) for w in prompt(2).split()] + [word_id(WORDS[7])]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    answer = await cluster.client.post("/generate", json=body, headers={"x-request-id": "ids-2"})
    assert answer.status_code == 200, answer.text
    assert who_started(cluster.prefills, "ids-2") == [0]
    completion = {"model": "sim-model", "prompt": [word_id(w) for w in prompt(3).split()]}
    answer = await cluster.client.post(
        "/v1/completions", json={**completion, "max_tokens": 2}, headers={"x-request-id": "ids-3"}
    )
    assert answer.status_code == 200, answer.text
    assert who_started(cluster.prefills, "ids-3") == [1]
    assert (policy.precise_choices, policy.fallback_choices) == (3, 0)  # all three by the index
    kv = await kv_of(cluster)
    assert kv[urls[0]]["self_check"]["samples"] == 1  # /generate reported its cached tokens
    assert kv[urls[0]]["self_check"]["error"] == 0.0, kv
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    await routed_chat(cluster, "chat-tools", {**chat, "tools": tools})
    await routed_chat(cluster, "chat-none", {**chat, "tools": tools, "tool_choice": "none"})
    assert (policy.precise_choices, policy.fallback_choices) == (4, 1)  # tools: approximate
    await cluster.client.aclose()


async def test_every_dp_rank_is_followed(nursery, tokenizer) -> None:
    """A prefill with two DP ranks publishes on two ports (base + rank); a prompt cached on its
    rank 1 only is found there."""
    prefills = [
        await start_engine(nursery, "prefill", kv_events_config=KV_CONFIG, page_size=PAGE),
        await start_engine(
            nursery, "prefill", kv_events_config=KV_CONFIG, page_size=PAGE, dp_size=2
        ),
    ]
    decodes = [await start_engine(nursery, "decode")]
    cluster = await router_for(nursery, prefills, decodes, tokenizer)
    url = prefills[1].url
    assert (await kv_of(cluster))[url]["ranks"] == 2
    await warm(prefills[1], prompt(4), room=1)  # follow_bootstrap_room: room 1 is rank 1
    assert prefills[1].state.kv.publishers[1].published == 1  # it landed on rank 1
    await wait_kv(cluster, url, lambda kv: kv["blocks"] == 10)
    assert await routed(cluster, "dp", prompt(4)) == 1
    await cluster.client.aclose()


async def test_workers_added_and_removed_are_subscribed_and_unsubscribed(
    nursery, tokenizer
) -> None:
    cluster = await kv_cluster(nursery, tokenizer, n_prefill=1)
    extra = await start_engine(nursery, "prefill", kv_events_config=KV_CONFIG, page_size=PAGE)
    spec = {"url": extra.url, "worker_type": "prefill", "bootstrap_port": extra.bootstrap_port}
    added = await cluster.admin.post("/workers", json=spec)
    assert added.status_code == 202, added.text
    await wait_states(cluster, "precise", [extra.url])
    feeds = cluster.router.fleet.kv_policy().feeds
    assert "prefill-2" in feeds.by_id
    await warm(extra, prompt(2))
    await wait_kv(cluster, extra.url, lambda kv: kv["blocks"] == 10)
    assert (await cluster.admin.delete("/workers/prefill-2")).status_code == 202
    await settle(lambda: "prefill-2" not in feeds.by_id, LOOSE)
    assert extra.url not in await kv_of(cluster)
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_a_prefill_back_from_failed_health_checks_is_resynced(nursery, tokenizer) -> None:
    """An engine restarted on its own ports publishes nothing until its first prefill: the
    router resubscribes a worker whose health checks failed once it is healthy again, so the
    cache it lost is gone from the index before any new event (the sequence going back to 0
    would only show at that event)."""
    cluster = await kv_cluster(nursery, tokenizer)
    engine, url = cluster.prefills[1], cluster.prefills[1].url
    await warm(engine, prompt(1))
    await wait_kv(cluster, url, lambda kv: kv["blocks"] == 10)
    engine.state.health_status = 503
    await wait_kv(cluster, url, lambda kv: kv["down"])
    engine.state.kv.restart()  # a new engine process meanwhile: empty cache, no event yet
    engine.state.health_status = 200
    kv = await wait_kv(cluster, url, lambda kv: kv["rejoins"] == 1)
    kv = await wait_kv(cluster, url, lambda kv: kv["state"] == "precise")
    assert kv["blocks"] == 0 and kv["restarts"] == 0 and not kv["partial"], kv
    assert (await kv_of(cluster))[cluster.prefills[0].url]["rejoins"] == 0
    await cluster.client.aclose()


async def test_evictions_leave_the_index_what_the_engine_holds(nursery, tokenizer) -> None:
    """A prefill with a 100-token KV pool evicts (BlockRemoved): the router's index holds the
    very blocks the engine does, and an evicted prompt is predicted as the engine reports it."""
    prefills = [
        await start_engine(
            nursery, "prefill", kv_events_config=KV_CONFIG, page_size=PAGE, max_total_tokens=100
        )
        for _ in range(2)
    ]
    cluster = await router_for(nursery, prefills, [await start_engine(nursery, "decode")],
                               tokenizer)  # fmt: skip
    engine, url = prefills[1], prefills[1].url
    for seed in range(4):  # 4 x 10 blocks into a 25-block pool
        await warm(engine, prompt(seed), room=8 + seed)
    kv = await wait_kv(cluster, url, lambda kv: kv["removed"] >= 15)
    [rank] = engine.state.kv.caches
    assert kv["blocks"] == len(rank.blocks) == 25 and kv["removed"] == 15, kv
    assert await routed(cluster, "kept", prompt(3) + f" {WORDS[4]}") == 1  # still held
    await routed(cluster, "evicted", prompt(0) + f" {WORDS[4]}")  # gone from both
    check = (await kv_of(cluster))[url]["self_check"]
    assert check["error"] == 0.0, check
    await cluster.client.aclose()


async def test_a_prompt_no_engine_holds_goes_where_it_went_before(nursery, tokenizer) -> None:
    """Rule 3: when no engine holds enough of a prompt (evicted, flushed), the approximate
    tree's routing history chooses, so a tenant stays on one prefill and its prefix is cached
    there again; the least loaded would scatter it (a 1 in 64 chance of passing here)."""
    cluster = await kv_cluster(nursery, tokenizer)
    first = [await routed(cluster, f"first-{seed}", prompt(seed)) for seed in range(6)]
    assert set(first) == {0, 1}, first  # by the tree: the prefill with the least routed text
    async with httpx2.AsyncClient() as client:
        for engine in cluster.prefills:
            assert (await client.post(engine.url + "/flush_cache")).status_code == 200
    for url in (e.url for e in cluster.prefills):
        await wait_kv(cluster, url, lambda kv: kv["cleared"] == 1 and kv["blocks"] == 0)
    policy = cluster.router.fleet.kv_policy()
    precise = policy.precise_choices
    again = [await routed(cluster, f"again-{seed}", prompt(seed) + " " + WORDS[seed])
             for seed in range(6)]  # fmt: skip
    assert again == first and policy.precise_choices == precise + 6, (first, again)
    await cluster.client.aclose()


def test_what_the_router_cannot_know_is_left_to_the_approximate_tree(tokenizer) -> None:
    """Media, both text and ids, batches of ids, tools, a chat without a template: no ids."""
    from trio_pd.fleet.kv_tokens import CHAT, COMPLETIONS, GENERATE, PromptTokenizer

    tok = PromptTokenizer(tokenizer)  # no chat template in this model directory
    ids = PromptTokenizer.prompt_ids
    text = prompt(1)
    assert ids(tok, GENERATE, json.dumps({"text": text}).encode()) == [
        word_id(w) for w in text.split()
    ]
    assert ids(tok, GENERATE, json.dumps({"input_ids": [5, 6]}).encode()) == [5, 6]
    for path, body in (
        (GENERATE, {"text": text, "image_data": "http://x/a.png"}),
        (GENERATE, {"text": text, "input_ids": [5]}),
        (GENERATE, {"input_ids": [5, -1]}),
        (GENERATE, {"input_ids": [5, True]}),
        (COMPLETIONS, {"prompt": [[5, 6]]}),
        (CHAT, {"messages": [{"role": "user", "content": text}]}),
    ):
        assert ids(tok, path, json.dumps(body).encode()) is None, body
    assert ids(tok, CHAT, json.dumps({"messages": [], "input_ids": [7]}).encode()) == [7]
    chat = PromptTokenizer(with_chat_template(tokenizer, CHAT_TEMPLATE))
    user = {"role": "user", "content": text}
    assert ids(chat, CHAT, json.dumps({"messages": [user]}).encode()) == [
        word_id(w) for w in text.split()
    ]
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    tools = [{"type": "function", "function": {"name": "f"}}]
    for body in (
        {"messages": [user], "tools": tools},
        {"messages": [{"role": "user", "content": [image]}]},
        {"messages": [user, {"role": "assistant", "content": "x", "tool_calls": [{}]}]},
        {"messages": [user], "continue_final_message": True},
        {"messages": [user], "chat_template_kwargs": {"tokenize": True}},
    ):
        assert ids(chat, CHAT, json.dumps(body).encode()) is None, body
