"""One request's retry state: each attempt reports its outcome here, and here alone is decided
what follows it (Envoy's model: an upstream request reports to its owner; one retry state).

An attempt's end (`outcome.AttemptOutcome`) leads to one of three next steps:

- `EndStream`: bytes of the attempt already reached the client, so no other attempt can answer
  instead (`after_bytes_sent`, the one place that decides it: a stream cut by decode is ended
  with an error event; a resumed stream would be decided there too);
- `Retry`: another attempt on a fresh pair may help (`LegFailure.retryable`), the same failure
  was not already seen on two workers of that role (then it is the request's doing), attempts
  and time are left, and, where a failed decode leaves its prefill's KV leased (vLLM), a decode
  that has not failed this request is there to try;
- `Answer`: the attempt's reply is the client's.
"""

from __future__ import annotations

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
from trio_pd.respond import Reply
from trio_pd.spec import Role


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


Step = EndStream | Retry | Answer


def decode_broke_after_bytes(outcome: AttemptOutcome) -> bool:
    """Decode's answer broke after prefill succeeded and bytes already went out: the one case
    a resumed stream (migration) would take over instead of cutting the stream."""
    return outcome.streamed and outcome.prefill.succeeded and outcome.decode.failed


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

    def after_bytes_sent(self, outcome: AttemptOutcome) -> EndStream:
        """The client has bytes of this attempt: no other attempt may answer instead. A stream
        not finished whole and still read is ended with an error event (docs/protocol.md §4);
        a decode that broke after its prefill succeeded (`decode_broke_after_bytes`) is where
        a resumed stream would go on instead."""
        if outcome.finished or outcome.stalled:
            return EndStream(None)
        if decode_broke_after_bytes(outcome):
            # Migration's seam: today the stream ends here as any other cut stream does.
            return EndStream(stream_error_frame(outcome))
        return EndStream(stream_error_frame(outcome))

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
