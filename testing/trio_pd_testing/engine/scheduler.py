"""The scheduler's side of an abort (`managers/scheduler.py` `abort_request`).

It matches by PREFIX: every live request whose rid starts with the abort's rid is aborted
(`req.rid.startswith(recv_req.rid)`), so aborting `X` also aborts `X-retry1`, and `X_1` aborts
`X_10`; `abort_all` matches everything. What an abort does depends on the queue (state.py):

- decode prealloc, prefill bootstrap: it leaves at once and answers 500 ("Decode handshake
  failed ..." / "Prefill bootstrap failed ... Aborted by AbortReq.");
- decode transfer: it leaves at once (500 "Decode transfer failed ... Aborted by AbortReq."),
  but its KV pages stay held until the prefill acknowledges the abort, or 30 s (decode.py);
- decode waiting (KV arrived, not yet running): popped at once, a graceful abort ("Abort in
  waiting queue", no status);
- running (decode generating, prefill computing): one more step, then it finishes with
  finish_reason abort "Aborted" and no status (a 200 answer).

An item not yet dispatched (the tokenize window) is invisible here: the abort is lost.
"""

from __future__ import annotations

from trio_pd_testing.engine.state import EngineState, Item

ABORTED_BY_ABORTREQ = "Aborted by AbortReq."


def abort_matching(engine: EngineState, rid: str, abort_all: bool, reason: str) -> list[Item]:
    matched = [
        item
        for item in engine.live
        if item.stage != "done" and (abort_all or item.rid.startswith(rid))
    ]
    for item in matched:
        item.abort_reason = reason
        if item.stage == "running":
            item.to_finish = True
        else:
            item.interrupt("abort", ABORTED_BY_ABORTREQ)
    return matched
