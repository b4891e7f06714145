"""A request's bodies for vLLM pairs: made once per request, off the event loop when large.

A vLLM attempt sends the prefill a rewritten body and the decode the client's (less a few keys),
so it needs the client's body as an object (`vllm_attempt.vllm_bodies`). Parsing it is what
`edge/intake.py` already keeps off the event loop for bodies of `OFFLOAD_BYTES` or more (up to
~0.3 µs per JSON value: megabytes of tiny values would freeze every stream this process
relays), so the same holds here: a large body's legs are made in a worker process, which sends
back bytes only (no object crosses, so nothing is rebuilt on the loop), with that parse charged
to the request's account while it runs and the bytes made charged until the request ends. It
happens once per request: its retries and its samples share what was made (`VllmBodyMaker`).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from trio_pd.errors import RouterError
from trio_pd.pd.budget import WORKER_COPIES, Account, OverBudget, over_budget, parse_cost
from trio_pd.pd.payload import OFFLOAD_BYTES, Refused
from trio_pd.pd.vllm_attempt import VllmBodies, vllm_bodies


@attrs.define(eq=False)
class VllmBodyMaker:
    """One request's `VllmBodies`, made on first use and kept for its other attempts."""

    path: str
    raw: bytes  # the inspected client body (`Inspected.body`)
    marks: int = 0  # its JSON structure count (`budget.json_marks`), to price its parse
    parsers: Any = None  # trio_parallel.WorkerContext of the lifespan; None: inline
    made: VllmBodies | None = None
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    async def bodies(self, account: Account | None) -> VllmBodies:
        """The bodies (RouterError: 413/429 from the budget, 400 when they cannot be made)."""
        async with self._lock:  # samples run at once: one of them makes, the others wait
            if self.made is None:
                self.made = await self._make(account)
            return self.made

    async def _make(self, account: Account | None) -> VllmBodies:
        raw = self.raw
        if self.parsers is None or len(raw) < OFFLOAD_BYTES:
            made = vllm_bodies(self.path, raw)
        else:
            cost = parse_cost(len(raw), self.marks) + WORKER_COPIES * len(raw)
            charge(account, cost, "parsing the body")
            try:
                result = await self.parsers.run_sync(
                    vllm_bodies_off_loop, self.path, raw, kill_on_cancel=True
                )
            finally:
                if account is not None:
                    account.release(cost)
            if isinstance(result, Refused):
                raise result.error()
            made = result
            if not made.decode:
                made = attrs.evolve(made, decode=raw)  # unchanged: not shipped back
        held = len(made.prefill) + len(made.decode_echo)
        held += 0 if made.decode is raw else len(made.decode)
        charge(account, held, "the vLLM legs' bodies")
        return made


def charge(account: Account | None, amount: int, what: str) -> None:
    if account is None:
        return
    try:
        account.charge(amount)
    except OverBudget as error:
        raise over_budget(error, what) from None


def vllm_bodies_off_loop(path: str, raw: bytes) -> VllmBodies | Refused:
    """`vllm_bodies` in a worker process: a decode body left as the client's own is not sent
    back (the caller has it), and a refusal crosses as a picklable value."""
    try:
        made = vllm_bodies(path, raw)
    except RouterError as error:
        return Refused(error.status, error.message, error.error_type)
    return attrs.evolve(made, decode=b"") if made.decode is raw else made
