"""A generation request's body: read after its admission, within the memory budget, and inspected
without stalling the event loop.

The order is what keeps memory bounded by design (`generation.py` drives it):

1. A `Content-Length` past `--max-payload-size` is a 413 at once, as is one whose body could
   never fit the memory budget (`--max-buffered-bytes`), before the request waits for anything.
2. While the request waits for admission it reads at most `PREREAD_BYTES` of its body
   (`ClientBody.wait_in_line`): enough to hold a small body whole and see its client leave (the
   line then forgets it at once); a larger body stays in the kernel's buffers and hypercorn's
   bounded queue, where TCP holds its client back.
3. Admitted, the request charges its body to the budget (with a `Content-Length`: all of it at
   once; chunked: chunk by chunk), a 429 when the budget cannot take it now, a 413 when it never
   could, then reads the rest within `--client-body-timeout-secs` (else 408), counting the
   body's JSON structure as it arrives (`budget.json_marks`, a C-speed pass over each chunk).
4. It is inspected (`payload.inspect_body`): inline when small, in a worker process when it is
   `OFFLOAD_BYTES` or more, because parsing JSON costs up to ~0.3 µs per value and a few
   megabytes of tiny values would otherwise freeze every stream this process relays. Before a
   parse off the loop, the parse's memory (estimated from the structure count, an upper bound:
   `budget.parse_cost`) and the worker's copies of the body are charged too: a body whose parse
   could never fit is refused before any parsing cost grows. The parse ends with its charge.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio
import trio_parallel

from trio_pd.asgi import ClientGone, Receive, Scope
from trio_pd.errors import RouterError, payload_too_large
from trio_pd.pd.budget import (
    WORKER_COPIES,
    Account,
    OverBudget,
    json_marks,
    over_budget,
    parse_cost,
)
from trio_pd.pd.payload import OFFLOAD_BYTES, Inspected, Refused, inspect_body

PREREAD_BYTES = 64 * 1024  # what a request waiting in line may have read of its body
# A request refused before its body was read: how long the rest is read and dropped before the
# answer goes out, so the client, still sending, reads the answer instead of a reset (hypercorn
# closes a connection whose request body is unread once the response ends, and closing a socket
# with unread data resets it), as nginx's lingering close does. Nothing of it is kept.
DISCARD_SECS = 2.0
BODY_COPIES = 2  # the client's bytes and the legs' copy, held for the whole request


def body_timeout(secs: float) -> RouterError:
    return RouterError(408, f"the request body did not arrive within {secs:g}s", "timeout_error")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


@attrs.define(eq=False)
class ClientBody:
    """One request's body as it is read: its chunks, size and JSON structure count so far."""

    receive: Receive
    limit: int  # --max-payload-size
    declared: int | None  # its Content-Length, when it has one
    copies: int = BODY_COPIES
    chunks: list[bytes] = attrs.Factory(list)
    size: int = 0
    marks: int = 0  # JSON structural characters seen (budget.json_marks)
    complete: bool = False
    failure: BaseException | None = None  # what went wrong while it waited in line
    charged: int = 0  # body bytes charged to the account so far
    _line: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)
    _line_left: trio.Event = attrs.field(factory=trio.Event, init=False)
    _waiting: bool = attrs.field(default=False, init=False)
    _whole: bytearray | None = attrs.field(default=None, init=False)  # see _preallocate

    @classmethod
    def of(cls, scope: Scope, receive: Receive, limit: int, copies: int) -> ClientBody:
        """The body about to be read (`limit`: --max-payload-size)."""
        return cls(receive, limit, declared_length(scope), copies)

    def check_declared(self, budget_limit: int) -> None:
        """A 413 at once when the Content-Length is past the payload limit, or its copies could
        never fit the budget."""
        declared, copies = self.declared, self.copies
        if declared is not None:
            if declared > self.limit:
                raise payload_too_large(self.limit)
            if budget_limit > 0 and declared * copies > budget_limit:
                raise over_budget(OverBudget(declared * copies, budget_limit, True), "the body")

    async def _receive_one(self) -> None:
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            start = self.size
            self.size += len(chunk)
            if self.size > self.limit:
                raise payload_too_large(self.limit)
            self.marks += json_marks(chunk)
            whole = self._whole
            if whole is not None and self.size <= len(whole):
                whole[start : self.size] = chunk
            else:
                self.chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True

    def _preallocate(self) -> None:
        """With a Content-Length, the body is read into one buffer of that size: no list of
        chunks to join (which would hold the body twice for a moment)."""
        if self.declared is not None and self.declared > PREREAD_BYTES and not self.complete:
            whole = self._whole = bytearray(self.declared)
            whole[: self.size] = b"".join(self.chunks)
            self.chunks = []

    def _joined(self) -> bytes:
        whole, chunks = self._whole, self.chunks
        self._whole, self.chunks = None, []
        if whole is not None and not chunks:
            return whole if len(whole) == self.size else bytes(whole[: self.size])  # type: ignore[return-value]
        if whole is not None:  # more than its Content-Length (hypercorn would have refused it)
            chunks.insert(0, bytes(whole[: self.size - sum(map(len, chunks))]))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def wait_in_line(self, on_gone: Callable[[], None]) -> None:
        """Run while the request waits for admission, until `stop_waiting`: read at most
        `PREREAD_BYTES` of the body; once it is all in, watch for the client leaving and call
        `on_gone` (which cancels the request) when it does."""
        try:
            with self._line:
                while not self.complete and self.size < PREREAD_BYTES:
                    await self._receive_one()
                if self.complete:
                    while (await self.receive())["type"] != "http.disconnect":
                        pass
                    on_gone()
        except ClientGone:
            on_gone()
        except RouterError as error:
            self.failure = error
        finally:
            self._line_left.set()

    def start_waiting(self, nursery: trio.Nursery, on_gone: Callable[[], None]) -> None:
        self._waiting = True
        nursery.start_soon(self.wait_in_line, on_gone)

    async def stop_waiting(self) -> None:
        """Admitted: stop `wait_in_line` if it runs (from here the caller owns `receive`)."""
        if self._waiting:
            self._line.cancel()
            await self._line_left.wait()
            self._waiting = False

    async def discard_rest(self, within_secs: float = DISCARD_SECS) -> None:
        """The request is refused before its body was read: read and drop what is left of it
        for at most `within_secs` (see DISCARD_SECS)."""
        await self.stop_waiting()
        self.chunks = []
        self._whole = None
        with trio.move_on_after(within_secs):
            while not self.complete:
                message = await self.receive()
                if message["type"] == "http.disconnect":
                    return
                if not message.get("more_body", False):
                    self.complete = True

    def _charge(self, account: Account) -> None:
        """Charge what is read (or, with a Content-Length, declared) and not yet charged."""
        wanted = self.declared if self.declared is not None else self.size
        if wanted > self.charged:
            try:
                account.charge((wanted - self.charged) * self.copies)
            except OverBudget as error:
                raise over_budget(error, "the body") from None
            self.charged = wanted

    async def read(self, account: Account, within_secs: float) -> bytes:
        """The whole body, charged to `account` (429/413 from the budget, 413 past the payload
        limit), or a 408 when the rest takes longer than `within_secs`."""
        if self.failure is not None:
            raise self.failure
        self._charge(account)
        self._preallocate()
        with trio.move_on_after(within_secs):
            while not self.complete:
                await self._receive_one()
                if self.declared is None:
                    self._charge(account)
            return self._joined()
        raise body_timeout(within_secs)


