"""Frozen configuration values of the router; built by the CLI, read everywhere else.

Defaults and names follow SGLang's router (sgl-model-gateway 0.3.2) so deployments can switch
without rewriting their flags.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from trio_pd.config.keys import ControlKey
from trio_pd.config.membership import EtcdConfig, KubernetesConfig
from trio_pd.spec import Role, WorkerSpec

PolicyName = Literal[
    "random", "round_robin", "power_of_two", "cache_aware", "manual", "bucket", "least_load",
    "consistent_hashing", "prefix_hash", "kv_aware",
]  # fmt: skip
# As SGLang's router: `bucket` balances prefill by request length and is a prefill policy only.
POLICY_NAMES: tuple[str, ...] = (
    "random", "round_robin", "cache_aware", "power_of_two", "least_load", "manual",
    "consistent_hashing", "prefix_hash",
)  # fmt: skip
# `kv_aware` routes by the prefill engines' KV events; a decode's KV comes by transfer.
PREFILL_POLICY_NAMES: tuple[str, ...] = (*POLICY_NAMES, "bucket", "kv_aware")
# `delegate`: a new key goes where the role's own policy sends it, then sticks (SMG 1.13).
AssignmentMode = Literal["random", "min_load", "min_group", "delegate"]
ASSIGNMENT_MODES: tuple[str, ...] = ("random", "min_load", "min_group", "delegate")
# What power_of_two compares (SMG 1.13's --power-of-two-load-metric, `fleet/least_load.py`).
LoadMetric = Literal["expected_wait", "requests", "least_requests"]
LOAD_METRICS: tuple[str, ...] = ("expected_wait", "requests", "least_requests")
# Policies that read the routing key themselves: the sticky override leaves them alone (SMG).
KEYED_POLICIES: tuple[str, ...] = ("manual", "consistent_hashing")
ROUTING_KEY_HEADERS: tuple[str, ...] = ("x-smg-routing-key",)  # SMG's default list


@attrs.frozen
class RetryConfig:
    max_retries: int = 5  # total attempts, as SMG counts them
    initial_backoff_ms: int = 50
    max_backoff_ms: int = 30_000
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2
    enabled: bool = True


@attrs.frozen
class BreakerConfig:
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_duration_secs: float = 60.0
    # SMG 0.3.2 validates and stores its window but no breaker reads it (`fleet/breaker.py`).
    window_duration_secs: float = 120.0
    enabled: bool = True


@attrs.frozen
class HealthConfig:
    """Active health checks (`fleet/health.py`).

    As in SMG 0.3.2 a new worker must answer its first check within `startup_timeout_secs`
    (`--worker-startup-timeout-secs`), else the router gives up on it; `periodic=False`
    (`--disable-health-check`) keeps that start-up check and drops every check after it.
    """

    interval_secs: float = 60.0
    timeout_secs: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    startup_timeout_secs: float = 1800.0
    periodic: bool = True
    # `--remove-unhealthy-workers` (SMG 1.13): a worker given up at start-up is removed, so the
    # discovery source that names it adds it again, probed afresh. None: on with discovery.
    remove_unhealthy_workers: bool | None = None


@attrs.frozen
class OverloadConfig:
    """Engine-aware admission (docs/overload.md), SMG 1.13's flags: the overload veto from the
    engines' /v1/loads, the per-prefill in-flight cap with its FIFO queue, the decode's
    running-window gate."""

    protection: bool = True  # --disable-worker-overload-protection turns it off
    waiting_requests: int = 8  # queued for compute, summed over DP ranks (decode: not for KV)
    token_usage: float = 0.8  # KV token usage, mean over DP ranks
    shed: bool = False  # every candidate over: 503 + Retry-After, not the least loaded
    prefill_max_inflight: int = -1  # per prefill worker; <= 0: no cap (SMG's default -1)
    # Requests waiting for a prefill slot, at most, and the longest wait; None: SMG's built-in
    # defaults once the cap is on (100, 60 s).
    prefill_queue_size: int | None = None
    prefill_queue_timeout_secs: float | None = None
    pd_admission_wait_secs: float = 30.0  # wait for a place in the decode's window; 0: no gate

    @property
    def prefill_cap(self) -> int | None:
        return self.prefill_max_inflight if self.prefill_max_inflight > 0 else None

    @property
    def prefill_line(self) -> tuple[int, float]:
        """(the line's size, its timeout), SMG's defaults where not given."""
        size = 100 if self.prefill_queue_size is None else self.prefill_queue_size
        timeout = self.prefill_queue_timeout_secs
        return size, 60.0 if timeout is None else timeout


@attrs.frozen
class TimeoutConfig:
    """Idle timeouts (seconds), in the spirit of AIBrix's decode watchdog. Each ends the request
    with the docs/protocol.md §4 answer (504 before headers, an error frame after) and closes both
    legs; the request deadline (`--request-timeout-secs`) still bounds the whole."""

    first_token_secs: float = 60.0  # stream: dispatch -> decode's first event
    stream_idle_secs: float = 120.0  # stream: longest silence of decode once it started
    prefill_hold_secs: float = 30.0  # prefill may still run this long after decode answered
    client_body_secs: float = 60.0  # the client's whole body must arrive within this
    stream_stall_secs: float = 30.0  # the client has not drained the stream for this long


def _not_bucket(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """SGLang's router refuses a bucket decode policy: decode has no prompt to balance (nor
    does kv_aware choose decodes: their KV cache comes by transfer from the prefill)."""
    if value in ("bucket", "kv_aware"):
        raise ValueError(
            f"{attribute.name}: {value} is a prefill policy (--prefill-policy {value})"
        )


@attrs.frozen
class PolicyConfig:
    """Selection policies and their knobs (SMG's flags; `balance_*` serve cache_aware and bucket,
    `eviction_interval_secs` both the cache-aware trees and manual's idle routing keys)."""

    policy: PolicyName = attrs.field(default="cache_aware", validator=_not_bucket)
    prefill_policy: PolicyName | None = None  # None: use `policy`
    decode_policy: PolicyName | None = attrs.field(default=None, validator=_not_bucket)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 67_108_864
    max_idle_secs: int = 14_400  # manual: a routing key unused this long is forgotten (0: never)
    # Where a new routing key goes; None: random for manual, delegate for the sticky override.
    assignment_mode: AssignmentMode | None = None
    bucket_adjust_interval_secs: int = 5  # bucket: its load window and boundary adjustment
    # least_load (and power_of_two's expected wait): SMG 1.13's knobs and defaults.
    least_load_kv_pressure_weight: float = 0.15  # seconds
    least_load_default_throughput: float = 2000.0  # tokens/s when an engine reports none
    least_load_mean_prefill_tokens: int = 1024  # a request's (and a queued one's) token guess
    least_load_max_waiting_requests: int = 0  # skip a worker this far queued (0: never)
    power_of_two_load_metric: LoadMetric = "expected_wait"
    # prefix_hash: the head of the prompt hashed onto a ring, with a load escape.
    prefix_token_count: int = 256  # tokens hashed (4 characters a token for text)
    prefix_hash_load_factor: float = 1.25  # overloaded past this multiple of the mean load...
    prefix_hash_balance_abs_threshold: int = 10  # ...and this many requests over it
    # Sticky sessions on any policy (SMG's --routing-key-override / --sticky-sessions): a key
    # from `routing_key_headers` (the first with a value), else the body's `rid` lineage.
    routing_key_override: bool = False
    # kv_aware: the model's tokenizer (SMG's --tokenizer-path), the bound of each DP rank's
    # block index, and how long an expected KV event may be overdue before the worker is stale.
    tokenizer_path: str | None = None
    kv_index_max_blocks: int = 262_144
    kv_events_stale_secs: float = 10.0
    routing_key_headers: tuple[str, ...] = attrs.field(
        default=ROUTING_KEY_HEADERS,
        converter=lambda v: ROUTING_KEY_HEADERS if v is None else tuple(v),
    )  # None (the flag not given): x-smg-routing-key, as SMG

    def for_role(self, role: Role) -> PolicyName:
        chosen = self.prefill_policy if role == "prefill" else self.decode_policy
        return chosen or self.policy

    @property
    def uses_routing_key(self) -> bool:
        """A policy routes by the routing key (manual, consistent_hashing, prefix_hash, or the
        sticky override): only then are the headers read."""
        roles = (self.for_role("prefill"), self.for_role("decode"))
        keyed = ("manual", "consistent_hashing", "prefix_hash")
        return self.routing_key_override or any(name in keyed for name in roles)

    @property
    def manual_assignment_mode(self) -> AssignmentMode:
        """The manual policy's mode: random unless set (delegate has nothing to delegate to
        there and falls back to min_load, as SMG)."""
        mode = self.assignment_mode or "random"
        return "min_load" if mode == "delegate" else mode

    @property
    def sticky_assignment_mode(self) -> AssignmentMode:
        """The sticky override's mode: delegate unless set."""
        return self.assignment_mode or "delegate"


@attrs.frozen
class EdgeConfig:
    """The edges of a connection (SMG 1.13's names and defaults, `config/flags/edges.py`)."""

    sse_keepalive_secs: float = 15.0  # a `: ping` after this much silence on a stream; 0: none
    header_read_timeout_secs: float = 30.0  # a request head must be complete within it; 0: none
    idle_connection_timeout_secs: float = 90.0  # a client keep-alive connection idle; 0: none
    upstream_pool_idle_timeout_secs: float = 3.0  # an idle worker connection reused; 0: forever
    health_check_port: int | None = None  # the probe listener (`serve/doors.py`)
    # Client connections a process holds open at once; 0: derived from its fd limit
    # (`serve/fd_budget.py`)
    max_client_connections: int = 0


@attrs.frozen
class RouterConfig:
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    host: str = "0.0.0.0"
    port: int = 30000
    # The admin listener (`serve/doors.py`): the control plane's own door, where its
    # changing routes answer without keys. The CLI's default port is 29001; None: no listener.
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    workers: int = 1  # hypercorn worker processes
    request_timeout_secs: float = 1800.0
    max_payload_size: int = 536_870_912
    max_batch_size: int = 1024  # list lengths and chat `n`, checked before any work
    # Memory for request bodies (with their parse) and buffered answers, per router (split
    # among --workers N); beyond it 429, 413 for what could never fit (`pd/budget.py`). 0: none.
    max_buffered_bytes: int = 2 << 30
    max_sse_event_bytes: int = 16 << 20  # a worker's SSE event the router reads, at most
    abort_on_cancel: bool = True  # POST /abort_request to engines for legs the router gave up
    dp_aware: bool = False  # choose DP ranks, pin them and align rooms (SMG's --dp-aware)
    default_model: str | None = None  # several models: what a request naming none gets
    model_aliases: tuple[tuple[str, str], ...] = ()  # (alias, served model): `--model-alias`
    max_concurrent_requests: int = -1  # -1: unbounded; else the cap on requests in flight
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    rate_limit_tokens_per_second: float | None = None  # admissions/s after a burst; None, 0: none
    request_id_headers: tuple[str, ...] | None = None  # None: request_ids.DEFAULT_HEADERS
    cors_allowed_origins: tuple[str, ...] = ()  # empty: any origin (SMG's meaning)
    # False: no origin is allowed, whatever the list (SMG 1.13 without --cors-allowed-origins)
    cors_enabled: bool = True
    api_key: str | None = attrs.field(default=None, repr=False)  # sent TO workers (SMG's meaning)
    # Sent on the workers' /abort_request (engines with --admin-api-key take only it there).
    worker_admin_api_key: str | None = attrs.field(default=None, repr=False)
    control_plane_api_keys: tuple[ControlKey, ...] = ()
    control_plane_audit_enabled: bool = False
    data_plane_api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    worker_url_allow: tuple[str, ...] = ()  # CIDRs workers may point into anyway
    # Listeners of this router another process serves (the parent's metrics listener under
    # --workers N): a worker URL may not point at them (`upstream/destinations.py`).
    other_listeners: tuple[tuple[str, int], ...] = ()
    ca_cert_paths: tuple[str, ...] = ()  # extra CAs for https workers (system store too)
    client_cert_path: str | None = None  # mTLS to workers
    client_key_path: str | None = None
    membership_file: str | None = None  # shared membership (--workers N, or a ConfigMap)
    # SMG's file discovery: a manifest another program writes, read-only (`membership/manifest.py`).
    discovery_provider: Literal["kubernetes", "file"] | None = None
    discovery_file: str | None = None
    discovery_check_interval_secs: float | None = None  # None: 30 s (SMG's default)
    kubernetes: KubernetesConfig | None = None  # --service-discovery: workers from pods
    etcd: EtcdConfig | None = None  # --etcd-endpoints: membership shared by router replicas
    access_log: bool = False
    log_json: bool = False
    log_level: str = "info"  # SGLang's debug/info/warn/error (warning, critical too)
    log_dir: str | None = None  # also log to daily files there (`logs.py`)
    prometheus_port: int | None = None  # the CLI's default is SMG's 29000; None: no listener
    prometheus_host: str = "0.0.0.0"
    prometheus_duration_buckets: tuple[float, ...] | None = None  # *_duration_seconds histograms
    # --worker-startup-check-interval: what SMG 0.3.2 uses it for, the /get_load polling of
    # power_of_two (its LoadMonitor), not start-up (`fleet/loads.py`).
    load_poll_interval_secs: float = 30.0
    startup_warnings: tuple[str, ...] = ()  # about SGLang flags given but not acted on (compat.py)
    shutdown_grace_period_secs: float = 180.0  # in-flight requests' time to finish on SIGTERM
    tls_cert_path: str | None = None  # serve HTTPS (hypercorn does it)
    tls_key_path: str | None = None
    tls_handshake_timeout_secs: float = 10.0  # a client must finish its TLS handshake within it
    enable_http2: bool = False  # h2c, HTTP/2 prior knowledge and ALPN h2 (hypercorn's HTTP/2)
    enable_trace: bool = False  # OpenTelemetry spans, exported over OTLP/gRPC (`tracing.py`)
    otlp_traces_endpoint: str = "localhost:4317"  # <host>:<port> (SMG's default and format)
    # vLLM PD (docs/vllm.md). The static --prefill/--decode workers speak vLLM's protocol
    # (WorkerSpec.engine); workers added later say their own.
    vllm_pd_disaggregation: bool = False
    kv_connector: Literal["nixl"] = "nixl"  # NixlConnector, pull mode (the only one yet)
    # A vLLM prefill's 200 without kv_transfer_params is sent to decode as a plain request
    # ("decode-local", the prompt computed again) or failed ("fail").
    vllm_missing_kv_params: Literal["decode-local", "fail"] = "decode-local"
    # Migration (issue 29, `pd/migration.py`): how often one request may resume on a fresh pair
    # after its decode broke mid-stream (0: never, a broken stream ends with an error event).
    migration_limit: int = 2
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    health: HealthConfig = HealthConfig()
    policy: PolicyConfig = PolicyConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    edges: EdgeConfig = EdgeConfig()  # connection edges: keep-alives, timeouts, probes
    overload: OverloadConfig = OverloadConfig()
