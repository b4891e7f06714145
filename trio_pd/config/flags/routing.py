"""The table's rows for SMG 1.13's routing knobs: least_load, power_of_two's load metric,
prefix_hash, and sticky sessions on any policy (one row a flag: see `flag.py`). The policy
choices themselves are `fleet.py`'s rows."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag
from trio_pd.config.router import LOAD_METRICS

ROUTING: tuple[Flag, ...] = (
    Flag(
        "--least-load-kv-pressure-weight",
        "least_load: seconds of wait a worker's KV usage k adds, times k / (1 - k)",
        "policy.least_load_kv_pressure_weight",
        default=0.15,
        type=float,
    ),
    Flag(
        "--least-load-default-throughput",
        "least_load: tokens/s a worker drains when its engine reports no gen_throughput",
        "policy.least_load_default_throughput",
        default=2000.0,
        type=float,
    ),
    Flag(
        "--least-load-mean-prefill-tokens",
        "least_load: tokens a request (routed, queued or running) is counted as",
        "policy.least_load_mean_prefill_tokens",
        default=1024,
        type=int,
    ),
    Flag(
        "--least-load-max-waiting-requests",
        "least_load: leave out a worker whose waiting requests (reported, plus sent since) "
        "reached this, unless all have (0: never)",
        "policy.least_load_max_waiting_requests",
        default=0,
        type=int,
    ),
    Flag(
        "--power-of-two-load-metric",
        "what power_of_two compares: expected_wait (least_load's score of two random "
        "workers), requests (the two's legs in flight), least_requests (all workers' legs)",
        "policy.power_of_two_load_metric",
        default="expected_wait",
        choices=LOAD_METRICS,
    ),
    Flag(
        "--prefix-token-count",
        "prefix_hash: tokens of the prompt's head hashed (four characters a token of text)",
        "policy.prefix_token_count",
        default=256,
        type=int,
    ),
    Flag(
        "--prefix-hash-load-factor",
        "prefix_hash: a worker is overloaded over this multiple of the mean load (and "
        "--prefix-hash-balance-abs-threshold over it): the least loaded worker instead",
        "policy.prefix_hash_load_factor",
        default=1.25,
        type=float,
    ),
    Flag(
        "--prefix-hash-balance-abs-threshold",
        "prefix_hash: a worker is overloaded this many requests over the mean load (and "
        "--prefix-hash-load-factor times it)",
        "policy.prefix_hash_balance_abs_threshold",
        default=10,
        type=int,
    ),
    Flag(
        "--routing-key-override",
        "sticky sessions on any policy: a request's routing key (--routing-key-headers, else "
        "the body's rid without _t<n>/_r<n>) keeps its worker",
        "policy.routing_key_override",
        action=SWITCH,
    ),
    Flag(
        "--sticky-sessions",
        "the same as --routing-key-override",
        action=SWITCH,  # build.py applies it
    ),
    Flag(
        "--sticky-key-idle-secs",
        "the same as --max-idle-secs (SMG 1.13's alias): a routing key unused this long is "
        "forgotten",
        type=int,  # build.py applies it
    ),
    Flag(
        "--routing-key-headers",
        "headers the routing key is read from, in order; the first with a value wins "
        "(default: x-smg-routing-key)",
        "policy.routing_key_headers",
        nargs="*",
        metavar="HEADER",
        convert=tuple,  # not given (None): PolicyConfig's default, as SMG
    ),
    Flag(
        "--tokenizer-path",
        "kv_aware: the model's tokenizer (its directory or tokenizer.json), to tokenize prompts "
        "as the prefill engines do and hash them at their advertised block size",
        "policy.tokenizer_path",
        differs="read only by --prefill-policy kv_aware (SMG's serves its gRPC tokenizer)",
    ),
    Flag(
        "--kv-index-max-blocks",
        "kv_aware: KV blocks kept per engine DP rank (about 100 bytes each; oldest dropped first)",
        "policy.kv_index_max_blocks",
        default=262_144,
        type=int,
    ),
    Flag(
        "--kv-events-stale-secs",
        "kv_aware: a prefill worker whose KV event is overdue this long after a request that "
        "stored blocks is routed by the approximate tree until its events come again",
        "policy.kv_events_stale_secs",
        default=10.0,
        type=float,
    ),
)
