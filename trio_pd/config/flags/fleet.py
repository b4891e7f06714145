"""The table's rows for the fleet: the workers, the PD mode, DP ranks and models, selection
policies, retries, circuit breakers and health checks (one row a flag: see `flag.py`)."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag
from trio_pd.config.router import ASSIGNMENT_MODES, POLICY_NAMES, PREFILL_POLICY_NAMES
from trio_pd.config.values import model_alias, model_aliases, not_bucket

# `action` names `cli/parser.py` maps to its own argparse actions.
# Both routers answer 503 once every breaker of a role is open; trio_pd keeps routing to them.
PANIC_ROUTING = (
    "with every breaker of a role open, trio_pd routes to those workers anyway (panic routing, "
    "as Envoy below its panic threshold; counted in trio_pd_panic_selections) where SGLang's "
    "router and SMG answer 503: a few poisonous requests must not become an outage for every "
    "client, and a worker that is really down leaves rotation by its health checks"
)
PREFILL_WORKER = "prefill_worker"
DECODE_WORKER = "decode_worker"

FLEET: tuple[Flag, ...] = (
    Flag(
        "--prefill",
        "prefill worker URL and bootstrap port (or none); repeatable",
        action=PREFILL_WORKER,  # build.py makes the WorkerSpecs
        default=[],
        nargs="+",
        metavar=("URL", "PORT"),
        differs="also takes `model=NAME`, the model the worker serves (else learned from it)",
    ),
    Flag(
        "--decode",
        "decode worker URL [model=NAME]; repeatable",
        action=DECODE_WORKER,
        default=[],
        nargs="+",
        metavar="URL",
        differs="also takes `model=NAME`",
    ),
    Flag(
        "--pd-disaggregation",
        "PD mode: always on (trio_pd routes prefill/decode pairs only)",
        action=SWITCH,
        differs="without it SGLang's router serves regular workers; trio_pd has no such mode",
    ),
    Flag(
        "--mini-lb",
        "SGLang's debugging MiniLB: --policy random for both roles, with a warning",
        action=SWITCH,  # build.py applies it
        differs="SGLang starts a separate debugging router; trio_pd keeps its own (health, "
        "breakers, retries, aborts) and takes MiniLB's one routing rule",
    ),
    Flag(
        "--enable-igw",
        "routing by model: always on when the workers serve several models",
        action=SWITCH,
        differs="no effect: SGLang's router ignores a request's `model` without it; trio_pd "
        "always honours it",
    ),
    Flag(
        "--dp-aware",
        "data-parallel engines: choose each worker's DP rank, pin it (routed_dp_rank, "
        "disagg_prefill_dp_rank) and align bootstrap rooms with it",
        "dp_aware",
        action=SWITCH,
    ),
    Flag(
        "--default-model",
        "with several models, the one a request naming none goes to",
        "default_model",
    ),
    Flag(
        "--model-alias",
        "an extra client-facing name for a served model, <alias>=<canonical> (SMG 1.13's): a "
        "request naming the alias routes as one naming the model (case-sensitive; repeat for "
        "several). The body goes to the engines as the client sent it",
        "model_aliases",
        default=[],  # a list: argparse copies it before appending
        type=model_alias,
        action="append",
        metavar="ALIAS=MODEL",
        convert=model_aliases,
    ),
    Flag(
        "--worker-startup-timeout-secs",
        "a new worker must pass its first health check within this, else the router gives up "
        "on it (SMG's worker registration timeout)",
        "health.startup_timeout_secs",
        default=1800,
        type=int,
    ),
    Flag(
        "--worker-startup-check-interval",
        "what SMG 0.3.2 uses it for: how often the engines' loads (/v1/loads) are polled for "
        "power_of_two",
        "load_poll_interval_secs",
        default=30,
        type=int,
    ),
    Flag(
        "--remove-unhealthy-workers",
        "a worker given up at start-up (--worker-startup-timeout-secs) is removed, so the "
        "discovery source that lists it (Kubernetes, --discovery-provider file) adds it again "
        "and it is probed afresh once its engine returns (SMG 1.13's recovery by removal); "
        "--no-remove-unhealthy-workers keeps it given up. Default: on with discovery, off "
        "without (nothing would add a static worker back). A worker that went down after "
        "passing is always probed on and rejoins in place",
        "health.remove_unhealthy_workers",
        action="optional",
    ),
    Flag(
        "--disable-health-check",
        "no periodic health checks: a worker is checked until its first pass, then trusted "
        "(as SMG)",
        "health.periodic",
        action=SWITCH,
        invert=True,
    ),
    Flag(
        "--policy",
        "selection policy of both roles unless overridden (manual: sticky by the "
        "X-SMG-Routing-Key header; consistent_hashing: a hash ring of it; least_load: the "
        "shortest expected wait; prefix_hash: a ring of the prompt's head)",
        "policy.policy",
        default="cache_aware",
        type=not_bucket,
        choices=POLICY_NAMES,
        differs="`manual` keeps at most 262144 routing keys (least recently used dropped "
        "first); SGLang bounds them by idle time only",
    ),
    Flag(
        "--prefill-policy",
        "selection policy of prefill workers (bucket: by prompt length); default --policy",
        "policy.prefill_policy",
        choices=PREFILL_POLICY_NAMES,
        differs="`bucket` takes only candidates (healthy, breaker allowing), and a membership "
        "change recomputes its ranges (SGLang's may route to a worker that is out)",
    ),
    Flag(
        "--decode-policy",
        "selection policy of decode workers; default --policy",
        "policy.decode_policy",
        type=not_bucket,
        choices=POLICY_NAMES,
    ),
    Flag(
        "--cache-threshold",
        "cache_aware: prefix match ratio above which the matching worker is chosen",
        "policy.cache_threshold",
        default=0.3,
        type=float,
    ),
    Flag(
        "--balance-abs-threshold",
        "cache_aware: balance load instead when max - min load exceeds this...",
        "policy.balance_abs_threshold",
        default=64,
        type=int,
    ),
    Flag(
        "--balance-rel-threshold",
        "...and max load exceeds min load times this",
        "policy.balance_rel_threshold",
        default=1.5,
        type=float,
    ),
    Flag(
        "--eviction-interval-secs",
        "cache_aware: how often the prefix tree is trimmed",
        "policy.eviction_interval_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--max-tree-size",
        "cache_aware: bytes of memory a worker's prefix tree is trimmed to (its nodes and "
        "their text; twice this trims it at once)",
        "policy.max_tree_size",
        default=67_108_864,
        type=int,
        differs="SGLang's counts characters, which bounds no memory: prompts `A...AB` add ~1 KB "
        "of nodes for one character; here each node's memory counts (issue 26 N5)",
    ),
    Flag(
        "--max-idle-secs",
        "manual policy: forget a routing key unused this long (0: never)",
        "policy.max_idle_secs",
        default=14400,
        type=int,
    ),
    Flag(
        "--assignment-mode",
        "where a new routing key goes: random, min_load (fewest requests in flight), "
        "min_group (fewest routing keys in flight), delegate (where the role's policy sends "
        "it); default random for manual, delegate for --routing-key-override",
        "policy.assignment_mode",
        choices=ASSIGNMENT_MODES,
        differs="SMG 1.13's: no default (random for manual, delegate for the routing-key "
        "override) and a fourth mode, delegate",
    ),
    Flag(
        "--bucket-adjust-interval-secs",
        "bucket policy: its load window, and how often the length ranges are adjusted",
        "policy.bucket_adjust_interval_secs",
        default=5,
        type=int,
    ),
    Flag(
        "--retry-max-retries",
        "attempts per request, the first included",
        "retry.max_retries",
        default=5,
        type=int,
    ),
    Flag(
        "--retry-initial-backoff-ms",
        "wait before the first retry",
        "retry.initial_backoff_ms",
        default=50,
        type=int,
    ),
    Flag(
        "--retry-max-backoff-ms",
        "longest wait between attempts",
        "retry.max_backoff_ms",
        default=30000,
        type=int,
    ),
    Flag(
        "--retry-backoff-multiplier",
        "growth of the wait per attempt",
        "retry.backoff_multiplier",
        default=1.5,
        type=float,
    ),
    Flag(
        "--retry-jitter-factor",
        "random share (0-1) added to or taken from each wait",
        "retry.jitter_factor",
        default=0.2,
        type=float,
    ),
    Flag(
        "--disable-retries", "one attempt per request", "retry.enabled", action=SWITCH, invert=True
    ),
    Flag(
        "--migration-limit",
        "times one request may resume on a fresh pair after its decode broke mid-stream, with "
        "the tokens already sent as its prompt (Dynamo's name; 0: never)",
        "migration_limit",
        default=2,
        type=int,
    ),
    Flag(
        "--cb-failure-threshold",
        "failures that open a worker's circuit breaker",
        "breaker.failure_threshold",
        default=10,
        type=int,
        differs=PANIC_ROUTING,
    ),
    Flag(
        "--cb-success-threshold",
        "successes in half-open state that close it",
        "breaker.success_threshold",
        default=3,
        type=int,
    ),
    Flag(
        "--cb-timeout-duration-secs",
        "how long an open breaker waits before a half-open trial",
        "breaker.timeout_duration_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--cb-window-duration-secs",
        "accepted as SGLang's router does: must be > 0, and (as there) no breaker reads it; "
        "breakers count consecutive failures",
        "breaker.window_duration_secs",
        default=120,
        type=int,
    ),
    Flag(
        "--disable-circuit-breaker",
        "no circuit breakers",
        "breaker.enabled",
        action=SWITCH,
        invert=True,
    ),
    Flag(
        "--health-check-interval-secs",
        "time between a worker's health checks",
        "health.interval_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--health-check-timeout-secs",
        "a health check's time limit",
        "health.timeout_secs",
        default=5.0,
        type=float,
    ),
    Flag(
        "--health-failure-threshold",
        "failed checks in a row that take a worker out of rotation",
        "health.failure_threshold",
        default=3,
        type=int,
    ),
    Flag(
        "--health-success-threshold",
        "passed checks in a row that bring it back",
        "health.success_threshold",
        default=2,
        type=int,
    ),
    Flag(
        "--health-check-endpoint",
        "the path health checks GET",
        "health.endpoint",
        default="/health",
    ),
)
