"""`trio-pd serve|engine|demo`: SGLang-router-compatible flags turned into a RouterConfig."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
from collections.abc import Callable, Sequence

from trio_pd.config import (
    ASSIGNMENT_MODES,
    POLICY_NAMES,
    PREFILL_POLICY_NAMES,
    BreakerConfig,
    ControlKey,
    HealthConfig,
    PolicyConfig,
    RetryConfig,
    RouterConfig,
    TimeoutConfig,
    compat,
    parse_keys,
)
from trio_pd.edge.cors import check_origins
from trio_pd.membership import etcd, kubernetes
from trio_pd.spec import WorkerSpec
from trio_pd.upstream.headers import usable_key
from trio_pd.upstream.urls import check_syntax

LOG_LEVELS = ("debug", "info", "warn", "error", "warning", "critical")  # SGLang's four first
DEFAULT_PROMETHEUS_PORT = 29000  # SMG's; RouterConfig's own default is no listener
# Beside SMG's metrics port; RouterConfig's own default is no admin listener.
DEFAULT_ADMIN_PORT = 29001


def admin_port(value: str) -> int | None:
    """`--admin-port`: a port number, or `none` for no admin listener."""
    if value.lower() == "none":
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or none, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port number (0-65535) or none, not {port}")
    return port


class PrefillAction(argparse.Action):
    """`--prefill URL [PORT|none] [model=NAME]`: a bootstrap port is optional, `none` means no
    port; `model=NAME` names the model the worker serves (else it is learned from the worker)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        url, *rest = values
        model, rest = take_model(parser, option_string, rest)
        if len(rest) > 1:
            parser.error(f"{option_string} takes URL [PORT|none] [model=NAME]: {' '.join(values)}")
        port: int | None = None
        if rest and rest[0].lower() != "none":
            try:
                port = int(rest[0])
            except ValueError:
                parser.error(f"{option_string}: bootstrap port must be an int or none: {rest[0]}")
            if not 1 <= port <= 65535:  # as POST /workers and the membership file check it
                parser.error(f"{option_string}: bootstrap port must be in 1..65535: {port}")
        check_url(parser, url)
        items = list(getattr(namespace, self.dest) or [])
        items.append((url, port, model))
        setattr(namespace, self.dest, items)


