"""What one leg's end means: for the client, for the circuit breakers, for retries.

docs/protocol.md §4 and §5 as values and pure functions, apart from the I/O of the legs
(`attempt.py`) and the retry loop (`dispatch.py`):

- `LegFailure.client_reply(role)`: the answer a client gets for a failed leg;
- `LegFailure.counts_against_worker()`: a breaker failure, or the client's fault;
- `LegFailure.retryable()` and `FailureHistory`: whether another attempt may help;
- `record_outcome`: breaker attribution, once per worker per attempt, and at most one failure
  per worker per request, so one poisonous request cannot vote a worker out five times;
- `AttemptOutcome`: how one attempt ended, as one frozen value (`Attempt.run` returns it), which
  is all the metrics, the span, the access line and the retry state (`retry_state.py`) read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from trio_pd.errors import RouterError, gateway_timeout
from trio_pd.respond import JSON_HEADERS, Reply, error_reply
from trio_pd.spec import Role

if TYPE_CHECKING:
    from trio_pd.fleet.registry import Fleet
    from trio_pd.fleet.worker import Worker

# "overload": the router's memory budget could not hold the worker's answer (the router's state,
# not the worker's fault, and no other worker would help now).
# "kv_transfer": a vLLM decode failed after it was given the prefill's KV handoff
# (docs/vllm.md §4): 502 `kv_transfer_failed`, retried with a fresh prefill, never the same params.
FailureKind = Literal["status", "inband", "transport", "timeout", "overload", "kv_transfer"]
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@attrs.frozen
class LegFailure:
    """Why one leg failed. ``status``: the worker's HTTP status (kind "status") or the code an
    in-band error carried (kind "inband", when it had one)."""

    kind: FailureKind
    message: str
    status: int | None = None
    body: bytes = b""  # a status failure's own body, relayed as it came
    content_type: bytes = b"application/json"

    @property
    def is_client_error(self) -> bool:
        """The worker refused the client's request (a 4xx status or in-band code)."""
        return self.kind != "kv_transfer" and self.status is not None and 400 <= self.status < 500

    def client_reply(self, role: Role) -> Reply:
        """The answer a client gets for this failure (docs/protocol.md §4, first and third rows)."""
        if self.kind == "status":
            assert self.status is not None
            if role == "decode" or self.is_client_error:
                return Reply(self.status, [(b"content-type", self.content_type)], self.body)
            message = f"prefill worker answered {self.status}: {self.message}"
            return error_reply(RouterError(502, message, "upstream_error"))
        if self.kind == "kv_transfer":
            message = f"{role} worker failed: {self.message}"
            return error_reply(
                RouterError(502, message, "upstream_error", code="kv_transfer_failed")
            )
        if self.kind == "inband" and self.is_client_error:
            assert self.status is not None
            body = RouterError(self.status, self.message, "invalid_request_error").body()
            return Reply(self.status, JSON_HEADERS, body)
        if self.kind == "timeout":
            return error_reply(gateway_timeout(f"{role} worker timed out: {self.message}"))
        if self.kind == "overload":
            retry = ((b"retry-after", b"1"),)
            return error_reply(RouterError(503, self.message, "service_unavailable", headers=retry))
        return error_reply(
            RouterError(502, f"{role} worker failed: {self.message}", "upstream_error")
        )

    def counts_against_worker(self) -> bool:
        """A breaker failure? A refused request (4xx) is the client's and a breaker success, as
        is an answer the router had no room for (the worker did its part)."""
        return not self.is_client_error and self.kind != "overload"

    def retryable(self) -> bool:
        """May another attempt, on another pair, succeed? Never for the client's own fault."""
        if self.kind in ("transport", "timeout", "kv_transfer"):
            return True
        if self.kind == "overload":
            return False
        if self.kind == "inband":
            return not self.is_client_error
        return self.status in RETRYABLE_STATUSES

    def signature(self, role: Role) -> tuple[str, str, int | None]:
        return (role, self.kind, self.status)


@attrs.frozen
class LegSuccess:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes  # empty when the body was streamed to the client


LegResult = LegSuccess | LegFailure | None  # None: still running, or cancelled


