"""The request's own cancel scope, and why it was cancelled.

A shared word of the edge (the client's disconnect, the drain), the PD layer (the legs'
accounting) and tracing: it lives here, below all of them.
"""

from __future__ import annotations

import attrs
import trio


@attrs.define(eq=False)
class RequestCancel:
    """The request's own cancel scope, and why it was cancelled (for the legs' accounting).

    The client's disconnect and the router's shutdown both end a request from outside its
    attempt; whoever cancels says why, once.
    """

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    cause: str = "cancelled"
    at: float = 0.0
    # A sample of an n > 1 request (`pd/samples.py`) runs in a scope of its own inside the
    # request's: when the request is cancelled, that is why its legs ended.
    parent: RequestCancel | None = None

    def cancel(self, cause: str) -> None:
        if not self.scope.cancel_called:
            self.cause = cause
            self.at = trio.current_time()
            self.scope.cancel(reason=cause)

    def why(self) -> tuple[str, float]:
        if self.parent is not None and self.parent.scope.cancel_called:
            return self.parent.why()
        return self.cause, self.at if self.scope.cancel_called else trio.current_time()