class DecodeAction(argparse.Action):
    """`--decode URL [model=NAME]`."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        url, *rest = values
        model, rest = take_model(parser, option_string, rest)
        if rest:
            parser.error(f"{option_string} takes URL [model=NAME]: {' '.join(values)}")
        check_url(parser, url)
        items = list(getattr(namespace, self.dest) or [])
        items.append((url, model))
        setattr(namespace, self.dest, items)


def take_model(
    parser: argparse.ArgumentParser, option: str | None, rest: list[str]
) -> tuple[str | None, list[str]]:
    models = [v for v in rest if v.startswith("model=")]
    if len(models) > 1 or any(not m[6:] for m in models):
        parser.error(f"{option}: one model=NAME at most")
    return (models[0][6:] if models else None), [v for v in rest if not v.startswith("model=")]


def check_url(parser: argparse.ArgumentParser, url: str) -> None:
    try:
        check_syntax(url)
    except ValueError as exc:
        parser.error(str(exc))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument(
        "--prefill",
        nargs="+",
        action=PrefillAction,
        metavar=("URL", "PORT"),
        default=[],
        help="prefill worker URL and bootstrap port (or none); repeatable",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action=DecodeAction,
        default=[],
        metavar="URL",
        help="decode worker URL [model=NAME]; repeatable",
    )
    p.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="PD mode: always on (trio_pd routes prefill/decode pairs only)",
    )
    p.add_argument(
        "--mini-lb",
        action="store_true",
        help="SGLang's debugging MiniLB: --policy random for both roles, with a warning",
    )
    p.add_argument(
        "--enable-igw",
        action="store_true",
        help="routing by model: always on when the workers serve several models",
    )
    p.add_argument("--host", default=d.host, help="address to listen on (IPv4 or IPv6)")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument(
        "--admin-host",
        default=d.admin_host,
        help="address of the admin listener, the control plane's own door (keep it loopback: "
        "without control-plane keys, whoever reaches it may change membership)",
    )
    p.add_argument(
        "--admin-port",
        type=admin_port,
        default=DEFAULT_ADMIN_PORT,
        metavar="PORT|none",
        help="port of the admin listener (plain HTTP): the control routes, probes and metrics; "
        "without control-plane keys, the only place worker membership and cache flushes are "
        "served. 0: any free port; none: no admin listener",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="router processes sharing the port (SO_REUSEPORT), the membership and the metrics",
    )
    p.add_argument(
        "--request-timeout-secs",
        type=float,
        default=d.request_timeout_secs,
        help="a request's whole time, all attempts included (504 after it)",
    )
    p.add_argument(
        "--max-payload-size",
        type=int,
        default=d.max_payload_size,
        help="largest request body in bytes (413 beyond)",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=d.max_buffered_bytes,
        help="memory for request bodies (their parse included) and buffered answers, all "
        "requests together (with --workers N, divided among them): 429 beyond, 413 for a "
        "request that could never fit; 0: no budget",
    )
    p.add_argument(
        "--max-sse-event-bytes",
        type=int,
        default=d.max_sse_event_bytes,
        help="largest SSE event the router buffers from a worker (decode's first, each of "
        "prefill's; later decode events are relayed unbuffered): a larger one fails that leg as "
        "the worker's fault (502)",
    )
    p.add_argument(
        "--no-abort-on-cancel",
        action="store_true",
        help="do not POST /abort_request to engines for legs the router cancels "
        "(for engines without that endpoint)",
    )
    p.add_argument(
        "--dp-aware",
        action="store_true",
        help="data-parallel engines: choose each worker's DP rank, pin it (routed_dp_rank, "
        "disagg_prefill_dp_rank) and align bootstrap rooms with it",
    )
    p.add_argument(
        "--default-model",
        default=None,
        help="with several models, the one a request naming none goes to",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=d.max_batch_size,
        help="longest batch (text/input_ids/prompt lists, chat n) a request may carry",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=d.max_concurrent_requests,
        help="requests in flight at most, streams until their last event; -1: no limit (with "
        "--workers N, divided among them)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=d.queue_size,
        help="requests waiting for a slot beyond --max-concurrent-requests (0: 429 at once)",
    )
    p.add_argument(
        "--queue-timeout-secs",
        type=float,
        default=d.queue_timeout_secs,
        help="longest wait in that queue (then 408, as SGLang's router answers)",
    )
    p.add_argument(
        "--rate-limit-tokens-per-second",
        type=int,
        default=None,
        help="with --max-concurrent-requests N: admit at most this many requests a second "
        "after a burst of N (a token bucket); none or 0: no rate limit, the cap alone",
    )
    p.add_argument(
        "--request-id-headers",
        nargs="*",
        default=None,
        metavar="HEADER",
        help="headers a client's request id is taken from, first present wins (default: "
        "x-request-id x-correlation-id x-trace-id request-id; none listed: always generate)",
    )
    p.add_argument(
        "--cors-allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="origins browsers may call the router from (default: any origin)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="sent to workers as `Authorization: Bearer`, and required of clients on the "
        "generation routes (and the control plane without control-plane keys), as in SGLang's "
        "router; also read from $TRIO_PD_API_KEY",
    )
    p.add_argument(
        "--worker-admin-api-key",
        default=None,
        help="sent on the workers' POST /abort_request (engines started with --admin-api-key "
        "take only that key there); default: the worker's --api-key. Also read from "
        "$TRIO_PD_WORKER_ADMIN_API_KEY; a worker's own admin_api_key (admin API, membership "
        "file) wins",
    )
    p.add_argument(
        "--control-plane-api-keys",
        nargs="*",
        default=[],
        metavar="ID:NAME:ROLE:KEY",
        help="keys of the router's control plane; role admin may change, user may read. One "
        "entry per argument, or a list joined by , or ; (cut only where the next id:name:role: "
        "starts, so a key may hold , and ;)",
    )
    p.add_argument(
        "--control-plane-audit-enabled",
        action="store_true",
        help="log every control-plane change with the key id that made it",
    )
    p.add_argument(
        "--data-plane-api-keys",
        nargs="+",
        default=[],
        metavar="KEY",
        help="more keys clients may present on the generation routes, beside --api-key "
        "(also $TRIO_PD_DATA_PLANE_API_KEYS, comma-separated)",
    )
    p.add_argument(
        "--worker-url-allow",
        nargs="+",
        default=[],
        metavar="CIDR",
        help="let workers point into these refused ranges anyway (link-local, metadata...)",
    )
    p.add_argument(
        "--ca-cert-paths",
        nargs="*",
        default=[],
        metavar="FILE",
        help="CA certificates for https workers (added to the system store)",
    )
    p.add_argument("--client-cert-path", default=None, help="client certificate (mTLS to workers)")
    p.add_argument("--client-key-path", default=None, help="the key of --client-cert-path")
    p.add_argument(
        "--membership-file",
        default=None,
        help="read (and write) worker membership in this JSON file (e.g. a ConfigMap)",
    )
    p.add_argument(
        "--access-log", action="store_true", help="one log line per request (id, route, status...)"
    )
    p.add_argument("--log-json", action="store_true", help="log as JSON lines")
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=LOG_LEVELS,
        help="debug, info, warn, error (SGLang's spellings)",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="also write logs to files in this directory, one per UTC day "
        "(trio-pd.YYYY-MM-DD; every process of --workers N appends to it)",
    )
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=DEFAULT_PROMETHEUS_PORT,
        help="serve /metrics, and only that, on this port (plain HTTP)",
    )
    p.add_argument(
        "--prometheus-host",
        default=d.prometheus_host,
        help="the address of the --prometheus-port listener (IPv4 or IPv6)",
    )
    p.add_argument(
        "--prometheus-duration-buckets",
        type=float,
        nargs="+",
        default=None,
        metavar="SECONDS",
        help="buckets of the *_duration_seconds histograms (default: trio_pd's own)",
    )
    p.add_argument(
        "--worker-startup-timeout-secs",
        type=int,
        default=int(HealthConfig().startup_timeout_secs),
        help="a new worker must pass its first health check within this, else the router "
        "gives up on it (SMG's worker registration timeout)",
    )
    p.add_argument(
        "--worker-startup-check-interval",
        type=int,
        default=int(d.load_poll_interval_secs),
        help="what SMG 0.3.2 uses it for: how often the engines' /get_load is polled for "
        "power_of_two",
    )
    p.add_argument(
        "--disable-health-check",
        action="store_true",
        help="no periodic health checks: a worker is checked until its first pass, then "
        "trusted (as SMG)",
    )
    pol = PolicyConfig()
    p.add_argument(
        "--policy",
        type=not_bucket,
        choices=POLICY_NAMES,
        default=pol.policy,
        help="selection policy of both roles unless overridden (manual: sticky by the "
        "X-SMG-Routing-Key header)",
    )
    p.add_argument(
        "--prefill-policy",
        choices=PREFILL_POLICY_NAMES,
        default=None,
        help="selection policy of prefill workers (bucket: by prompt length); default --policy",
    )
    p.add_argument(
        "--decode-policy",
        type=not_bucket,
        choices=POLICY_NAMES,
        default=None,
        help="selection policy of decode workers; default --policy",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=pol.cache_threshold,
        help="cache_aware: prefix match ratio above which the matching worker is chosen",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=pol.balance_abs_threshold,
        help="cache_aware: balance load instead when max - min load exceeds this...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=pol.balance_rel_threshold,
        help="...and max load exceeds min load times this",
    )
    p.add_argument(
        "--eviction-interval-secs",
        type=float,
        default=pol.eviction_interval_secs,
        help="cache_aware: how often the prefix tree is trimmed",
    )
    p.add_argument(
        "--max-tree-size",
        type=int,
        default=pol.max_tree_size,
        help="cache_aware: prefix tree size it is trimmed to",
    )
    p.add_argument(
        "--max-idle-secs",
        type=int,
        default=pol.max_idle_secs,
        help="manual policy: forget a routing key unused this long (0: never)",
    )
    p.add_argument(
        "--assignment-mode",
        choices=ASSIGNMENT_MODES,
        default=pol.assignment_mode,
        help="manual policy: where a new routing key goes: random, min_load (fewest requests "
        "in flight), min_group (fewest routing keys in flight)",
    )
    p.add_argument(
        "--bucket-adjust-interval-secs",
        type=int,
        default=pol.bucket_adjust_interval_secs,
        help="bucket policy: its load window, and how often the length ranges are adjusted",
    )
    r = RetryConfig()
    p.add_argument(
        "--retry-max-retries",
        type=int,
        default=r.max_retries,
        help="attempts per request, the first included",
    )
    p.add_argument(
        "--retry-initial-backoff-ms",
        type=int,
        default=r.initial_backoff_ms,
        help="wait before the first retry",
    )
    p.add_argument(
        "--retry-max-backoff-ms",
        type=int,
        default=r.max_backoff_ms,
        help="longest wait between attempts",
    )
    p.add_argument(
        "--retry-backoff-multiplier",
        type=float,
        default=r.backoff_multiplier,
        help="growth of the wait per attempt",
    )
    p.add_argument(
        "--retry-jitter-factor",
        type=float,
        default=r.jitter_factor,
        help="random share (0-1) added to or taken from each wait",
    )
    p.add_argument("--disable-retries", action="store_true", help="one attempt per request")
    b = BreakerConfig()
    p.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=b.failure_threshold,
        help="failures that open a worker's circuit breaker",
    )
    p.add_argument(
        "--cb-success-threshold",
        type=int,
        default=b.success_threshold,
        help="successes in half-open state that close it",
    )
    p.add_argument(
        "--cb-timeout-duration-secs",
        type=float,
        default=b.timeout_duration_secs,
        help="how long an open breaker waits before a half-open trial",
    )
    p.add_argument(
        "--cb-window-duration-secs",
        type=int,
        default=int(b.window_duration_secs),
        help="accepted as SGLang's router does: must be > 0, and (as there) no breaker reads "
        "it; breakers count consecutive failures",
    )
    p.add_argument("--disable-circuit-breaker", action="store_true", help="no circuit breakers")
    t = TimeoutConfig()
    p.add_argument(
        "--first-token-timeout-secs",
        type=float,
        default=t.first_token_secs,
        help="streams: decode's first event must come within this",
    )
    p.add_argument(
        "--stream-idle-timeout-secs",
        type=float,
        default=t.stream_idle_secs,
        help="streams: the longest silence of decode once it started",
    )
    p.add_argument(
        "--prefill-hold-timeout-secs",
        type=float,
        default=t.prefill_hold_secs,
        help="how long prefill may still run once decode has answered",
    )
    p.add_argument(
        "--client-body-timeout-secs",
        type=float,
        default=t.client_body_secs,
        help="the client's whole request body must arrive within this (else 408)",
    )
    p.add_argument(
        "--stream-stall-timeout-secs",
        type=float,
        default=t.stream_stall_secs,
        help="a client that has not read its stream for this long is cut off",
    )
    p.add_argument(
        "--shutdown-grace-period-secs",
        type=float,
        default=d.shutdown_grace_period_secs,
        help="on SIGTERM, how long requests in flight may still run",
    )
    p.add_argument("--tls-cert-path", default=None, help="serve HTTPS with this certificate")
    p.add_argument("--tls-key-path", default=None, help="the key of --tls-cert-path")
    p.add_argument(
        "--tls-handshake-timeout-secs",
        type=float,
        default=d.tls_handshake_timeout_secs,
        help="with --tls-cert-path: a client's TLS handshake must end within this, else the "
        "connection is closed",
    )
    p.add_argument(
        "--enable-http2",
        action="store_true",
        help="also serve HTTP/2 (h2c upgrade, prior knowledge, ALPN h2 over TLS) with "
        "hypercorn's limits: 100 streams at once and 1000 requests per connection; off, the "
        "router speaks HTTP/1.1 only",
    )
    p.add_argument(
        "--enable-trace",
        action="store_true",
        help="Enable opentelemetry trace: a span per request, attempt and leg, exported over "
        "OTLP/gRPC; each worker gets its leg's traceparent (needs pip install 'trio_pd[trace]')",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=d.otlp_traces_endpoint,
        help="Config opentelemetry collector endpoint if --enable-trace is set. "
        "format: <ip>:<port> (OTLP over gRPC; http:// or https:// may lead)",
    )
    h = HealthConfig()
    p.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=h.interval_secs,
        help="time between a worker's health checks",
    )
    p.add_argument(
        "--health-check-timeout-secs",
        type=float,
        default=h.timeout_secs,
        help="a health check's time limit",
    )
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        default=h.failure_threshold,
        help="failed checks in a row that take a worker out of rotation",
    )
    p.add_argument(
        "--health-success-threshold",
        type=int,
        default=h.success_threshold,
        help="passed checks in a row that bring it back",
    )
    p.add_argument("--health-check-endpoint", default=h.endpoint, help="the path health checks GET")
    kubernetes.add_arguments(p)
    etcd.add_arguments(p)
    compat.add_arguments(p)
    p.set_defaults(parser_error=p.error)  # router_config's complaints come with serve's usage


def not_bucket(name: str) -> str:
    """`--policy` and `--decode-policy` refuse bucket with a usage error saying why."""
    if name == "bucket":
        raise argparse.ArgumentTypeError(
            "bucket balances prefill workers by prompt length: use --prefill-policy bucket"
        )
    return name


def control_keys(error: Callable[[str], None], values: Sequence[str]) -> tuple[ControlKey, ...]:
    try:
        return parse_keys(values)
    except ValueError as exc:
        error(f"--control-plane-api-keys: {exc}")
        raise


def router_key(args: argparse.Namespace, error: Callable[[str], None]) -> str | None:
    """`--api-key`, else `$TRIO_PD_API_KEY`: visible ASCII either way (it is sent in an
    Authorization header: a CR/LF would fail every leg, or inject a header). Never printed."""
    if args.api_key:
        key, where = args.api_key, "--api-key"
    else:
        key, where = os.environ.get("TRIO_PD_API_KEY") or None, "$TRIO_PD_API_KEY"
    if key is not None and not usable_key(key):
        error(f"{where} must be visible ASCII (it is sent in an Authorization header){hint(key)}")
    return key


def worker_admin_key(args: argparse.Namespace, error: Callable[[str], None]) -> str | None:
    """`--worker-admin-api-key`, else `$TRIO_PD_WORKER_ADMIN_API_KEY`, checked as `--api-key`."""
    if args.worker_admin_api_key:
        key, where = args.worker_admin_api_key, "--worker-admin-api-key"
    else:
        key = os.environ.get("TRIO_PD_WORKER_ADMIN_API_KEY") or None
        where = "$TRIO_PD_WORKER_ADMIN_API_KEY"
    if key is not None and not usable_key(key):
        error(f"{where} must be visible ASCII (it is sent in an Authorization header){hint(key)}")
    return key


def data_plane_keys(args: argparse.Namespace, error: Callable[[str], None]) -> tuple[str, ...]:
    """`--data-plane-api-keys`, else `$TRIO_PD_DATA_PLANE_API_KEYS` (comma-separated), each
    visible ASCII as `--api-key` is. Named by position, never printed."""
    if args.data_plane_api_keys:
        keys, where = list(args.data_plane_api_keys), "--data-plane-api-keys"
    else:
        raw = os.environ.get("TRIO_PD_DATA_PLANE_API_KEYS", "")
        keys, where = [k for k in raw.split(",") if k], "$TRIO_PD_DATA_PLANE_API_KEYS"
    for n, key in enumerate(keys, 1):
        if not usable_key(key):
            error(f"{where}: key {n} must be visible ASCII (no spaces or control characters)"
                  f"{hint(key)}")  # fmt: skip
    return tuple(keys)


def hint(key: str) -> str:
    """What is wrong with a key, without showing it: a trailing newline is the usual cause."""
    if key.endswith(("\n", "\r")):
        return " (it ends with a line break: a Secret or file written with a newline?)"
    return ""


TRACE_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)


def trace_endpoint(args: argparse.Namespace, error: Callable[[str], None]) -> str:
    """`--otlp-traces-endpoint`, checked as SMG checks it (only with `--enable-trace`), and the
    OpenTelemetry packages present: either missing is a usage error at startup, not a router
    that serves without the traces it was asked for."""
    endpoint: str = args.otlp_traces_endpoint
    if not args.enable_trace:
        return endpoint
    problem = otlp_endpoint_problem(endpoint)
    if problem is not None:
        error(f"--otlp-traces-endpoint {endpoint!r}: {problem}")
    for module in TRACE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            error(
                f"--enable-trace needs OpenTelemetry ({exc.name or module} is missing): "
                "pip install 'trio_pd[trace]'"
            )
            raise
    return endpoint


def otlp_endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a `<host>:<port>` collector address (SMG's config/validation.rs:
    a colon, a host before it, a port 1-65535 after it), or None."""
    scheme, sep, rest = endpoint.partition("://")
    address = rest if sep and scheme in ("http", "https") else endpoint
    host, colon, port = address.rpartition(":")
    if not colon:
        return "expected format <host>:<port>, e.g. otel-collector:4317 or 127.0.0.1:4317"
    if not host:
        return "host part cannot be empty"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "port must be a number between 1 and 65535"
    return None


