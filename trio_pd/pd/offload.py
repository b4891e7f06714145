"""JSON work on upstream answers too large for the event loop: the in-band failure check and the
logprob merge, done in the parsers' worker process.

Parsing JSON costs up to ~0.3 µs a value and encoding it again about as much. A prefill answer
with `return_logprob` and `top_logprobs_num` on a long prompt is tens of MB, millions of values:
parsed, merged and re-encoded on the event loop it froze every stream this process relays for
most of a second (issue 26, N8), which is what `edge/intake.py` already avoids for bodies. So
an answer of `OFFLOAD_BYTES` or more (both answers together, for a merge) is handled in a worker
process; only bytes cross the boundary (no object is rebuilt on the loop), and what comes back
is a small value or the merged answer's bytes. Smaller answers are handled inline, as before.

What it costs is charged as `answers.read_json` charges a parse (the objects it becomes, priced
from the text, held until the request ends), plus, while a worker runs, its copies of the bytes
(`budget.WORKER_COPIES`), given back when it ends.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import trio

from trio_pd.pd.budget import WORKER_COPIES, Account, json_marks, parse_cost
from trio_pd.pd.frames import InbandError, answer_failure, merge_logprobs, parse_json
from trio_pd.pd.payload import OFFLOAD_BYTES


@attrs.define(eq=False)
class AnswerWork:
    """One attempt's JSON work on answers, off the loop when large."""

    parsers: Any = None  # trio_parallel.WorkerContext of the lifespan; None: always inline
    account: Account | None = None

    async def suspect(self, data: bytes) -> bool:
        """Whether `data` carries a failure marker (`error`, `abort`) and must be parsed to
        know. Each scan of a large answer gets a step of the event loop of its own."""
        large = len(data) >= OFFLOAD_BYTES
        for marker in (b"error", b"abort"):
            if large:
                await trio.lowlevel.checkpoint()
            if marker in data:
                return True
        return False

    async def price(self, data: bytes, marks: int | None = None) -> int:
        """Charge the parse of `data` (OverBudget when the budget cannot take it); the amount.
        Without its structure count (`marks`, counted as it arrived) pricing is a pass over the
        bytes: a large answer gets a step of the event loop of its own."""
        if self.account is None:
            return 0
        if marks is None:
            if len(data) >= OFFLOAD_BYTES:
                await trio.lowlevel.checkpoint()
            marks = json_marks(data)
        cost = parse_cost(len(data), marks)
        self.account.charge(cost)
        return cost

    async def failure(
        self, data: bytes, hold: bool = True, marks: int | None = None
    ) -> InbandError | None:
        """`relay.answer_failure` of an answer (or an SSE event's data), its parse priced first
        and held until the request ends (`hold` False: while it runs, for an event)."""
        cost = await self.price(data, marks)
        try:
            if self._inline(len(data)):
                return answer_failure(parse_json(data))
            result: InbandError | None = await self._run(len(data), failure_of, data)
            return result
        finally:
            if not hold and self.account is not None:
                self.account.release(cost)

    async def merged(
        self, prefill: bytes, decode: bytes, event: bool = False, marks: int | None = None
    ) -> bytes | None:
        """The decode's answer (its SSE event's data when `event`: the event comes back) with
        the prefill's input logprobs in front of its own (`relay.merge_logprobs`), re-encoded;
        None when nothing was merged. The prefill's parse was priced when it was read; the
        decode's is priced here (`marks`: its structure count, when known). orjson's
        JSONEncodeError when the merge cannot be encoded."""
        await self.price(decode, marks)
        size = len(prefill) + len(decode)
        if self._inline(size):
            result = merge_of(prefill, decode, event)
        else:
            result = await self._run(size, merge_of, prefill, decode, event)
        if isinstance(result, str):
            raise orjson.JSONEncodeError(result)
        return result

    def _inline(self, size: int) -> bool:
        return self.parsers is None or size < OFFLOAD_BYTES

    async def _run(self, size: int, function: Any, *args: Any) -> Any:
        copies = WORKER_COPIES * size
        if self.account is not None:
            self.account.charge(copies)
        try:
            return await self.parsers.run_sync(function, *args, kill_on_cancel=True)
        finally:
            if self.account is not None:
                self.account.release(copies)


def failure_of(data: bytes) -> InbandError | None:
    return answer_failure(parse_json(data))


def merge_of(prefill: bytes, decode: bytes, event: bool) -> bytes | str | None:
    """The merge in bytes out (a str: why it cannot be encoded; picklable, unlike orjson's
    exception)."""
    prefill_answer, decode_answer = parse_json(prefill), parse_json(decode)
    if not merge_logprobs(prefill_answer, decode_answer):
        return None
    try:
        merged = orjson.dumps(decode_answer)
    except orjson.JSONEncodeError as error:
        return str(error)
    return b"data: " + merged + b"\n\n" if event else merged
