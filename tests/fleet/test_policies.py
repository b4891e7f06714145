import random
import string
from collections import Counter

import pytest
import trio

from trio_pd.config import PolicyConfig
from trio_pd.fleet.hints import NO_HINTS, RouteHints
from trio_pd.fleet.policies import (
    CacheAwarePolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
    run_eviction,
)
from trio_pd.fleet.prefix_tree import PrefixTree, node_cost
from trio_pd.fleet.worker import Worker
from trio_pd.spec import WorkerSpec


def workers(n, role="decode"):
    return [Worker(spec=WorkerSpec(f"http://w{i}:8000", role), id=f"{role}-{i}") for i in range(n)]


def hint(text):
    return RouteHints(text=text)


def words(rng, n):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def test_round_robin_order():
    ws = workers(3)
    p = RoundRobinPolicy()
    assert [p.choose(ws, NO_HINTS) for _ in range(7)] == [
        ws[0],
        ws[1],
        ws[2],
        ws[0],
        ws[1],
        ws[2],
        ws[0],
    ]


def test_random_is_deterministic_and_spreads():
    ws = workers(4)
    p1, p2 = RandomPolicy(random.Random(42)), RandomPolicy(random.Random(42))
    seq1 = [p1.choose(ws, hint("x")) for _ in range(400)]
    seq2 = [p2.choose(ws, hint("x")) for _ in range(400)]
    assert seq1 == seq2
    assert seq1 != [RandomPolicy(random.Random(43)).choose(ws, hint("x")) for _ in range(400)]
    counts = Counter(seq1)
    assert set(counts) == set(ws)
    assert all(60 < c < 140 for c in counts.values())


async def test_power_of_two_picks_lower_load():
    ws = workers(2)
    ws[0].in_flight = 5
    ws[1].in_flight = 1
    p = PowerOfTwoPolicy(random.Random(0))
    assert all(p.choose(ws, NO_HINTS) is ws[1] for _ in range(50))


async def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = workers(3)
    for w, load in zip(ws, (9, 1, 2), strict=True):
        w.in_flight = load
    p = PowerOfTwoPolicy(random.Random(5))
    picks = Counter(p.choose(ws, NO_HINTS) for _ in range(300))
    assert picks[ws[0]] == 0
    assert picks[ws[1]] > picks[ws[2]] > 0


async def test_power_of_two_uses_fresh_reported_load(autojump_clock):
    ws = workers(2)
    ws[0].report_load(50)
    p = PowerOfTwoPolicy(random.Random(0))
    assert all(p.choose(ws, NO_HINTS) is ws[1] for _ in range(20))
    await trio.sleep(ws[0].load_fresh_secs)  # report goes stale: both idle again
    assert ws[0].load() == 0


def test_make_policy_names():
    rng = random.Random(0)
    assert isinstance(make_policy("random", PolicyConfig(), rng), RandomPolicy)
    assert isinstance(make_policy("round_robin", PolicyConfig(), rng), RoundRobinPolicy)
    assert isinstance(make_policy("power_of_two", PolicyConfig(), rng), PowerOfTwoPolicy)
    assert isinstance(make_policy("cache_aware", PolicyConfig(), rng), CacheAwarePolicy)
    with pytest.raises(ValueError):
        make_policy("fastest", PolicyConfig(), rng)


# -- cache aware ---------------------------------------------------------------------------------


def test_cache_aware_repeated_prefix_goes_to_same_worker():
    ws = workers(4)
    p = CacheAwarePolicy(PolicyConfig(), random.Random(0))
    system = "You are a helpful assistant. " * 10
    first = p.choose(ws, hint(system + "question one"))
    for q in ("question two", "another thing entirely", "q3"):
        assert p.choose(ws, hint(system + q)) is first


def test_cache_aware_spreads_distinct_prefixes():
    ws = workers(4)
    p = CacheAwarePolicy(PolicyConfig(), random.Random(0))
    rng = random.Random(1)
    chosen = [p.choose(ws, hint(words(rng, 200))) for _ in range(4)]
    assert set(chosen) == set(ws)  # smallest tree wins for a miss
    many = Counter(p.choose(ws, hint(words(rng, 200))) for _ in range(40))
    assert set(many) == set(ws) and max(many.values()) - min(many.values()) <= 1


def test_cache_aware_threshold_decides_hit_or_miss():
    ws = workers(2)
    p = CacheAwarePolicy(PolicyConfig(cache_threshold=0.5), random.Random(0))
    a = p.choose(ws, hint("a" * 100))
    assert p.tree.size(a) == node_cost("a" * 100)  # bytes: the node and its text
    # 40 % match: below the threshold, so the smaller (empty) tree wins.
    assert p.choose(ws, hint("a" * 40 + "b" * 60)) is not a
    # 60 % match: above the threshold.
    assert p.choose(ws, hint("a" * 60 + "c" * 40)) is a


def test_cache_aware_sheds_load_only_when_both_thresholds_exceeded():
    ws = workers(2)
    cfg = PolicyConfig(balance_abs_threshold=10, balance_rel_threshold=2.0)
    p = CacheAwarePolicy(cfg, random.Random(0))
    text = "shared prefix " * 20
    hot = p.choose(ws, hint(text))
    cold = ws[1] if hot is ws[0] else ws[0]
    # abs 30 - 19 = 11 > 10, but rel 30 > 19 * 2 fails: still a cache hit
    hot.in_flight, cold.in_flight = 30, 19
    assert p.choose(ws, hint(text)) is hot
    # rel 10 > 1 * 2 holds, but abs 10 - 1 = 9 > 10 fails: still a cache hit
    hot.in_flight, cold.in_flight = 10, 1
    assert p.choose(ws, hint(text)) is hot
    # both exceeded -> least loaded, and the text is inserted for it
    hot.in_flight, cold.in_flight = 30, 2
    before = p.tree.size(cold)
    assert p.choose(ws, hint(text)) is cold
    assert p.tree.size(cold) == before + node_cost(text)


