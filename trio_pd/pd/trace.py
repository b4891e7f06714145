"""What dispatch tells a request's trace, as an interface (`edge/tracing.py` implements it).

Tracing lives above this layer (it imports OpenTelemetry, and only when `--enable-trace` is
given), so dispatch sees it through these two protocols; a request without tracing carries None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trio_pd.pd.attempt import Attempt
    from trio_pd.pd.outcome import AttemptOutcome


class AttemptTrace(Protocol):
    def end(self, ended: AttemptOutcome) -> None:
        """The attempt ran: its legs' spans are read off how it ended."""


class RequestTrace(Protocol):
    def attempt(self, number: int, attempt: Attempt) -> AttemptTrace:
        """An attempt is about to run on its pair."""

    def retrying(self, number: int, role: str, delay: float) -> None:
        """Attempt `number` failed on `role` and another follows after `delay` seconds."""

    def migrating(self, number: int, reason: str, sent: int) -> None:
        """Decode broke (`reason`) after `sent` tokens: resume `number` follows on a fresh pair."""
