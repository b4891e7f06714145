"""The bucket prefill policy: length ranges, the load window, imbalance, boundary adjustment.

The boundary vectors are the ones SMG 0.3.2's own tests pin down (src/policies/bucket.rs), run
here on trio's MockClock instead of wall-clock sleeps.
"""

import math
import random

import pytest
import trio

from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.fleet.bucket import BucketPolicy, adjusted_uppers, even_uppers
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.policies import make_policy
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker
from trio_pd.pd.payload import ROUTING_TEXT_LIMIT, inspect_body
from trio_pd.spec import WorkerSpec

BALANCE_OFF = {"balance_abs_threshold": 10**9}  # ranges alone decide


def prefills(n, model=None):
    return [
        Worker(spec=WorkerSpec(f"http://p{i}:8000", "prefill", model_id=model), id=f"prefill-{i}")
        for i in range(n)
    ]


def bucket(ws, interval=3, **config):
    policy = BucketPolicy(
        PolicyConfig(prefill_policy="bucket", bucket_adjust_interval_secs=interval, **config),
        random.Random(0),
    )
    for w in ws:
        policy.add_worker(w)
    return policy


def length(n, model=None):
    return RouteHints(text="a" * min(n, 10), length=n, model=model)


def send(policy, ws, *lengths):
    return [policy.choose(ws, length(n)) for n in lengths]


def uppers(policy, model=None):
    return policy.buckets[model].uppers


def test_initial_ranges_split_4096_evenly():
    assert even_uppers(3) == [1364, 2729, math.inf]
    assert even_uppers(1) == [math.inf]
    assert even_uppers(0) == []


async def test_lengths_go_to_the_worker_owning_their_range(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, **BALANCE_OFF)
    assert send(p, ws, 0, 1364, 1365, 2729, 2730, 10**6) == [
        ws[0],
        ws[0],
        ws[1],
        ws[1],
        ws[2],
        ws[2],
    ]


async def test_ranges_follow_the_lengths_seen_after_the_interval(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, interval=3, **BALANCE_OFF)
    send(p, ws, 5, 10, 15, 20, 24, 26)  # total 100: a third is 33 characters each
    assert uppers(p)[:2] == [1364, 2729]  # not adjusted before the interval
    assert p.buckets[None].owner(21) is ws[0]
    await trio.sleep(3)
    assert send(p, ws, 21) == [ws[1]]  # adjusted first: [0, 20] [21, 26] [27, ...]
    assert uppers(p) == [20, 26, math.inf]
    assert send(p, ws, 20, 27) == [ws[0], ws[2]]
    await trio.sleep(3.5)  # the window forgets the first round as the next one is recorded
    send(p, ws, 10, 20, 30, 40, 45, 57)  # total 202: 67 each, more than twice 33
    await trio.sleep(3)
    send(p, ws, 1)
    assert uppers(p) == [40, 57, math.inf]


async def test_second_smg_vector(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, **BALANCE_OFF)
    send(p, ws, 20)
    await trio.sleep(4)
    send(p, ws, 7)
    assert uppers(p) == [20, 27, math.inf]
    await trio.sleep(4)
    send(p, ws, 1)
    assert uppers(p) == [7, 10, math.inf]


async def test_ranges_stay_while_the_load_moves_less_than_twofold(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, **BALANCE_OFF)
    send(p, ws, 5, 10, 15, 20, 24, 26)
    await trio.sleep(3)
    send(p, ws, 0)  # adjusts (20, 26, a third of 100 each), then counts as traffic
    assert uppers(p) == [20, 26, math.inf]
    await trio.sleep(0.5)
    send(p, ws, 10, 20, 30, 32, 45, 55)  # total 192: 64 each, less than twice 33
    await trio.sleep(3)
    send(p, ws, 1)
    assert uppers(p) == [20, 26, math.inf]


def test_adjusted_uppers_walks_the_sorted_lengths():
    assert adjusted_uppers([26, 5, 24, 10, 20, 15], 3, 33) == [20, 26, math.inf]
    # A length below the range's start: the range is `share` wide instead.
    assert adjusted_uppers([33, 34, 34], 3, 33) == [33, 67, math.inf]
    # Lengths run out: the remaining ranges are `share` wide, the last open.
    assert adjusted_uppers([20], 3, 6) == [20, 27, math.inf]
    assert adjusted_uppers([], 2, 0) == [0, math.inf]
    assert adjusted_uppers([100], 1, 100) == [math.inf]


