"""One request's retry state: each attempt reports its outcome here, and here alone is decided
what follows it (Envoy's model: an upstream request reports to its owner; one retry state).

An attempt's end (`outcome.AttemptOutcome`) leads to one of four next steps:

- `EndStream`: bytes of the attempt already reached the client, so no other attempt can answer
  instead (`after_bytes_sent`, the one place that decides it: a stream cut by decode is ended
  with an error event);
- `Resume`: a stream whose decode broke after its prefill succeeded goes on from a fresh pair
  after what the client got (migration, `resume.py`), where `--migration-limit` and the
  request allow it (`after_bytes_sent` too);
- `Retry`: another attempt on a fresh pair may help (`LegFailure.retryable`), the same failure
  was not already seen on two workers of that role (then it is the request's doing), attempts
  and time are left, and, where a failed decode leaves its prefill's KV leased (vLLM), a decode
  that has not failed this request is there to try;
- `Answer`: the attempt's reply is the client's.
"""

from __future__ import annotations

import logging
import random

import attrs
import trio

from trio_pd.config import RetryConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.retry import backoff_delay
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.ending import stream_error_frame
from trio_pd.pd.outcome import AttemptOutcome, FailureHistory, LegEnd, LegFailure
from trio_pd.pd.resume import Migration
from trio_pd.respond import Reply
from trio_pd.spec import Role

log = logging.getLogger(__name__)


@attrs.frozen
class EndStream:
    """The client's stream started: end it with `frame` (None: nothing more can or need be
    sent: it finished whole, or the client stopped reading)."""

    frame: bytes | None


@attrs.frozen
class Retry:
    """Another attempt after `delay` seconds; `culprit`'s worker is avoided from now on."""

    culprit: Role
    delay: float
    status: int  # what the client would have got instead, for the log


@attrs.frozen
class Answer:
    reply: Reply


@attrs.frozen
class Resume:
    """Decode broke mid-stream after prefill succeeded: the request resumes on a fresh pair,
    the broken decode avoided, after what the client already got (`resume.py`)."""

    reason: str  # transport, timeout, inband
    sent: int  # tokens the client already got


Step = EndStream | Retry | Answer | Resume


def decode_broke_after_bytes(outcome: AttemptOutcome) -> bool:
    """Decode's answer broke after prefill succeeded and bytes already went out: the one case
    a resumed stream (migration) would take over instead of cutting the stream."""
    # A prefill still running counts as done: decode streamed, so its KV cache had arrived.
    return outcome.streamed and not outcome.prefill.failed and outcome.decode.failed


@attrs.define(eq=False)
class RetryState:
    """The retries of one PD request (see the module docstring)."""

    fleet: Fleet
    config: RetryConfig
    rng: random.Random
    metrics: RouterMetrics
    total: int  # attempts allowed
    deadline: float  # the request's
    model: str | None = None  # the model it routes to (None: the router serves one)
    history: FailureHistory = attrs.Factory(FailureHistory)
    avoid: set[Worker] = attrs.Factory(set)  # workers that failed this request
    migration: Migration | None = None  # a stream that may resume (`resume.py`)

    def next_step(self, outcome: AttemptOutcome, number: int) -> Step:
        """What follows attempt `number`, which ended as `outcome`."""
        if outcome.streamed:
            return self.after_bytes_sent(outcome)
        reply = outcome.reply()
        assert reply is not None
        plan = self.retry_plan(outcome, number)
        if plan is None:
            return Answer(reply)
        culprit, delay = plan
        self.avoid.add(culprit.worker)
        if self.leases_a_prefill(outcome, culprit) and not self.fresh_decodes(outcome):
            self.metrics.retries_declined.labels("no_fresh_decode").inc()
            return Answer(reply)
        return Retry(culprit.role, delay, reply.status)

    def after_bytes_sent(self, outcome: AttemptOutcome) -> EndStream | Resume:
        """The client has bytes of this attempt: no other attempt may answer instead. A stream
        not finished whole and still read is ended with an error event (docs/protocol.md §4),
        unless its decode broke after its prefill succeeded (`decode_broke_after_bytes`) and
        migration resumes it (`Resume`)."""
        if outcome.finished or outcome.stalled:
            return EndStream(None)
        if decode_broke_after_bytes(outcome) and self.migration is not None:
            resume = self.resume(outcome, self.migration)
            if resume is not None:
                return resume
        return EndStream(stream_error_frame(outcome))

    def resume(self, outcome: AttemptOutcome, migration: Migration) -> Resume | None:
        """Resume the broken stream (`migration.decide`), or count why not (None: the stream
        ends with the error event, as without migration)."""
        decode = outcome.decode
        reason = migration.broke(outcome.prefill.failed, decode.result, decode.cancel_cause)
        if reason is None:
            return None
        why = migration.decide(migration.resumable)
        if why is not None:
            migration.count(self.metrics, reason, why)
            log.info("decode broke (%s) mid-stream; not resumed: %s", reason, why)
            return None
        migration.open_break = reason
        self.avoid.add(decode.worker)
        sent = migration.transcript.sent if migration.transcript is not None else 0
        log.info("decode broke (%s) after %d tokens: resuming on a fresh pair", reason, sent)
        return Resume(reason, sent)

    def retry_plan(self, outcome: AttemptOutcome, number: int) -> tuple[LegEnd, float] | None:
        """(the leg to blame, the backoff) when another attempt may help, else None: a failure
        another worker might not have, not already seen on two workers of that role, attempts
        left, and time before the deadline."""
        culprit = outcome.culprit()
        if culprit is None or number >= self.total:
            return None
        failure = culprit.result
        assert isinstance(failure, LegFailure)
        self.history.add(culprit.role, culprit.worker, failure)
        delay = backoff_delay(number, self.config, self.rng)
        if (
            failure.retryable()
            and not self.history.repeats_across_workers(culprit.role, failure)
            and trio.current_time() + delay < self.deadline
        ):
            return culprit, delay
        return None

    @staticmethod
    def leases_a_prefill(outcome: AttemptOutcome, culprit: LegEnd) -> bool:
        """A decode failed after its prefill answered, on an engine where the prefill's KV
        blocks stay leased to that handoff (vLLM: until read, or `kv_lease_duration`, 30 s by
        default), and a retry runs a fresh prefill that leases more (docs/vllm.md §8, finding 1)."""
        return outcome.leases_prefill and culprit is outcome.decode and outcome.prefill.succeeded

    def fresh_decodes(self, outcome: AttemptOutcome) -> bool:
        """Whether a decode of this engine that has not failed this request is there to retry
        on. Without one a retry would lease another prefill's blocks for the same dead decode: a
        request spends at most one prefill per decode it tries, so the KV a dead decode can pin
        is one lease per request, not one per attempt."""
        engine = outcome.decode.worker.spec.engine
        return any(
            w not in self.avoid and w.spec.engine == engine
            for w in self.fleet.available("decode", self.model)
        )
