"""One DP rank's KV blocks, as its engine's events said: a bounded set of block hashes.

A dict of hash -> None keeps insertion order, so the bound drops the oldest stored blocks first.
Dropping a block can only make the router predict less reuse than the engine has, never more:
the safe direction. Each entry costs about 100 bytes on CPython 3.11 (measured, `BLOCK_BYTES`):
the bound `--kv-index-max-blocks` (262144 a rank) is ~26 MB a rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BLOCK_BYTES = 100  # measured: a dict slot and a 64-bit int, amortized (docs/policies.md)


class BlockIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        self.blocks: dict[int, None] = {}
        self.dropped = 0  # blocks dropped by the bound (the engine may still hold them)

    def __len__(self) -> int:
        return len(self.blocks)

    def store(self, hashes: Iterable[int]) -> None:
        blocks = self.blocks
        for h in hashes:
            blocks.pop(h, None)  # stored again: now the newest
            blocks[h] = None
        excess = len(blocks) - self.max_blocks
        if excess > 0:
            for h in list(iter_first(blocks, excess)):
                del blocks[h]
            self.dropped += excess

    def remove(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)

    def clear(self) -> None:
        self.blocks.clear()

    def prefix(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, this rank holds (the chain breaks at a miss)."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


def iter_first(blocks: dict[int, None], count: int) -> Iterable[int]:
    for n, h in enumerate(blocks):
        if n >= count:
            return
        yield h
