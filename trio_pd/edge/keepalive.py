"""The SSE keep-alive (`--sse-keepalive-secs`): a `: ping` comment after that much silence.

An idle-timeout proxy in front of the router (sixty seconds is a common setting) cuts a
connection that carries no byte for its window; a stream waiting on a long prefill, or a decode
that pauses, carries none. SMG 1.13 breaks such a silence with the SSE comment `: ping\\n\\n`,
which every event-stream parser skips; so does trio_pd, with one difference that comes from
holding a stream's headers until decode's first event (docs/behaviour.md, "Streams"):

- before the answer started, the first keep-alive sends the headers itself (200,
  `text/event-stream`), then the comment (`Responder.start_early`). Until then a failure still
  gets its real status; from then on it is an in-band error event (the envelope as a `data:`
  event, then `[DONE]`), as after any stream's start. Retries are not lost: the client has seen
  only comments, so dispatch may still try a fresh pair (`Responder.started` stays false until
  the first event);
- once events flow, a comment is written only after the interval passed with no write at all,
  only between events (never inside one, as decode's raw chunks may end mid-event), and never
  while a write is still under way (a client that stopped reading is the stall watchdog's).

One task per stream request, beside its dispatch; it ends with the request.
"""

from __future__ import annotations

import trio

from trio_pd.respond import Responder

PING = b": ping\n\n"
CHECKS = 4  # looks per interval: a comment comes within a quarter interval of being due
EARLY_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def keep_alive(responder: Responder, interval: float) -> None:
    """Write `PING` on `responder` once `interval` passed with nothing written, until the
    response is finished (or the task is cancelled with its request).

    The responder counts its writes instead of reading the clock per chunk; this task looks
    `CHECKS` times an interval, so a comment comes after `interval` to `interval * (1 + 1 /
    CHECKS)` of silence, never sooner."""
    period = interval / CHECKS
    seen = responder.writes
    quiet_since = trio.current_time()
    while not responder.finished:
        await trio.sleep(period)
        now = trio.current_time()
        if responder.writes != seen:  # written to within the last period
            seen, quiet_since = responder.writes, now
            continue
        if now - quiet_since < interval or responder.writes != responder.written:
            continue  # not silent long enough, or a write to a slow client is under way
        if not responder.at_boundary:
            continue  # inside an event (decode's raw chunks may end anywhere)
        if not responder.started and not responder.early:
            await responder.start_early(EARLY_HEADERS)
            if responder.finished:
                return
        await responder.send(PING)
        seen, quiet_since = responder.writes, trio.current_time()
