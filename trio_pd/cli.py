"""`trio-pd serve|engine|demo`: SGLang-router-compatible flags turned into a RouterConfig."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Sequence

from trio_pd.auth import ControlKey, parse_keys
from trio_pd.config import (
    POLICY_NAMES,
    BreakerConfig,
    HealthConfig,
    PolicyConfig,
    RetryConfig,
    RouterConfig,
    TimeoutConfig,
    WorkerSpec,
)
from trio_pd.membership import etcd, kubernetes
from trio_pd.urls import check_syntax


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
        help="accepted for SGLang router compatibility (always on)",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--workers", type=int, default=d.workers, help="hypercorn worker processes")
    p.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs)
    p.add_argument("--max-payload-size", type=int, default=d.max_payload_size)
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
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests)
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout-secs", type=float, default=d.queue_timeout_secs)
    p.add_argument(
        "--api-key",
        default=None,
        help="the key sent to workers as `Authorization: Bearer` (as in SGLang's router; "
        "default: $TRIO_PD_API_KEY)",
    )
    p.add_argument(
        "--control-plane-api-keys",
        nargs="+",
        default=[],
        metavar="ID:NAME:ROLE:KEY",
        help="keys of the router's control plane; role admin may change, user may read",
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
        help="keys clients must present on generation routes (default: open; "
        "$TRIO_PD_DATA_PLANE_API_KEYS, comma-separated)",
    )
    p.add_argument(
        "--worker-url-allow",
        nargs="+",
        default=[],
        metavar="CIDR",
        help="let admin-added workers point into these ranges (link-local, metadata...)",
    )
    p.add_argument(
        "--ca-cert-paths",
        nargs="+",
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
        choices=["debug", "info", "warning", "error", "critical"],
    )
    p.add_argument("--prometheus-port", type=int, default=None)
    pol = PolicyConfig()
    p.add_argument("--policy", choices=POLICY_NAMES, default=pol.policy)
    p.add_argument("--prefill-policy", choices=POLICY_NAMES, default=None)
    p.add_argument("--decode-policy", choices=POLICY_NAMES, default=None)
    p.add_argument("--cache-threshold", type=float, default=pol.cache_threshold)
    p.add_argument("--balance-abs-threshold", type=int, default=pol.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float, default=pol.balance_rel_threshold)
    p.add_argument("--eviction-interval-secs", type=float, default=pol.eviction_interval_secs)
    p.add_argument("--max-tree-size", type=int, default=pol.max_tree_size)
    r = RetryConfig()
    p.add_argument("--retry-max-retries", type=int, default=r.max_retries)
    p.add_argument("--retry-initial-backoff-ms", type=int, default=r.initial_backoff_ms)
    p.add_argument("--retry-max-backoff-ms", type=int, default=r.max_backoff_ms)
    p.add_argument("--retry-backoff-multiplier", type=float, default=r.backoff_multiplier)
    p.add_argument("--retry-jitter-factor", type=float, default=r.jitter_factor)
    p.add_argument("--disable-retries", action="store_true")
    b = BreakerConfig()
    p.add_argument("--cb-failure-threshold", type=int, default=b.failure_threshold)
    p.add_argument("--cb-success-threshold", type=int, default=b.success_threshold)
    p.add_argument("--cb-timeout-duration-secs", type=float, default=b.timeout_duration_secs)
    p.add_argument("--disable-circuit-breaker", action="store_true")
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
    p.add_argument("--health-check-interval-secs", type=float, default=h.interval_secs)
    p.add_argument("--health-check-timeout-secs", type=float, default=h.timeout_secs)
    p.add_argument("--health-failure-threshold", type=int, default=h.failure_threshold)
    p.add_argument("--health-success-threshold", type=int, default=h.success_threshold)
    p.add_argument("--health-check-endpoint", default=h.endpoint)
    kubernetes.add_arguments(p)
    etcd.add_arguments(p)
    p.set_defaults(parser_error=p.error)  # router_config's complaints come with serve's usage


def control_keys(error: Callable[[str], None], values: Sequence[str]) -> tuple[ControlKey, ...]:
    try:
        return parse_keys(values)
    except ValueError as exc:
        error(f"--control-plane-api-keys: {exc}")
        raise


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


def router_config(args: argparse.Namespace) -> RouterConfig:
    error = getattr(args, "parser_error", parser_error)
    kube, shared = membership_configs(args, error)
    return RouterConfig(
        prefill=tuple(WorkerSpec(url, "prefill", port, model) for url, port, model in args.prefill),
        decode=tuple(WorkerSpec(url, "decode", None, model) for url, model in args.decode),
        host=args.host,
        port=args.port,
        workers=args.workers,
        request_timeout_secs=args.request_timeout_secs,
        max_payload_size=args.max_payload_size,
        max_batch_size=args.max_batch_size,
        abort_on_cancel=not args.no_abort_on_cancel,
        dp_aware=args.dp_aware,
        default_model=args.default_model,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout_secs=args.queue_timeout_secs,
        api_key=args.api_key or os.environ.get("TRIO_PD_API_KEY") or None,
        control_plane_api_keys=control_keys(error, args.control_plane_api_keys),
        control_plane_audit_enabled=args.control_plane_audit_enabled,
        data_plane_api_keys=tuple(
            args.data_plane_api_keys
            or [k for k in os.environ.get("TRIO_PD_DATA_PLANE_API_KEYS", "").split(",") if k]
        ),
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
        prometheus_port=args.prometheus_port,
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
            enabled=not args.disable_circuit_breaker,
        ),
        health=HealthConfig(
            interval_secs=args.health_check_interval_secs,
            timeout_secs=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
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
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-pd", description="Prefill/decode disaggregated LLM router on trio."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the PD router"))
    from trio_pd.engine.cli import add_arguments as add_engine_arguments

    add_engine_arguments(commands.add_parser("engine", help="run a simulated PD engine"))
    commands.add_parser("demo", help="start a local PD cluster and show it working")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from trio_pd.server import run

        raise SystemExit(run(router_config(args)))
    elif args.command == "engine":
        from trio_pd.engine.cli import run as run_engine

        run_engine(args)
    else:
        from trio_pd.demo import main as run_demo

        run_demo()