@attrs.frozen
class LegEnd:
    """How one leg of an attempt ended (a snapshot of `attempt.Leg` once the attempt is over).

    ``cancel_cause`` is set when the leg was cancelled while its request was out
    ("prefill_failed", "decode_failed", "client_gone", "deadline", "stall", "shutdown")."""

    role: Role
    worker: Worker
    result: LegResult
    posted: bool  # its request was written (or was being): the engine may have held it
    cancel_cause: str | None = None
    cancelled_at: float | None = None
    ended_at: float | None = None  # its connection released (pooled or closed)

    @property
    def failed(self) -> bool:
        return isinstance(self.result, LegFailure)

    @property
    def succeeded(self) -> bool:
        return isinstance(self.result, LegSuccess)

    @property
    def failure(self) -> LegFailure | None:
        return self.result if isinstance(self.result, LegFailure) else None


@attrs.frozen
class AttemptOutcome:
    """How one attempt ended: what its legs did, which workers served them, and whether the
    client already has bytes of it. What a later step needs to decide anything about the
    request (retry, breakers, metrics, span, access line, a resumed stream) is here."""

    engine: str  # the pair's engine (`WorkerSpec.engine`)
    prefill: LegEnd
    decode: LegEnd
    streamed: bool  # the client's stream started: bytes of this attempt reached the client
    finished: bool  # ... and the client's answer is complete
    stalled: bool = False  # the client stopped reading: nothing more can be sent to it
    # A decode failing after its prefill answered leaves the prefill's KV blocks leased to that
    # handoff (vLLM: docs/vllm.md §8, finding 1); a retry then leases more.
    leases_prefill: bool = False
    prefill_cached_tokens: int | None = None  # the prefill engine's own count, when asked

    @property
    def legs(self) -> tuple[LegEnd, LegEnd]:
        return (self.prefill, self.decode)

    def culprit(self) -> LegEnd | None:
        """The leg whose failure decided the attempt (docs/protocol.md §4: prefill's first)."""
        if self.prefill.failed:
            return self.prefill
        if self.decode.failed:
            return self.decode
        return None

    def reply(self) -> Reply | None:
        """The client's answer, or None when it was streamed already."""
        if self.streamed:
            return None
        if isinstance(self.prefill.result, LegFailure):
            return self.prefill.result.client_reply("prefill")
        if isinstance(self.decode.result, LegFailure):
            return self.decode.result.client_reply("decode")
        decode = self.decode.result
        assert isinstance(decode, LegSuccess), "both legs finished without a failure"
        return Reply(decode.status, decode.headers, decode.body)


@attrs.define
class FailureHistory:
    """The failures of one request's attempts, to tell a failing worker from a failing request.

    The same kind of failure (role, kind, status) on two different workers of the same role is
    the request's doing, not the workers': retrying it on a third would only spend another
    worker's time and another breaker vote. Workers that already recorded a breaker failure for
    this request are remembered so they record no second one.
    """

    workers_by_signature: dict[tuple[str, str, int | None], set[Worker]] = attrs.Factory(dict)
    charged: set[Worker] = attrs.Factory(set)

    def add(self, role: Role, worker: Worker, failure: LegFailure) -> None:
        self.workers_by_signature.setdefault(failure.signature(role), set()).add(worker)

    def repeats_across_workers(self, role: Role, failure: LegFailure) -> bool:
        return len(self.workers_by_signature.get(failure.signature(role), ())) >= 2


def record_outcome(fleet: Fleet, outcome: AttemptOutcome, history: FailureHistory) -> None:
    """Circuit-breaker attribution for one attempt (docs/protocol.md §5).

    Prefill failed: only prefill records (a refused request is a success: the client's fault);
    decode was a victim. Decode failed: only decode records. Both fine: both succeed. A client
    disconnect never gets here (``Cancelled`` propagates past it). A worker records at most one
    failure per request (``history.charged``).
    """
    p_worker, p = outcome.prefill.worker, outcome.prefill.result
    d_worker, d = outcome.decode.worker, outcome.decode.result
    if isinstance(p, LegFailure):
        _record(fleet, p_worker, p, history)
    elif isinstance(d, LegFailure):
        _record(fleet, d_worker, d, history)
    else:
        if isinstance(p, LegSuccess):
            fleet.record(p_worker, ok=True)
        if isinstance(d, LegSuccess):
            fleet.record(d_worker, ok=True)


def _record(fleet: Fleet, worker: Worker, failure: LegFailure, history: FailureHistory) -> None:
    if not failure.counts_against_worker():
        fleet.record(worker, ok=True)
    elif worker not in history.charged:
        history.charged.add(worker)
        fleet.record(worker, ok=False)