def parser_error(message: str) -> None:
    raise SystemExit(f"trio-pd serve: error: {message}")


def membership_configs(
    args: argparse.Namespace, error: Callable[[str], None]
) -> tuple[kubernetes.KubernetesConfig | None, etcd.EtcdConfig | None]:
    """The Kubernetes and etcd configs the flags ask for; a bad value is a usage error now,
    not a discovery task failing after startup."""
    try:
        kube = kubernetes.config_from_args(args)
        if kube is not None:  # outside a cluster without --kube-api-server; a missing CA file
            kubernetes.ssl_context(kubernetes.resolve_endpoint(kube, os.environ))
    except ValueError as exc:
        error(f"service discovery: {exc}")
        raise
    try:
        shared = etcd.config_from_args(args)
    except ValueError as exc:
        error(f"--etcd-*: {exc}")
        raise
    if shared is not None and args.membership_file:
        error("--etcd-endpoints and --membership-file are two membership stores: pick one")
    return kube, shared


def compatibility(args: argparse.Namespace, error: Callable[[str], None]) -> tuple[str, ...]:
    """The warnings about SGLang flags given but not acted on; a refused one is a usage error."""
    errors, warnings = compat.check(args)
    if errors:
        error("; ".join(errors))
    if args.mini_lb:
        warnings.append(
            "--mini-lb: SGLang's MiniLB routes at random; trio_pd keeps serving and applies "
            "that: --policy random for prefill and decode"
        )
    return tuple(warnings)