def test_cache_aware_no_text_goes_to_least_loaded():
    ws = workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 3, 1, 2
    p = CacheAwarePolicy(PolicyConfig(), random.Random(0))
    assert p.choose(ws, NO_HINTS) is ws[1]
    assert p.choose(ws, hint("")) is ws[1]
    assert p.tree.tenants() == []


def test_cache_aware_only_matches_among_candidates():
    ws = workers(3)
    p = CacheAwarePolicy(PolicyConfig(), random.Random(0))
    text = "x" * 300
    owner = p.choose(ws, hint(text))
    rest = [w for w in ws if w is not owner]
    assert p.choose(rest, hint(text)) in rest


def test_cache_aware_removed_worker_is_forgotten():
    ws = workers(2)
    p = CacheAwarePolicy(PolicyConfig(), random.Random(0))
    owner = p.choose(ws, hint("hello world " * 30))
    other = p.choose(ws, hint("zzz " * 30))
    assert owner is not other
    p.remove_worker(owner)
    assert p.tree.size(owner) == 0
    assert owner not in p.tree.tenants()
    assert p.tree.match("hello world " * 30, ws) == (0, [])
    # The nodes only the removed worker held are gone from the tree.
    assert p.tree.total_nodes() == 2  # root + the "zzz" leaf


def test_cache_aware_eviction_bounds_each_tree():
    ws = workers(2)
    p = CacheAwarePolicy(PolicyConfig(max_tree_size=10_000), random.Random(0))
    rng = random.Random(3)
    texts = [words(rng, 100) for _ in range(60)]
    sizes: dict = {w: [] for w in ws}
    for t in texts:
        chosen = p.choose(ws, hint(t))
        sizes[chosen].append(p.tree.size(chosen))
    for w in ws:
        # Between periodic evictions a tree grows, but never past twice the cap: an insert
        # that crosses it trims that tree at once.
        assert max(sizes[w]) > 15_000
        assert all(size <= 2 * 10_000 for size in sizes[w])
    p.evict()
    for w in ws:
        assert 8_000 < p.tree.size(w) <= 10_000
    # The most recent texts survive, the oldest are gone.
    matched, holders = p.tree.match(texts[-1], ws)
    assert matched == 100 and holders
    assert p.tree.match(texts[0], ws)[0] <= 1


async def test_run_eviction_runs_periodically(autojump_clock):
    calls = []

    class Counting:
        def evict(self):
            calls.append(trio.current_time())

    with trio.move_on_after(35):
        await run_eviction(Counting(), 10)
    assert calls == [10, 20, 30]


# -- prefix tree ---------------------------------------------------------------------------------


def test_tree_split_keeps_sizes_and_matches():
    t: PrefixTree[str] = PrefixTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    t.insert("help", "a")
    # "hel" and "lo " shared, "p" new: a size is its nodes' costs (bytes)
    assert t.size("a") == sum(map(node_cost, ("hel", "lo ", "world", "p")))
    assert t.size("b") == sum(map(node_cost, ("hel", "lo ", "there")))
    assert t.match("hello wor", ["a", "b"]) == (9, ["a"])
    assert t.match("hello xyz", ["a", "b"]) == (6, ["a", "b"])
    assert t.match("hello there!", ["a"]) == (6, ["a"])
    assert t.match("goodbye", ["a", "b"]) == (0, [])
    t.remove_tenant("a")
    assert t.match("help", ["a", "b"]) == (3, ["b"])


def test_tree_lru_eviction_prefers_old_leaves():
    t: PrefixTree[str] = PrefixTree()
    t.insert("aaaa", "x")
    t.insert("bbbb", "x")
    t.insert("aaaa", "x")  # touch: "bbbb" is now the LRU leaf
    t.evict_tenant("x", node_cost("aaaa"))
    assert t.size("x") == node_cost("aaaa")
    assert t.match("aaaa", ["x"]) == (4, ["x"])
    assert t.match("bbbb", ["x"]) == (0, [])


def check_tree(t):
    """Sizes match the nodes, tenants nest, and every tenant's LRU order is sound."""
    nodes = list(t._walk())
    for tenant in t.tenants():
        carrying = [n for n in nodes if tenant in n.tenants and n is not t.root]
        assert all(n.cost == node_cost(n.text) for n in carrying)
        assert sum(n.cost for n in carrying) == t.size(tenant)
        order = list(t._lru[tenant])
        assert set(order) == set(carrying)
        position = {n: i for i, n in enumerate(order)}
        for n in carrying:  # ancestors come after descendants
            if n.parent is not t.root:
                assert position[n] < position[n.parent]
    for node in nodes:
        if node.parent is not None:
            assert node.tenants and node.tenants <= node.parent.tenants
            assert node.parent.children[node.text[0]] is node


def test_tree_randomized_invariants():
    rng = random.Random(11)
    t: PrefixTree[int] = PrefixTree()
    for i in range(600):
        text = rng.choice(["sys A ", "sys B ", "sys", ""]) + words(rng, rng.randint(0, 30))
        t.insert(text, rng.randrange(4))
        if i % 100 == 99:
            check_tree(t)
            t.evict(3000)
            check_tree(t)
            assert all(t.size(x) <= 3000 for x in range(4))
    t.remove_tenant(2)
    check_tree(t)
    assert 2 not in t.tenants()
    assert all(2 not in n.tenants for n in t._walk())
