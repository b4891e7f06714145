"""The memory budget: bytes the router holds for request bodies and buffered answers, bounded
for the whole process (`--max-buffered-bytes`).

Every buffer a request makes the router hold is charged to its `Account` when it is made, and
given back when the request ends (or earlier, when the buffer is dropped): the client's body and
the legs' copy of it, the objects its JSON becomes while it is parsed (an estimate from the
body's bytes, counted before parsing starts: `parse_cost`), a whole non-streamed answer, a
partial SSE event. A charge the budget cannot take now raises `OverBudget`; one this request
could never get, even alone, says so (`never`): the caller answers 413 or 429 for a body, 502
or 503 for an answer. Nothing waits: a request that does not fit is refused at once, before the
router spends anything on it.

Counting is a few integer operations per buffer, never per byte.
"""

from __future__ import annotations

import attrs

from trio_pd.errors import RouterError

# What parsing JSON costs in Python objects, bounded from the text alone (measured with orjson
# 3 on CPython 3.11, `bench/memory.py`): at most 4 bytes per byte of text (a string holding one
# character beyond the BMP is stored at 4 bytes a character) plus up to ~100 bytes per structural
# character (`,` `:` `[` `{`: each begins a value or a key; the costliest are a dict of one key,
# ~97 bytes a mark nested deep, a short string in a list, 88, a list of one item, 80). The
# estimate takes 4 and 128: an upper bound with room for the allocator's slack.
PARSE_BYTES_PER_BYTE = 4
PARSE_BYTES_PER_MARK = 128
WORKER_COPIES = 3  # a parse off the loop: the pickled arguments, and the worker's two copies
RETRY_AFTER_SECS = b"1"
_NOT_MARKS = bytes(b for b in range(256) if b not in b",:[{")


def json_marks(data: bytes) -> int:
    """Structural characters of JSON text (also those inside strings: an upper bound), at C
    speed (~0.3 ns a byte): what `parse_cost` needs, counted chunk by chunk as a body arrives."""
    return len(data.translate(None, _NOT_MARKS))


def parse_cost(size: int, marks: int) -> int:
    """An upper bound of the memory parsing `size` bytes of JSON with `marks` structural
    characters builds (see PARSE_BYTES_PER_BYTE)."""
    return size * PARSE_BYTES_PER_BYTE + marks * PARSE_BYTES_PER_MARK


class OverBudget(Exception):
    """A charge the budget cannot take. `never`: this request alone exceeds the whole budget."""

    def __init__(self, wanted: int, limit: int, never: bool) -> None:
        super().__init__(f"{wanted} bytes wanted, budget {limit}")
        self.wanted = wanted
        self.limit = limit
        self.never = never


def over_budget(error: OverBudget, what: str) -> RouterError:
    """The client's answer to a charge of its request the budget refused: 429 while the budget
    is full, 413 when this request alone exceeds it."""
    if error.never:
        return RouterError(
            413,
            f"{what} needs ~{error.wanted} bytes of router memory, more than "
            f"--max-buffered-bytes {error.limit}",
            "payload_too_large",
        )
    return RouterError(
        429,
        f"the router's memory for request bodies is in use (--max-buffered-bytes "
        f"{error.limit}): try again",
        "rate_limit_error",
        headers=((b"retry-after", RETRY_AFTER_SECS),),
    )


@attrs.define(eq=False)
class MemoryBudget:
    """The process's budget; `limit` 0 or less: no budget (charges are counted, never refused)."""

    limit: int
    in_use: int = 0
    peak: int = 0  # the most ever held at once (metrics, tests)
    refused: int = 0  # charges refused so far

    def account(self) -> Account:
        return Account(self)

    def _take(self, account: Account, amount: int) -> None:
        limit = self.limit
        if limit > 0 and self.in_use + amount > limit:
            self.refused += 1
            raise OverBudget(account.held + amount, limit, account.held + amount > limit)
        self.in_use += amount
        if self.in_use > self.peak:
            self.peak = self.in_use


@attrs.define(eq=False)
class Account:
    """One request's share of the budget: what it holds now. `close` gives everything back."""

    budget: MemoryBudget
    held: int = 0

    def charge(self, amount: int) -> None:
        """Hold `amount` more bytes, or raise OverBudget (nothing is then held for it)."""
        if amount > 0:
            self.budget._take(self, amount)
            self.held += amount

    def release(self, amount: int) -> None:
        amount = min(amount, self.held)
        self.held -= amount
        self.budget.in_use -= amount

    def close(self) -> None:
        self.release(self.held)


@attrs.define(eq=False)
class Holding:
    """A buffer whose size changes (a partial SSE event): `resize` charges or gives back the
    difference, so the account always holds the buffer's current size."""

    account: Account | None
    size: int = 0

    def resize(self, size: int) -> None:
        account = self.account
        if account is None or size == self.size:
            return
        if size > self.size:
            account.charge(size - self.size)
        else:
            account.release(self.size - size)
        self.size = size

    def drop(self) -> None:
        self.resize(0)