async def inspect(
    path: str,
    raw: bytes,
    max_batch: int,
    owned_keys: frozenset[str],
    parsers: trio_parallel.WorkerContext | None,
    account: Account | None = None,
    marks: int = 0,
) -> Inspected:
    """`inspect_body`, off the event loop for large bodies (their parse charged to `account`
    while it runs); raises the 4xx of a refused body."""
    if parsers is None or len(raw) < OFFLOAD_BYTES:
        result = inspect_body(path, raw, max_batch, owned_keys)
    else:
        cost = parse_cost(len(raw), marks) + WORKER_COPIES * len(raw)
        if account is not None:
            try:
                account.charge(cost)
            except OverBudget as error:
                raise over_budget(error, "parsing the body") from None
        try:
            result = await parsers.run_sync(
                inspect_off_loop, path, raw, max_batch, owned_keys, kill_on_cancel=True
            )
        finally:
            if account is not None:
                account.release(cost)
        if isinstance(result, Inspected) and not result.body:
            result = attrs.evolve(result, body=raw)  # unchanged: not shipped back
    if isinstance(result, Refused):
        raise result.error()
    return result


def inspect_off_loop(
    path: str, raw: bytes, max_batch: int, owned_keys: frozenset[str]
) -> Inspected | Refused:
    """`inspect_body` in a worker process: a body left as it was is not sent back (the caller
    has it), which saves two copies of it."""
    result = inspect_body(path, raw, max_batch, owned_keys)
    if isinstance(result, Inspected) and result.body is raw:
        return attrs.evolve(result, body=b"")
    return result