def check_policy_flags(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """The bounds SGLang's router puts on the manual and bucket knobs, as usage errors."""
    if args.max_idle_secs < 0:
        error(f"--max-idle-secs must be 0 (never forget) or more: {args.max_idle_secs}")
    if args.prefill_policy == "bucket" and args.bucket_adjust_interval_secs < 1:
        error(
            f"--bucket-adjust-interval-secs must be 1 or more: {args.bucket_adjust_interval_secs}"
        )


HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token


def edge_checks(args: argparse.Namespace, error: Callable[[str], None]) -> tuple[str, ...]:
    """SMG's own validation of the rate, breaker window and CORS flags (`config/validation.rs`;
    a `*` origin panics there); the checked origins."""
    if args.rate_limit_tokens_per_second is not None and args.rate_limit_tokens_per_second < 0:
        error("--rate-limit-tokens-per-second must be >= 0")
    if args.cb_window_duration_secs <= 0:
        error("--cb-window-duration-secs must be > 0")
    if 0 < args.max_concurrent_requests < args.workers:
        error(
            f"--max-concurrent-requests {args.max_concurrent_requests} is below --workers "
            f"{args.workers}: each process needs one slot at least (it is divided among them)"
        )
    for name in args.request_id_headers or ():
        if not HEADER_NAME.fullmatch(name):
            error(f"--request-id-headers: {name!r} is not an HTTP header name")
    try:
        return check_origins(args.cors_allowed_origins)
    except ValueError as exc:
        error(f"--cors-allowed-origins: {exc}")
        raise


def positive(error: Callable[[str], None], flag: str, value: int) -> int:
    """SMG refuses 0 for its start-up settings (`config/validation.rs`)."""
    if value <= 0:
        error(f"{flag} must be > 0, not {value}")
    return value


def positive_secs(error: Callable[[str], None], flag: str, value: float) -> float:
    if not value > 0:
        error(f"{flag} must be > 0, not {value}")
    return value


def duration_buckets(
    error: Callable[[str], None], values: Sequence[float] | None
) -> tuple[float, ...] | None:
    """Histogram bounds in increasing order, each once; NaN bounds nothing."""
    if values is None:
        return None
    if any(math.isnan(v) for v in values):
        error("--prometheus-duration-buckets: nan is not a bucket bound")
    return tuple(sorted(set(values)))


def check_port(error: Callable[[str], None], flag: str, port: int) -> int:
    if not 0 <= port <= 65535:
        error(f"{flag} must be a port number (0-65535), not {port}")
    return port


def check_admin_port(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """The admin listener cannot share a port with the data plane or the metrics listener."""
    if not args.admin_port:
        return
    wildcard = ("0.0.0.0", "::", "")
    for flag, host, port in (
        ("--port", args.host, args.port),
        ("--prometheus-port", args.prometheus_host, args.prometheus_port),
    ):
        same_host = host == args.admin_host or host in wildcard or args.admin_host in wildcard
        if port == args.admin_port and same_host:
            error(f"--admin-port {args.admin_port} is also {flag}: give the admin listener its own")


def router_config(args: argparse.Namespace) -> RouterConfig:
    error = getattr(args, "parser_error", parser_error)
    warnings = compatibility(args, error)
    kube, shared = membership_configs(args, error)
    check_policy_flags(args, error)
    origins = edge_checks(args, error)
    if args.mini_lb:
        args.policy, args.prefill_policy, args.decode_policy = "random", None, None
    check_port(error, "--prometheus-port", args.prometheus_port)
    check_admin_port(args, error)
    if args.max_buffered_bytes < 0:
        error(f"--max-buffered-bytes must be 0 (no budget) or more, not {args.max_buffered_bytes}")
    return RouterConfig(
        prefill=tuple(WorkerSpec(url, "prefill", port, model) for url, port, model in args.prefill),
        decode=tuple(WorkerSpec(url, "decode", None, model) for url, model in args.decode),
        host=args.host,
        port=args.port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        workers=args.workers,
        request_timeout_secs=args.request_timeout_secs,
        max_payload_size=args.max_payload_size,
        max_batch_size=args.max_batch_size,
        max_buffered_bytes=args.max_buffered_bytes,
        max_sse_event_bytes=positive(error, "--max-sse-event-bytes", args.max_sse_event_bytes),
        abort_on_cancel=not args.no_abort_on_cancel,
        dp_aware=args.dp_aware,
        default_model=args.default_model,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout_secs=args.queue_timeout_secs,
        rate_limit_tokens_per_second=args.rate_limit_tokens_per_second,
        request_id_headers=(
            None if args.request_id_headers is None else tuple(args.request_id_headers)
        ),
        cors_allowed_origins=origins,
        api_key=router_key(args, error),
        worker_admin_api_key=worker_admin_key(args, error),
        control_plane_api_keys=control_keys(error, args.control_plane_api_keys),
        control_plane_audit_enabled=args.control_plane_audit_enabled,
        data_plane_api_keys=data_plane_keys(args, error),
        worker_url_allow=tuple(args.worker_url_allow),
        ca_cert_paths=tuple(args.ca_cert_paths),
        client_cert_path=args.client_cert_path,
        client_key_path=args.client_key_path,
        membership_file=args.membership_file,
        kubernetes=kube,
        etcd=shared,
        access_log=args.access_log,
        log_json=args.log_json,
        log_level=args.log_level,
        log_dir=args.log_dir,
        prometheus_port=args.prometheus_port,
        startup_warnings=warnings,
        prometheus_host=args.prometheus_host,
        prometheus_duration_buckets=duration_buckets(error, args.prometheus_duration_buckets),
        load_poll_interval_secs=positive(
            error, "--worker-startup-check-interval", args.worker_startup_check_interval
        ),
        retry=RetryConfig(
            max_retries=args.retry_max_retries,
            initial_backoff_ms=args.retry_initial_backoff_ms,
            max_backoff_ms=args.retry_max_backoff_ms,
            backoff_multiplier=args.retry_backoff_multiplier,
            jitter_factor=args.retry_jitter_factor,
            enabled=not args.disable_retries,
        ),
        breaker=BreakerConfig(
            failure_threshold=args.cb_failure_threshold,
            success_threshold=args.cb_success_threshold,
            timeout_duration_secs=args.cb_timeout_duration_secs,
            window_duration_secs=args.cb_window_duration_secs,
            enabled=not args.disable_circuit_breaker,
        ),
        health=HealthConfig(
            interval_secs=args.health_check_interval_secs,
            timeout_secs=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
            startup_timeout_secs=positive(
                error, "--worker-startup-timeout-secs", args.worker_startup_timeout_secs
            ),
            periodic=not args.disable_health_check,
        ),
        timeouts=TimeoutConfig(
            first_token_secs=args.first_token_timeout_secs,
            stream_idle_secs=args.stream_idle_timeout_secs,
            prefill_hold_secs=args.prefill_hold_timeout_secs,
            client_body_secs=args.client_body_timeout_secs,
            stream_stall_secs=args.stream_stall_timeout_secs,
        ),
        shutdown_grace_period_secs=args.shutdown_grace_period_secs,
        tls_cert_path=args.tls_cert_path,
        tls_key_path=args.tls_key_path,
        tls_handshake_timeout_secs=positive_secs(
            error, "--tls-handshake-timeout-secs", args.tls_handshake_timeout_secs
        ),
        enable_http2=args.enable_http2,
        enable_trace=args.enable_trace,
        otlp_traces_endpoint=trace_endpoint(args, error),
        policy=PolicyConfig(
            policy=args.policy,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            eviction_interval_secs=args.eviction_interval_secs,
            max_tree_size=args.max_tree_size,
            max_idle_secs=args.max_idle_secs,
            assignment_mode=args.assignment_mode,
            bucket_adjust_interval_secs=args.bucket_adjust_interval_secs,
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-pd", description="Prefill/decode disaggregated LLM router on trio."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the PD router",
        description="Run the PD router. Takes every flag of SGLang's router "
        "(python -m sglang_router.launch_router, sglang-router 0.3.2) with the same meaning; "
        "docs/flags.md says where trio_pd differs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(serve)
    from trio_pd.testing.engine.cli import add_arguments as add_engine_arguments

    add_engine_arguments(commands.add_parser("engine", help="run a simulated PD engine"))
    commands.add_parser("demo", help="start a local PD cluster and show it working")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from trio_pd.serve.run import run

        raise SystemExit(run(router_config(args)))
    elif args.command == "engine":
        from trio_pd.testing.engine.cli import run as run_engine

        run_engine(args)
    else:
        from trio_pd.testing.demo import main as run_demo

        run_demo()