async def test_imbalance_sends_to_the_least_loaded(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, interval=10, balance_abs_threshold=32, balance_rel_threshold=1.0001)
    first, second, third = send(p, ws, 33, 34, 34)
    assert first is ws[0]  # balanced: the range owner
    assert second is not ws[0] and third not in (ws[0], second)  # 33 - 0 > 32: least loaded
    await trio.sleep(11)
    picks = send(p, ws, 33, 33, 33)  # adjusts first: [0, 33] [34, 67] [68, ...]
    assert uppers(p) == [33, 67, math.inf]
    assert picks[0] is ws[0]
    assert picks[1] is not ws[0] and picks[2] not in (ws[0], picks[1])


async def test_no_shedding_below_either_threshold(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, balance_abs_threshold=30, balance_rel_threshold=2.0)
    assert send(p, ws, 20, 8, 7) == [ws[0]] * 3  # 28 - 0 is within 30
    p = bucket(ws, balance_abs_threshold=5, balance_rel_threshold=3.0)
    picks = send(p, ws, 15, 5, 10, 7)
    assert picks[0] is ws[0] and picks[3] is ws[0]  # last: 15 vs 5 is not more than 3 times


async def test_the_load_window_forgets_old_requests(autojump_clock):
    ws = prefills(2)
    p = bucket(ws, interval=5, balance_abs_threshold=10, balance_rel_threshold=1.5)
    send(p, ws, 100)
    assert p.buckets[None].chars[ws[0]] == 100
    assert send(p, ws, 1) == [ws[1]]  # 100 vs 0: shed
    await trio.sleep(5.5)
    # Expired entries leave before the next choice reads the loads (SMG trims them only as
    # that request is recorded, so its choice still sees them): back to the range owner.
    assert send(p, ws, 1) == [ws[0]]
    assert p.buckets[None].chars == {ws[0]: 1, ws[1]: 0}
    assert p.buckets[None].total == 1


async def test_only_candidates_are_chosen(autojump_clock):
    ws = prefills(3)
    p = bucket(ws, **BALANCE_OFF)
    healthy = [ws[0], ws[2]]
    picks = send(p, healthy, *([2000] * 40))  # ws[1]'s range: a random candidate instead
    assert set(picks) == set(healthy)
    # An idle worker that is no candidate does not make the others look imbalanced.
    q = bucket(ws, balance_abs_threshold=10, balance_rel_threshold=1.5)
    send(q, [ws[0]], 500)
    send(q, [ws[2]], 500)
    assert q.buckets[None].chars == {ws[0]: 500, ws[1]: 0, ws[2]: 500}
    assert send(q, [ws[0], ws[2]], 5) == [ws[0]]  # balanced among candidates: the owner
    assert send(q, [ws[2], ws[1]], 5) == [ws[1]]  # a candidate at 0: shed to it


async def test_membership_change_resets_the_ranges_and_the_next_adjustment_recomputes(
    autojump_clock,
):
    ws = prefills(3)
    p = bucket(ws[:2], **BALANCE_OFF)
    send(p, ws[:2], 5, 10, 15, 20)
    await trio.sleep(3)
    send(p, ws[:2], 0)  # adjusts: 25 characters each
    assert uppers(p) == [15, math.inf]
    await trio.sleep(0.5)
    send(p, ws[:2], 5, 10, 15, 20)  # the same traffic again
    p.add_worker(ws[2])
    send(p, ws, 1)
    assert p.buckets[None].members == ws
    assert uppers(p) == [1364, 2729, math.inf]  # the even split over the new members
    assert p.buckets[None].chars[ws[2]] == 0 and p.buckets[None].chars[ws[0]] > 0
    await trio.sleep(2.5)
    send(p, ws, 3)
    # 17 characters each now, against 25 when last adjusted: less than twofold, yet the ranges
    # are recomputed from the window, since the membership changed.
    assert p.buckets[None].share == 17
    assert uppers(p) == [15, 20, math.inf]
    p.remove_worker(ws[1])
    assert p.buckets[None].members == [ws[0], ws[2]]
    assert uppers(p) == [2047, math.inf]


async def test_each_model_has_its_own_ranges(autojump_clock):
    a = prefills(2, "model-a")
    b = [Worker(spec=WorkerSpec(f"http://b{i}:8000", "prefill", model_id="model-b"), id=f"b{i}")
         for i in range(3)]  # fmt: skip
    p = bucket([*a, *b], **BALANCE_OFF)
    assert p.choose(a, length(3000, "model-a")) is a[1]
    assert p.choose(b, length(3000, "model-b")) is b[2]
    assert p.buckets["model-a"].members == a and p.buckets["model-b"].members == b


