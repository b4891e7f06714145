"""Approximate radix tree over characters, shared by all workers (tenants) of one policy.

The layout follows SGLang's router (`tree.rs`): one compressed trie of request texts; every node
records the tenants that sent a text through it. Inserting a text for a tenant marks every node
on its path, so a tenant present at a node is present at all of the node's ancestors. `evict`
trims a tenant back under a cap by dropping its least recently used leaves.

A tenant's size is the memory its nodes hold, not their characters (SGLang counts characters):
each node costs `NODE_BYTES` (the node, its children dict, its tenant set, its LRU entry: 530
to 570 bytes a node measured with tracemalloc on CPython 3.11, rounded up) plus its text, a byte a
character for ASCII text and four for any other (CPython stores a string at the width of its
widest character). Counted in characters, prompts `"A" * k + "B"` added two nodes (~1 KB) for
one or two characters each, so a tree under a 64 Mi-character cap could hold gigabytes
(issue 26 N5); counted this way the cap bounds what the tree holds. A node carried by two
tenants counts for both: the sum of the tenants' sizes bounds the tree from above.

A walk (`match`, `insert`) takes at most `MAX_PATH_NODES` steps from the root: the same prompts
made a chain one node per character, and every request walked it (router CPU per request 1.9 ->
11.5 ms after 6,000 of them); a text's tail past that depth is neither matched nor recorded (a
split at the bound may push a node below it, where no walk reaches it and eviction drops it in
its turn). Real prompts branch where conversations part, tens of nodes deep.

"Approximate": the tree holds what the router sent, not what the engine's KV cache actually keeps.

LRU without timestamps or tree walks: each tenant keeps an ordered dict of the nodes it carries,
least recently touched first. An insert moves its path to the end leaf-first, so a node always
comes after all of its descendants that carry the tenant, and the head of the order is always
one of the tenant's leaves: eviction pops heads, O(evicted nodes), and never walks the tree.
(Splitting an edge puts the new node and its ancestors at the end of the other tenants' orders
too, refreshing a shared prefix a little early; the tree stays correct, the LRU approximate.)
Characters are Python code points, as SGLang counts `chars()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

MAX_PATH_NODES = 1024  # steps of one walk from the root
NODE_BYTES = 640  # what a node holds beside its text's characters (measured 530-570, 3.11)


def node_cost(text: str) -> int:
    """The memory a node with edge `text` holds, in bytes (`str.isascii` is O(1))."""
    return NODE_BYTES + (len(text) if text.isascii() else 4 * len(text))


class _Node(Generic[T]):
    __slots__ = ("children", "cost", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node[T] | None) -> None:
        self.text = text  # edge label from the parent; children are keyed by text[0]
        self.cost = node_cost(text)
        self.parent = parent
        self.children: dict[str, _Node[T]] = {}
        self.tenants: set[T] = set()


def _common_prefix_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of `edge` and `text[pos:]`; the caller knows it is >= 1."""
    lo, hi = 1, min(len(edge), len(text) - pos)
    while lo < hi:  # invariant: edge[:lo] matches; binary search with C-speed comparisons
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree(Generic[T]):
    def __init__(self) -> None:
        self.root: _Node[T] = _Node("", None)
        self._sizes: dict[T, int] = {}
        self._lru: dict[T, OrderedDict[_Node[T], None]] = {}  # oldest first, root excluded

    # -- queries -------------------------------------------------------------------------------

    def size(self, tenant: T) -> int:
        """Bytes held for `tenant`: its nodes' `cost` (0 if unknown)."""
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[T]:
        return list(self._sizes)

    def total_nodes(self) -> int:
        return sum(1 for _ in self._walk())

    def total_cost(self) -> int:
        """The cost of every node once, however many tenants carry it (diagnostics: a walk)."""
        return sum(node.cost for node in self._walk() if node is not self.root)

    def match(self, text: str, candidates: Collection[T]) -> tuple[int, list[T]]:
        """Longest prefix of `text` held by any of `candidates`.

        Returns (matched character count, the candidates holding exactly that deepest match).
        A partially matched edge counts for the characters it shares, as in SGLang.
        Does not touch the LRU order: `insert` for the chosen tenant does that.
        """
        live = [t for t in candidates if t in self._sizes]
        node = self.root
        pos = 0
        n = len(text)
        depth = 0
        while pos < n and live and depth < MAX_PATH_NODES:
            depth += 1
            child = node.children.get(text[pos])
            if child is None:
                break
            tenants = child.tenants
            deeper = [t for t in live if t in tenants]
            if not deeper:
                break
            live = deeper
            edge = child.text
            if text.startswith(edge, pos):
                pos += len(edge)
                node = child
                continue
            pos += _common_prefix_len(edge, text, pos)
            break
        return (pos, live) if pos else (0, [])

    # -- updates -------------------------------------------------------------------------------

    def insert(self, text: str, tenant: T) -> None:
        """Record that `text` was sent to `tenant`, touching every node on its path."""
        lru = self._lru.get(tenant)
        if lru is None:
            lru = self._lru[tenant] = OrderedDict()
            self._sizes[tenant] = 0
        node = self.root
        node.tenants.add(tenant)
        path: list[_Node[T]] = []
        added = 0
        pos = 0
        n = len(text)
        while pos < n and len(path) < MAX_PATH_NODES:
            first = text[pos]
            child = node.children.get(first)
            if child is None:
                leaf: _Node[T] = _Node(text[pos:], node)
                node.children[first] = leaf
                added += leaf.cost
                leaf.tenants.add(tenant)
                path.append(leaf)
                break
            edge = child.text
            if text.startswith(edge, pos):
                if tenant not in child.tenants:
                    added += child.cost
                    child.tenants.add(tenant)
                node = child
                pos += len(edge)
                path.append(child)
                continue
            # Split the edge: node -> mid(edge[:k]) -> child(edge[k:]). The child's tenants
            # now carry one node more: each is charged the difference.
            k = _common_prefix_len(edge, text, pos)
            mid: _Node[T] = _Node(edge[:k], node)
            mid.tenants = set(child.tenants)
            old_cost = child.cost
            child.text = edge[k:]
            child.cost = node_cost(child.text)
            grown = mid.cost + child.cost - old_cost
            sizes = self._sizes
            for other in child.tenants:
                sizes[other] += grown
                if other != tenant:  # mid, then its ancestors, after the child in their order
                    other_lru = self._lru[other]
                    other_lru[mid] = None
                    for ancestor in reversed(path):
                        other_lru.move_to_end(ancestor)
            child.parent = mid
            mid.children[child.text[0]] = child
            node.children[first] = mid
            if tenant not in mid.tenants:
                added += mid.cost
                mid.tenants.add(tenant)
            node = mid
            pos += k
            path.append(mid)
        for touched in reversed(path):  # leaf first: ancestors end up after descendants
            lru[touched] = None
            lru.move_to_end(touched)
        self._sizes[tenant] += added

    def remove_tenant(self, tenant: T) -> None:
        """Forget `tenant` entirely; nodes left without tenants are dropped."""
        lru = self._lru.pop(tenant, None)
        if lru is None:
            return
        for node in lru:  # descendants come before ancestors
            self._drop(node, tenant)
        self.root.tenants.discard(tenant)
        del self._sizes[tenant]

    def evict_tenant(self, tenant: T, max_size: int) -> None:
        """Drop `tenant`'s least recently used leaves until its size is <= max_size."""
        lru = self._lru.get(tenant)
        if lru is None:
            return
        size = self._sizes[tenant]
        while size > max_size and lru:
            node, _ = lru.popitem(last=False)
            size -= node.cost
            self._drop(node, tenant)
        self._sizes[tenant] = size

    def evict(self, max_size: int) -> None:
        for tenant, size in list(self._sizes.items()):
            if size > max_size:
                self.evict_tenant(tenant, max_size)

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _drop(node: _Node[T], tenant: T) -> None:
        node.tenants.discard(tenant)
        if not node.tenants and node.parent is not None:
            del node.parent.children[node.text[0]]

    def _walk(self) -> Iterator[_Node[T]]:
        """All nodes, pre-order (tests and diagnostics only)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
