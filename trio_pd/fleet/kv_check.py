"""The self-check of KV-event routing: did the engine reuse what the index said it would?

For each request routed while no other prefill of this router ran on the chosen worker (a
concurrent one may store or evict blocks between the prediction and the engine's match: a race,
not an index fault), the cached tokens predicted for it are compared with the engine's own
report (`meta_info.cached_tokens` on /generate, `usage.prompt_tokens_details.cached_tokens` on
OpenAI routes). Another replica's requests can still race it, which the smoothing absorbs
unless the churn is heavy. The error is counted as a share of the prompt's tokens, smoothed
over recent requests. Past `TRIP_ERROR` (after `MIN_SAMPLES`)
the worker's index is not believed: the policy falls back to the approximate tree for it, logs
it, and shows it in `GET /workers`, `/readiness` and the metrics, until the error is back under
`CLEAR_ERROR`. A wrong tokenizer, a block-size mismatch or lost events all show here: the index
then predicts reuse the engine does not have, or misses reuse it has.
"""

from __future__ import annotations

import logging

import attrs

log = logging.getLogger(__name__)

SMOOTHING = 0.2  # weight of the newest request in the smoothed error
MIN_SAMPLES = 4  # requests before the check may trip
TRIP_ERROR = 0.25  # smoothed |predicted - reported| / prompt tokens that trips it...
CLEAR_ERROR = 0.1  # ...and under which it clears again


@attrs.define
class SelfCheck:
    worker_id: str
    samples: int = 0
    error: float = 0.0  # smoothed |predicted - reported| / prompt tokens
    predicted_tokens: int = 0  # totals, for the hit ratios
    reported_tokens: int = 0
    prompt_tokens: int = 0
    tripped: bool = False

    def observe(self, predicted: int, reported: int, prompt_tokens: int) -> None:
        miss = abs(predicted - reported) / max(prompt_tokens, 1)
        self.error = miss if self.samples == 0 else (1 - SMOOTHING) * self.error + SMOOTHING * miss
        self.samples += 1
        self.predicted_tokens += predicted
        self.reported_tokens += reported
        self.prompt_tokens += prompt_tokens
        if not self.tripped and self.samples >= MIN_SAMPLES and self.error > TRIP_ERROR:
            self.tripped = True
            log.warning(
                "kv_aware: worker %s: the engine's cached tokens disagree with the KV index "
                "(error %.2f of the prompt; last predicted %d, reported %d): routing it by the "
                "approximate tree (wrong --tokenizer-path, block size, or lost events?)",
                self.worker_id, self.error, predicted, reported,
            )  # fmt: skip
        elif self.tripped and self.error < CLEAR_ERROR:
            self.tripped = False
            log.warning(
                "kv_aware: worker %s: the KV index agrees with the engine again", self.worker_id
            )

    def to_json(self) -> dict[str, object]:
        prompt = max(self.prompt_tokens, 1)
        return {
            "samples": self.samples,
            "error": round(self.error, 4),
            "predicted_hit_ratio": round(self.predicted_tokens / prompt, 4),
            "engine_hit_ratio": round(self.reported_tokens / prompt, 4),
            "tripped": self.tripped,
        }

    def reset(self) -> None:
        """The index was rebuilt: what it predicted before says nothing of it now."""
        self.samples = 0
        self.error = 0.0
