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
EARLY_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def keep_alive(responder: Responder, interval: float) -> None:
    """Write `PING` on `responder` whenever `interval` passed with nothing written, until the
    response is finished (or the task is cancelled with its request)."""
    quiet_since = trio.current_time()
    while not responder.finished:
        quiet_since = max(quiet_since, responder.last_write_at)
        due = quiet_since + interval
        if trio.current_time() < due:
            await trio.sleep_until(due)
            continue
        if responder.writing or not responder.at_boundary:
            quiet_since = trio.current_time()  # look again an interval later
            continue
        if not responder.started and not responder.early:
            await responder.start_early(EARLY_HEADERS)
            if responder.finished:
                return
        await responder.send(PING)
