"""Where a request's id comes from: the client's headers (`--request-id-headers`), else a new one.

The rules are SMG 0.3.2's (`RequestIdMiddleware` and `generate_request_id` in its
`src/middleware.rs`, the default list in `src/server.rs`): the configured headers are tried in
the order given and the first one present whose value is visible ASCII wins (a header sent twice
counts with its first value); without one the router makes an OpenAI-style id whose prefix names
the route (`chatcmpl-`, `cmpl-`, `gnt-`, `resp-`, `req-`) followed by 24 letters and digits.
Whatever the source, the client gets it back as `x-request-id` on every response (`respond.py`).

trio_pd keeps two guarantees of its own on top: an empty value does not count (SMG would answer
with an empty id), and the id goes to both workers as their `x-request-id` and into each
attempt's SGLang `rid` (`dispatch.attempt_rid`), so a request can be followed from the client's
log through the router's into the engines'.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

DEFAULT_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
_ALPHANUMERIC = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# What `http::HeaderValue::to_str` accepts: visible ASCII and tab. Deleting these characters
# from a value leaves nothing exactly when the value is usable (one C-level pass).
_VISIBLE = bytes([9, *range(32, 127)])


def prefix_for(path: str) -> bytes:
    """SMG's prefix of a generated id: the route family, checked in SMG's order."""
    if "/chat/completions" in path:
        return b"chatcmpl-"
    if "/completions" in path:
        return b"cmpl-"
    if "/generate" in path:
        return b"gnt-"
    if "/responses" in path:
        return b"resp-"
    return b"req-"


class RequestIds:
    """The request-id rules of one router process.

    Generated ids are this process's 14 random alphanumerics and a 10-hex-digit counter: SMG's
    shape (24 letters and digits after the prefix), unique across processes and restarts, and
    cheaper than drawing 24 random characters per request on the hot path.
    """

    __slots__ = ("_first", "_random", "_rank", "_serial")

    def __init__(self, headers: Sequence[str] | None = None) -> None:
        names = DEFAULT_HEADERS if headers is None else headers
        self._rank: dict[bytes, int] = {}
        for name in names:  # a name listed twice keeps its first place
            self._rank.setdefault(name.strip().lower().encode("latin-1"), len(self._rank))
        self._first = next(iter(self._rank), None)
        self._random = bytes(_ALPHANUMERIC[b % 62] for b in os.urandom(14))
        self._serial = 0

    def incoming(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The client's id from the configured headers (by their order, not the request's)."""
        rank = self._rank
        if not rank:
            return None
        best: bytes | None = None
        best_rank = len(rank)
        unusable: set[bytes] | None = None  # only a header's first value counts, as in SMG
        for name, value in headers:
            place = rank.get(name)
            if place is None or place >= best_rank or (unusable and name in unusable):
                continue
            if not value or value.translate(None, _VISIBLE):
                unusable = (unusable or set()) | {name}
                continue
            if name == self._first:
                return value  # nothing can beat the first header
            best, best_rank = value, place
        return best

    def new(self, path: str) -> bytes:
        """A fresh id in SMG's format for a request on `path`."""
        self._serial += 1
        return b"%s%s%010x" % (prefix_for(path), self._random, self._serial)