async def test_through_the_fleet(autojump_clock):
    config = RouterConfig(
        prefill=tuple(WorkerSpec(f"http://p{i}:8000", "prefill", 8998) for i in range(3)),
        decode=(WorkerSpec("http://d0:8000", "decode"),),
        policy=PolicyConfig(prefill_policy="bucket", policy="round_robin", **BALANCE_OFF),
    )
    fleet = Fleet(config, random.Random(0))
    for w in fleet.workers():
        w.healthy = True
    assert isinstance(fleet.policies["prefill"], BucketPolicy)
    prefill, decode = fleet.select_pair(length(3000))
    assert prefill is fleet.get("prefill-3") and decode is fleet.get("decode-1")
    fleet.get("prefill-3").healthy = False
    assert {fleet.select("prefill", length(3000)) for _ in range(30)} == {
        fleet.get("prefill-1"),
        fleet.get("prefill-2"),
    }
    fleet.remove("prefill-1")
    assert fleet.select("prefill", length(0)) is fleet.get("prefill-2")


def test_the_length_is_the_prompt_in_characters_uncapped():
    def inspected(path, body):
        import orjson

        result = inspect_body(path, orjson.dumps(body), 16, frozenset())
        return result.length, result.text

    assert inspected("/generate", {"text": "héllo"}) == (5, "héllo")
    assert inspected("/generate", {"text": ["abc", "de"]}) == (3, "abc")
    assert inspected("/generate", {"input_ids": [1, 2, 3]}) == (0, None)
    assert inspected("/v1/completions", {"prompt": "abcd"}) == (4, "abcd")
    chat = {"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]}
    assert inspected("/v1/chat/completions", chat) == (6, "ab\ncde")
    long = "x" * (ROUTING_TEXT_LIMIT + 10)
    assert inspected("/generate", {"text": long}) == (
        ROUTING_TEXT_LIMIT + 10,
        long[:ROUTING_TEXT_LIMIT],
    )
    # A long conversation: the routing text looks at the first 1024 messages (and parts of
    # each), the length counts every one of them.
    many = {"messages": [{"role": "user", "content": "x" * 99}] * 4000}
    assert inspected("/v1/chat/completions", many)[0] == 4000 * 100 - 1
    parts = [{"type": "text", "text": "y" * 49}] * 3000
    assert inspected("/v1/chat/completions", {"messages": [{"content": parts}]})[0] == 3000 * 50 - 1


def test_flags_follow_sglang_router():
    args = build_parser().parse_args(["serve", "--prefill-policy", "bucket"])
    policy = router_config(args).policy
    assert (policy.for_role("prefill"), policy.for_role("decode")) == ("bucket", "cache_aware")
    assert policy.bucket_adjust_interval_secs == 5
    assert (policy.balance_abs_threshold, policy.balance_rel_threshold) == (64, 1.5)
    made = make_policy("bucket", policy)
    assert isinstance(made, BucketPolicy)
    args = build_parser().parse_args(
        ["serve", "--prefill-policy", "bucket", "--bucket-adjust-interval-secs", "2"]
    )
    assert router_config(args).policy.bucket_adjust_interval_secs == 2


@pytest.mark.parametrize(
    "flags",
    [
        ["--policy", "bucket"],
        ["--decode-policy", "bucket"],
        ["--prefill-policy", "bucket", "--bucket-adjust-interval-secs", "0"],
    ],
)
def test_bucket_is_a_prefill_policy_only(flags, capsys):
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(["serve", *flags]))
    err = capsys.readouterr().err
    assert "--prefill-policy bucket" in err or "--bucket-adjust-interval-secs" in err
    with pytest.raises(ValueError, match="prefill policy"):
        PolicyConfig(decode_policy="bucket")


async def test_after_an_idle_spell_nothing_old_weighs(autojump_clock):
    """The window is trimmed before a choice reads it: a request routed long ago does not make
    its worker look loaded to the first request after a pause."""
    ws = prefills(2)
    policy = bucket(ws, interval=5)
    policy.choose(ws, length(3000))
    await trio.sleep(5.1)
    holder = policy.choose(ws, length(3000))  # ranges adjusted; the range owner takes it
    buckets = policy.buckets[None]
    assert holder is buckets.owner(3000)
    ranges = list(buckets.uppers)
    await trio.sleep(3600)
    assert buckets.chars[holder] == 3000  # its old load is still on the books...
    assert policy.choose(ws, length(3000)) is holder  # ...but no longer counts: not shed
    assert buckets.uppers == ranges
